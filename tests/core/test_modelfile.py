"""The Ollama Modelfile made from a run's prompt template or the model's chat template (plain Python, no
model needed)."""

from __future__ import annotations

import pytest
from helpers import go_template as go
from helpers import tiny_families

from studio.core.export.modelfile import modelfile, ollama_template, stop_sequences
from studio.core.export.ollama_chat import chat_turns, go_template
from studio.core.prompt.jinja import compile_chat_template

CHATML = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n{instruction}\n\n{input}<|im_end|>\n"
          "<|im_start|>assistant\n{output}<|im_end|>\n")


def test_chatml_template_becomes_a_go_template_with_its_end_marker_as_stop() -> None:
    assert ollama_template(CHATML) == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
                                       "{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n")
    assert stop_sequences(CHATML, eos_token="<|im_end|>") == ["<|im_end|>", "<|im_start|>user"]


def test_alpaca_preset_renders_its_no_input_wording_like_studio_chat() -> None:
    text = ollama_template("alpaca")
    assert text.startswith("Below is an instruction that describes a task. Write a response")
    assert text.endswith("### Instruction:\n{{ .Prompt }}\n\n### Response:\n")
    assert stop_sequences("alpaca", eos_token="</s>") == ["</s>", "### Instruction:"]


def test_literal_braces_survive_as_go_strings_and_the_file_has_every_part() -> None:
    # {{{{ in a Studio template is a literal {{, which Go templates must print as a string.
    text = modelfile("model-q8_0.gguf", "Q{{{{x}}}}: {question}\nA: {answer}", response_field="answer",
                     eos_token="<eos>", temperature=0.0, adapter_name="adapter-lora-f32.gguf")
    assert 'TEMPLATE """Q{{ "{{" }}x}}: {{ .Prompt }}\nA: """' in text
    assert text.splitlines()[1] == "FROM ./model-q8_0.gguf"
    assert "#   ADAPTER ./adapter-lora-f32.gguf" in text
    assert 'PARAMETER stop "<eos>"' in text and "PARAMETER temperature 0" in text


# ------------------------------------------------------------------- the model's chat template in Go

TEMPLATES = {name: getattr(tiny_families, name) for name in ("CHATML", "QWEN_DEFAULT_SYSTEM", "LLAMA3", "GEMMA", "PHI3")}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("with_system", [False, True])
def test_the_go_template_writes_what_the_chat_template_writes(name: str, with_system: bool) -> None:
    """Rendered as Ollama would (tests/helpers/go_template.py), the Go template gives the Jinja template's
    exact text for a multi-turn conversation ending in the generation prompt, with and without a
    system prompt (Qwen's default system turn, Gemma's system folded into the first user turn)."""
    chat = TEMPLATES[name]
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And {{ 3+3 }}?\nThanks"}]
    system = "You answer briefly." if with_system else ""
    jinja_messages = ([{"role": "system", "content": system}] if system else []) + messages
    expected = compile_chat_template(chat).render(messages=jinja_messages, add_generation_prompt=True,
                                                  bos_token="", eos_token="<eos>")
    turns = chat_turns(chat, eos_token="<eos>")
    assert turns is not None
    template = go_template(turns)
    assert go.render(template, messages, system) == expected
    assert go.render(template, jinja_messages, system) == expected  # system also among the messages


def test_family_stops_and_a_template_that_does_more_than_wrap() -> None:
    ended = {"CHATML": "<|im_end|>", "LLAMA3": "<|eot_id|>", "GEMMA": "<end_of_turn>", "PHI3": "<|end|>"}
    for name, marker in ended.items():
        assert chat_turns(TEMPLATES[name]).end_marker == marker
    # A run on its own template keeps it, and gains the family's end-of-turn marker as a stop.
    text = modelfile("m.gguf", "alpaca", eos_token="<|endoftext|>", chat_template=tiny_families.CHATML)
    assert "{{ .Prompt }}" in text and 'PARAMETER stop "<|im_end|>"' in text
    # Numbering the turns is more than wrapping each message: the run's template stays, and says why.
    numbered = "{% for m in messages %}{{ loop.index }}. {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert chat_turns(numbered) is None
    text = modelfile("m.gguf", "alpaca", eos_token="</s>", chat_template=numbered, use_chat=True)
    assert "does more than wrap each message" in text and "{{ .Prompt }}" in text
    chat = modelfile("m.gguf", "alpaca", eos_token="<eos>", chat_template=tiny_families.GEMMA, use_chat=True)
    assert "{{ range $i, $_ := .Messages }}" in chat and 'PARAMETER stop "<end_of_turn>"' in chat
