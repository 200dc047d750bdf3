"""The Ollama Modelfile made from a run's prompt template (plain Python, no model needed)."""

from __future__ import annotations

from studio.core.modelfile import modelfile, ollama_template, stop_sequences

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
