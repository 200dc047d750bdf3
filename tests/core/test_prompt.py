"""core/prompt/template.py: rendering with response spans, exact loss masks, truncation, presets, lint."""

from __future__ import annotations

import pytest

from studio.core.config import PromptConfig
from studio.core.prompt import (
    IGNORE_INDEX,
    TemplateError,
    encode,
    lint_template,
    placeholder_spans,
    render,
    resolve_template,
    template_fields,
)
from studio.core.prompt.template import ALPACA, ALPACA_NO_INPUT

ROW = {"instruction": "Reverse the word", "input": "stone", "output": "enots"}
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou answer in {json} when asked.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chars(text: str) -> list[int]:
    """A character-level tokenizer: one id per character, so every count can be checked by eye."""
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer trained here in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [render("alpaca", {"instruction": f"Reverse the word {w}", "input": w, "output": w[::-1]}).text
              for w in ("stone", "river", "planet", "garden", "silver", "window", "python", "forest")] * 5
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


# ----------------------------------------------------------------------------------- rendering


def test_alpaca_render_marks_the_response_and_every_field():
    rendered = render("alpaca", ROW)
    assert rendered.response == "enots"
    assert rendered.prompt.endswith("### Input:\nstone\n\n### Response:\n")
    assert rendered.text == rendered.prompt + rendered.response
    assert [s.field for s in rendered.spans] == ["instruction", "input", "output"]
    for span in rendered.spans:
        assert rendered.text[span.start:span.end] == ROW[span.field]
    assert rendered.spans[-1].start == rendered.response_start


@pytest.mark.parametrize("empty", ["", "   ", None])
def test_alpaca_uses_the_no_input_wording_when_a_row_has_no_input(empty):
    rendered = render(resolve_template(PromptConfig(template="alpaca")), {**ROW, "input": empty})
    assert rendered.template == ALPACA_NO_INPUT
    assert "### Input:" not in rendered.text and "paired with an input" not in rendered.text
    assert rendered.response == "enots"


def test_no_input_rules_hold_for_a_saved_literal_in_a_fresh_process():
    """A config may hold the resolved text rather than the preset name; the worker renders it alone."""
    import json
    import subprocess
    import sys

    chat = resolve_template(PromptConfig(template="chat"), CHATML)
    code = ("import json, sys\nfrom studio.core.prompt import render\n"
            "templates, row = json.loads(sys.stdin.read())\n"
            "print(json.dumps([render(t, row).text for t in templates]))")
    row = {**ROW, "input": ""}
    result = subprocess.run([sys.executable, "-c", code], input=json.dumps([[ALPACA, chat], row]),
                            capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout) == [render("alpaca", row).text, render(chat, row).text]
    assert "Reverse the word<|im_end|>" in render(chat, row).text


def test_a_blank_line_before_input_goes_with_an_empty_input():
    template = "{instruction}\n\n{input}\n\nAnswer:\n{output}"
    assert render(template, {**ROW, "input": ""}).text == "Reverse the word\n\nAnswer:\nenots"
    assert render(template, ROW).text == "Reverse the word\n\nstone\n\nAnswer:\nenots"


def test_alpaca_no_input_preset_ignores_the_input():
    rendered = render("alpaca_no_input", ROW)
    assert "stone" not in rendered.text and rendered.response == "enots"


def test_template_without_response_placeholder_gets_the_response_appended():
    rendered = render("Q: {instruction} ({input})\nA: ", ROW)
    assert rendered.text == "Q: Reverse the word (stone)\nA: enots"
    assert rendered.prompt == "Q: Reverse the word (stone)\nA: "
    assert rendered.spans[-1].field == "output"


def test_response_runs_to_the_end_and_doubled_braces_are_literal():
    rendered = render("{{\"q\": {instruction}}}\n{output}\n### End", ROW, response_field="output")
    assert rendered.prompt == '{"q": Reverse the word}\n'
    assert rendered.response == "enots\n### End"


def test_other_response_field():
    rendered = render("alpaca", {"instruction": "Add", "input": "", "answer": "3"}, response_field="answer")
    assert rendered.response == "3"
    assert template_fields(resolve_template(PromptConfig(template="alpaca", response_field="answer"))) == [
        "instruction", "input", "answer"]


def test_placeholder_spans_point_at_the_braces_in_the_template():
    template = "Q: {instruction}\nA: {output}"
    spans = placeholder_spans(template)
    assert [(s.field, template[s.start:s.end]) for s in spans] == [
        ("instruction", "{instruction}"), ("output", "{output}")]


# ------------------------------------------------------------------------------------- encoding


def test_encode_masks_exactly_the_prompt_with_bos_and_eos():
    rendered = render("Q: {instruction}\nA: {output}", ROW)
    encoded = encode(rendered, chars, max_len=100, eos_id=2, bos_id=1)
    prompt = chars("Q: Reverse the word\nA: ")
    assert encoded.input_ids == [1, *prompt, *chars("enots"), 2]
    assert encoded.labels == [IGNORE_INDEX] * (1 + len(prompt)) + [*chars("enots"), 2]
    assert encoded.prompt_tokens == 1 + len(prompt)
    assert not encoded.truncated and encoded.total_tokens == len(encoded.input_ids)


