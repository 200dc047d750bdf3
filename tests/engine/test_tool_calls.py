"""Tool-calling conversations train exactly as transformers renders them, for four families' formats.

The chat templates are tests/helpers/tool_templates.py's (Qwen2.5, Qwen3, Llama 3.1, Mistral v0.3 tool
calling, each written from its family's documented format); the tokenizers are SmolLM2's vocabulary
with each family's special tokens (tests/engine/test_chat_templates.py's helpers). The reference is
``tokenizer.apply_chat_template(messages, tools=tools)``: the engine's encoding of the row
(``Session._encode_data``) must give its text and its ids, with the loss on the assistant turns,
tool calls included, and never on a tool's result, the user's words or the tools' schemas.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import tool_templates
from helpers.tokenizers import smol_tokenizer
from test_chat_templates import _family, _session

from studio.core.config import RunConfig
from studio.core.data.split import Splits, load_splits
from studio.core.prompt import chat

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RESULT = '{"temperature_c": 18, "sky": "clear"}'
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # OpenAI's shape: no text, one call
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": RESULT},
    {"role": "assistant", "content": "It is 18 C and clear in Paris."},
]


def _qwen(base: Any, template: str) -> Any:
    """SmolLM2's vocabulary (ChatML's <|im_start|> / <|im_end|> already in it) with Qwen's added
    tool tokens and no BOS, as Qwen's tokenizers have none."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer.__class__.from_str(
        base.backend_tokenizer.to_str()))
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"})
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Any]:
    smol = smol_tokenizer()
    return {
        "qwen2.5": _qwen(smol, tool_templates.QWEN25),
        "qwen3": _qwen(smol, tool_templates.QWEN3),
        "llama3.1": _family(smol, tool_templates.LLAMA31, "<|begin_of_text|>", "<|eot_id|>",
                            ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]),
        "mistral": _family(smol, tool_templates.MISTRAL, "<s>", "</s>",
                           ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]),
    }


FAMILIES = ["qwen2.5", "qwen3", "llama3.1", "mistral"]


def _learned(tok: Any, encoded: Any) -> str:
    return tok.decode([i for i, label in zip(encoded.input_ids, encoded.labels, strict=True) if label != -100])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_calling_conversation_encodes_as_apply_chat_template_does(tokenizers: dict, family: str) -> None:
    tok = tokenizers[family]
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    ids = list(tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True)["input_ids"])
    session = _session(tok)
    row = {"messages": CONVERSATION, "tools": TOOLS}
    encoded = session._encode_data(Splits(train=[row], validation=[], test=[])).train[0]
    assert session.chat_renderer().text(chat.messages_of(row), tools=chat.tools_of(row)) == text
    assert encoded.input_ids == ids, "the same tokens as transformers, one BOS where the family has one"
    learned = _learned(tok, encoded)
    assert "get_weather" in learned and "Paris" in learned, "the tool call is trained"
    assert "It is 18 C and clear in Paris." in learned, "the final answer is trained"
    assert "temperature_c" not in learned and "sky" not in learned, "a tool's result is never trained"
    assert "What is the weather" not in learned and "The weather in a city now." not in learned
    assert learned.count(tok.eos_token) == 2, "each assistant turn's end of turn is trained, and no other"


def test_qwen3_trains_the_empty_think_block_of_the_last_answer_and_every_earlier_answer(tokenizers: dict) -> None:
    """Qwen3 renders the last answer with an empty <think> block and earlier ones without: each
    answer's loss covers what that template put there."""
    tok = tokenizers["qwen3"]
    messages = [*CONVERSATION, {"role": "user", "content": "And in Rome?"},
                {"role": "assistant", "content": "Rome, I cannot say."}]
    encoded = _session(tok)._encode_data(Splits(train=[{"messages": messages, "tools": TOOLS}],
                                                validation=[], test=[])).train[0]
    assert encoded.input_ids == list(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                                             return_dict=True)["input_ids"])
    learned = _learned(tok, encoded)
    assert learned.count("<think>") == 1 and "Rome, I cannot say." in learned
    assert "It is 18 C and clear in Paris." in learned and '"city": "Paris"' in learned
    assert "And in Rome?" not in learned and "temperature_c" not in learned


def test_tool_calls_read_from_a_jsonl_file_render_as_the_data_wrote_them(tokenizers: dict, tmp_path: Path) -> None:
    """Messages with and without tool calls (keys that differ row to row) and per-row tools go
    through the data loader (Arrow) and come out as written: no nulls added, no keys reordered."""
    tok = tokenizers["qwen2.5"]
    search = {"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}}
    other = [{"role": "user", "content": "Find cats."},
             {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                 "name": "search", "arguments": {"limit": 3, "query": "cats"}}}]},
             {"role": "tool", "content": "three cats"},
             {"role": "assistant", "content": "I found three cats."}]
    rows = [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": other, "tools": [search]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig()
    config.data.path, config.prompt.template, config.data.val_fraction = str(path), "chat", 0.0
    splits = load_splits(config)
    assert splits.shape.label == "conversations (OpenAI messages) with tools ('tools')"
    session = _session(tok)
    for row, loaded in zip(rows, splits.train, strict=True):
        expected = tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
        assert session.chat_renderer().render(chat.messages_of(loaded), chat.tools_of(loaded)).text == expected


def test_an_unknown_role_is_refused_naming_its_row_and_the_roles_there_are(tmp_path: Path) -> None:
    from studio.core.data import DataError

    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    config = RunConfig()
    config.data.path, config.prompt.template = str(path), "chat"
    with pytest.raises(DataError, match=r"row 1, column 'messages': turn 1 has the role 'robot'; use system, user, "
                                        r"assistant or tool"):
        load_splits(config)
