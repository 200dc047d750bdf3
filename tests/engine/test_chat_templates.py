"""The chat preset and chat datasets render exactly what transformers' apply_chat_template renders.

Three template families: SmolLM2's own tokenizer (ChatML with a default system turn), and test
tokenizers carrying Llama-3's and Mistral's published chat templates (written out below), whose
special tokens and BOS handling differ: Llama 3 writes ``{{ bos_token }}`` itself while its tokenizer
also adds BOS, Mistral ends each assistant turn with the EOS token ``</s>``. The engine's own
encoding path (``Session._encode_data``) is compared token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.tokenizers import smol_tokenizer

from studio.core import prompt
from studio.core.config import RunConfig
from studio.core.data.split import Splits
from studio.core.prompt import chat

# Meta-Llama-3-8B-Instruct's chat_template, as published in its tokenizer_config.json.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.2's chat_template, as published in its tokenizer_config.json.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}"
)

INSTRUCTION_ROWS = [
    {"instruction": "Reverse the word.", "input": "stone", "output": "enots"},
    {"instruction": "Say hello in French.", "input": "", "output": "Bonjour !"},
]
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "12, since 4 × 3 = 12."},
]
SYSTEM = {"role": "system", "content": "You answer in one line."}


def _family(base: Any, template: str, bos: str, eos: str, extra: list[str]) -> Any:
    """A tokenizer with ``base``'s vocabulary, the family's special tokens and chat template, and a
    post-processor that puts BOS in front of every text (as Llama 3's and Mistral's do)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer.__class__.from_str(
        base.backend_tokenizer.to_str()))
    tok.add_special_tokens({"bos_token": bos, "eos_token": eos, "pad_token": eos,
                            "additional_special_tokens": extra})
    bos_id = tok.convert_tokens_to_ids(bos)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    tok.chat_template = template
    assert tok("a")["input_ids"][0] == bos_id
    return tok


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    smol = smol_tokenizer()
    return {
        "smollm2": smol,
        "llama3": _family(smol, LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>",
                          ["<|start_header_id|>", "<|end_header_id|>"]),
        "mistral": _family(smol, MISTRAL_TEMPLATE, "<s>", "</s>", []),
    }


FAMILIES = ["smollm2", "llama3", "mistral"]


def _session(tok: Any, template: str = "chat", max_len: int = 2048) -> Any:
    """An engine Session around ``tok`` alone: its data encoding is what training uses."""
    from studio.engine.session import Session

    config = RunConfig()
    config.prompt.template = template
    config.data.max_seq_length = max_len
    session = Session(config, run=None, emit=lambda _event: None)  # type: ignore[arg-type]
    session.tokenizer = tok
    return session


def _reference(tok: Any, messages: list[dict]) -> tuple[str, list[int]]:
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return text, list(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_preset_renders_what_apply_chat_template_renders(tokenizers: dict, family: str) -> None:
    tok = tokenizers[family]
    session = _session(tok)
    data = session._encode_data(Splits(train=list(INSTRUCTION_ROWS), validation=[], test=[]))
    for row, encoded in zip(INSTRUCTION_ROWS, data.train, strict=True):
        user = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        text, ids = _reference(tok, [{"role": "user", "content": user},
                                     {"role": "assistant", "content": row["output"]}])
        rendered = prompt.render(data.template, row)
        assert rendered.text == text, "the preset's text is byte for byte the chat template's"
        assert encoded.input_ids == ids, "one BOS, one end of turn: the same tokens as transformers"
        # Loss starts at the answer; with the borrowed GPT-2-style pre-tokenizer, Llama 3's "\n\n"
        # before it is two tokens in the whole text but one in the prompt alone, so they count as answer.
        learned = tok.decode(encoded.input_ids[encoded.prompt_tokens:])
        assert learned.lstrip("\n").startswith(row["output"]) and learned.rstrip("\n").endswith(tok.eos_token)
        assert text.count(tok.eos_token) == ids.count(tok.eos_token_id) == text.count(tok.eos_token)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversations_render_and_mask_like_the_chat_template(tokenizers: dict, family: str) -> None:
    tok = tokenizers[family]
    session = _session(tok)
    messages = ([SYSTEM] if family != "mistral" else []) + CONVERSATION
    data = session._encode_data(Splits(train=[{"messages": messages}], validation=[], test=[]))
    text, ids = _reference(tok, messages)
    assert session.chat_renderer().render(chat.parse_turns(messages)).text == text
    encoded = data.train[0]
    assert encoded.input_ids == ids
    # Loss on both assistant turns (content and end of turn) and nothing else.
    learned = [i for i, label in zip(encoded.input_ids, encoded.labels, strict=True) if label != prompt.IGNORE_INDEX]
    assert learned, "assistant tokens carry labels"
    said = tok.decode(learned)
    assert "4." in said and "12, since 4 × 3 = 12." in said
    assert "What is 2 + 2?" not in said and "And times 3?" not in said and "one line" not in said
    assert said.count(tok.eos_token if family != "llama3" else "<|eot_id|>") == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_held_out_prompt_is_everything_before_the_last_assistant_turn(tokenizers: dict, family: str) -> None:
    from studio.engine.evaluate import prompt_and_target

    tok = tokenizers[family]
    session = _session(tok)
    session.data = session._encode_data(Splits(train=[{"messages": CONVERSATION}], validation=[], test=[]))
    fields, target = prompt_and_target({"messages": CONVERSATION}, "output")
    assert target == "12, since 4 × 3 = 12."
    expected = tok.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True)
    assert session.render_prompt(fields) == expected
    # A plain message typed in the chat pane is a one-turn conversation on chat data.
    assert session.render_prompt("hi") == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_lint_flags_a_doubled_end_of_turn(tokenizers: dict) -> None:
    doubled = "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n{output}<|im_end|>\n<|im_end|>"
    kinds = [i.kind for i in prompt.lint_template(doubled, ["instruction", "output"])]
    assert "double_eos" in kinds
    single = prompt.resolve_template("chat", tokenizers["smollm2"].chat_template)
    assert "double_eos" not in [i.kind for i in prompt.lint_template(single, ["instruction", "input", "output"])]


def test_long_conversation_keeps_an_assistant_turn_when_truncated(tokenizers: dict) -> None:
    tok = tokenizers["smollm2"]
    long_question = "word " * 300
    messages = [{"role": "user", "content": long_question}, {"role": "assistant", "content": "short answer"}]
    encoded = _session(tok, max_len=64)._encode_data(
        Splits(train=[{"messages": messages}], validation=[], test=[])).train[0]
    assert len(encoded.input_ids) == 64 and encoded.truncated
    assert "short answer" in tok.decode([i for i, lab in zip(encoded.input_ids, encoded.labels, strict=True)
                                         if lab != prompt.IGNORE_INDEX])


def test_single_turn_rows_keep_one_response_span() -> None:
    """Single-turn instruction data renders as before: one response span to the end, EOS appended."""
    rendered = prompt.render("alpaca", INSTRUCTION_ROWS[0])
    assert rendered.response == "enots" and not rendered.loss_spans
    assert prompt.eos_to_append(rendered, 2, "</s>") == 2