def test_encode_tokenizes_prompt_and_response_separately(bpe):
    rendered = render("alpaca", ROW)

    def tokenize(text):
        return bpe.encode(text, add_special_tokens=False).ids

    eos = bpe.token_to_id("</s>")
    encoded = encode(rendered, tokenize, max_len=512, eos_id=eos)
    assert encoded.input_ids == tokenize(rendered.prompt) + tokenize(rendered.response) + [eos]
    learned = [t for t in encoded.labels if t != IGNORE_INDEX]
    assert learned[-1] == eos
    assert bpe.decode(learned[:-1]) == "enots"
    assert encoded.labels[: encoded.prompt_tokens] == [IGNORE_INDEX] * encoded.prompt_tokens


def test_truncation_cuts_the_response_tail_and_its_eos_first():
    rendered = render("Q: {instruction}\nA: {output}", ROW)
    prompt_len = len("Q: Reverse the word\nA: ")
    encoded = encode(rendered, chars, max_len=prompt_len + 3, eos_id=2)
    assert encoded.truncated
    assert encoded.input_ids == chars(rendered.prompt) + chars("eno")
    assert encoded.labels[-3:] == chars("eno") and 2 not in encoded.input_ids
    assert encoded.total_tokens == prompt_len + 5 + 1


def test_a_prompt_longer_than_max_len_loses_its_start_but_keeps_bos_and_some_response():
    rendered = render("{instruction}\n{output}", {"instruction": "x" * 30 + "END", "output": "abcdefghij"})
    encoded = encode(rendered, chars, max_len=16, eos_id=2, bos_id=1)
    # The response keeps max_len // 4 = 4 tokens; BOS + the prompt's last 11 tokens fill the rest.
    assert encoded.truncated and len(encoded.input_ids) == 16
    assert encoded.input_ids == [1, *chars("xxxxxxxEND\n"), *chars("abcd")]
    assert encoded.labels == [IGNORE_INDEX] * 12 + chars("abcd")
    assert encoded.prompt_tokens == 12


# ----------------------------------------------------------------------------------------- chat


def test_chat_template_renders_with_the_assistant_turn_as_response():
    template = resolve_template(PromptConfig(template="chat"), CHATML)
    rendered = render(template, ROW)
    assert rendered.prompt == ("<|im_start|>system\nYou answer in {json} when asked.<|im_end|>\n"
                               "<|im_start|>user\nReverse the word\n\nstone<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.response == "enots<|im_end|>\n"
    no_input = render(template, {**ROW, "input": ""})
    assert "<|im_start|>user\nReverse the word<|im_end|>" in no_input.text
    # Chat templates end the assistant turn after the response: that marker is worth learning.
    assert lint_template(template, ["instruction", "input", "output"]) == []


def test_chat_preset_without_a_chat_template_is_an_error():
    with pytest.raises(TemplateError, match="no chat template"):
        resolve_template(PromptConfig(template="chat"), None)


def test_presets_and_literal_templates_resolve():
    assert resolve_template(PromptConfig(template="alpaca")) == ALPACA
    assert resolve_template(PromptConfig(template="alpaca_no_input")) == ALPACA_NO_INPUT
    assert resolve_template(PromptConfig(template="Q {instruction}\n{output}")) == "Q {instruction}\n{output}"


# ----------------------------------------------------------------------------------------- lint


FIELDS = ["instruction", "input", "output"]


def test_lint_clean_alpaca():
    assert lint_template("alpaca", FIELDS) == []
    assert lint_template(ALPACA_NO_INPUT, FIELDS) == []


def test_lint_unknown_field_points_at_it_and_suggests_the_nearest_column():
    template = "### Task:\n{instrucion}\n### Answer:\n{output}"
    (issue,) = lint_template(template, FIELDS)
    assert issue.kind == "unknown_field" and issue.severity == "error"
    assert template[issue.offset:].startswith("{instrucion}")
    assert "{instruction}" in issue.message


def test_lint_no_separator_before_the_response():
    template = "Question: {instruction} Answer{output}"
    (issue,) = lint_template(template, FIELDS)
    assert issue.kind == "no_separator"
    assert template[issue.offset:] == "{output}"
    assert lint_template("{instruction}{output}", FIELDS)[0].kind == "no_separator"
    assert lint_template("Q: {instruction}\nA:{output}", FIELDS) == []


def test_lint_text_after_the_response():
    template = "{instruction}\n{output}\n### End of answer"
    (issue,) = lint_template(template, FIELDS)
    assert issue.kind == "response_not_at_end"
    assert template[issue.offset:] == "\n### End of answer"


def test_lint_no_eos_and_missing_response_placeholder():
    kinds = {i.kind: i for i in lint_template("{instruction}\n", FIELDS, add_eos=False)}
    assert set(kinds) == {"no_eos", "no_response"}
    assert kinds["no_response"].severity == "info"
    assert kinds["no_response"].offset == len("{instruction}\n")


@pytest.mark.parametrize(("template", "offset", "text"), [
    ("### Instruction:\n{instruction\n\n### Response:\n{output}", 17, "never closed: write {instruction}"),
    ("Q: {instruction}}\nA: {output}", 16, "closes nothing"),
    ("Q: { instruction }\nA: {output}", 3, "write {instruction} (no spaces)"),
    ("Q: { \nA: {output}", 3, "opens nothing"),
])
def test_lint_flags_a_brace_that_is_no_placeholder_as_an_error(template, offset, text):
    issues = [i for i in lint_template(template, ["instruction", "output"]) if i.kind == "brace"]
    assert len(issues) == 1
    assert issues[0].severity == "error" and issues[0].offset == offset and text in issues[0].message


def test_escaped_braces_and_placeholders_are_not_flagged():
    assert [i for i in lint_template("{{json}} {instruction}\n{output}", ["instruction"]) if i.kind == "brace"] == []
