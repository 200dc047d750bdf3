"""Prompt templates: a dataset row -> training text, with the span that is the response.

A template is text with ``{field}`` placeholders (``{{`` and ``}}`` are literal braces). The text from
the response field's placeholder to the end is the *response*: the preview colours it and the loss
is computed on it only, so one :class:`Rendered` drives both. Presets: ``alpaca`` (falls back to the
no-input wording on rows whose input is empty), ``alpaca_no_input``, ``chat`` (the tokenizer's own
chat template, rendered with Jinja into a ``{field}`` template once) and ``text`` (raw text: the
response field alone, every token trained; studio/core/data/shapes.py sets the field to ``text``).

Encoding the rendered text is studio/core/prompt/labels.py. Plain Python (plus jinja2 for chat
templates): the UI imports this.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from studio.core.prompt.jinja import compile_chat_template
from studio.core.prompt.rendered import Rendered, Span, TemplateError

ALPACA = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes "
    "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n{output}"
)
RAW_TEXT = "text"
"""The raw-text preset (continued pretraining): the ``text`` field as it is, every token trained."""

PRESETS = ("alpaca", "alpaca_no_input", "chat", RAW_TEXT)
"""Names accepted as ``prompt.template`` besides a literal template."""

# Rows with an empty input drop it: the alpaca head switches to its no-input wording, and a blank line
# plus {input} (how chat templates join input to instruction) disappears. Pure text rules, so a template
# saved in a config renders the same in every process.
_ALPACA_HEAD = ALPACA[: ALPACA.index("### Response:")]
_ALPACA_NO_INPUT_HEAD = ALPACA_NO_INPUT[: ALPACA_NO_INPUT.index("### Response:")]
_JOINED_INPUT = "\n\n{input}"

# Text after the response that is only end-of-turn markers (chat templates' <|im_end|>, </s>) is
# what the model should learn to emit, so it is not flagged.
_END_MARKERS = re.compile(r"(\s*<[^<>\s{}]+>)*\s*")
_DOUBLED_MARKER = re.compile(r"(<[^<>\s{}]+>)\s*\1")
_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Every brace, classified: escaped or a placeholder (fine), braces around something that is not a
# field name, an opening brace never closed on its line, a closing brace that closes nothing.
_BRACES = re.compile(r"\{\{|\}\}|\{[A-Za-z_][A-Za-z0-9_]*\}|(\{[^{}\n]*\})|(\{)|(\})")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class TemplateIssue:
    """A lint finding the editor can point at."""

    kind: str
    """``brace`` (a ``{`` or ``}`` that is no placeholder), ``unknown_field``, ``no_separator``,
    ``response_not_at_end``, ``double_eos``, ``no_eos`` or ``no_response``; against the data
    (:func:`studio.core.data.stats.template_column_issues`): ``not_for_conversations``,
    ``conversation_turns`` or ``unused_column``."""

    message: str
    offset: int
    """Character offset in the template the finding is about."""

    severity: str = "warning"
    """``error`` (the template cannot render the data), ``warning`` or ``info``."""


@dataclass(frozen=True)
class _Piece:
    """A parsed template: literal text or a field placeholder, with its offset in the template."""

    text: str
    field: str | None
    offset: int


def parse(template: str) -> list[_Piece]:
    """Split a template into literal text and ``{field}`` placeholders."""
    pieces: list[_Piece] = []
    literal: list[str] = []
    literal_at = 0
    pos = 0
    for match in _TOKEN.finditer(template):
        if match.start() > pos:
            literal.append(template[pos:match.start()])
        if match.group(1) is None:
            literal.append(match.group(0)[0])
        else:
            if literal:
                pieces.append(_Piece("".join(literal), None, literal_at))
                literal = []
            pieces.append(_Piece(match.group(0), match.group(1), match.start()))
            literal_at = match.end()
        pos = match.end()
    if pos < len(template):
        literal.append(template[pos:])
    if literal:
        pieces.append(_Piece("".join(literal), None, literal_at))
    return pieces


def syntax_issues(template: str) -> list[TemplateIssue]:
    """Braces that are neither a ``{field}`` placeholder nor an escaped ``{{`` / ``}}``.

    Such a brace renders as literal text, so a placeholder never closed (``{instruction``) or
    misspelt (``{ instruction }``) would put the brace text, not the field, in every example.
    """
    issues: list[TemplateIssue] = []
    for match in _BRACES.finditer(template):
        enclosed, opened, closed = match.groups()
        where = _position(template, match.start())
        if enclosed is not None:
            inner = enclosed[1:-1].strip()
            if _NAME.fullmatch(inner):
                message = f"'{enclosed}' at {where} is not a placeholder: write {{{inner}}} (no spaces)"
            else:
                message = (f"'{enclosed[:40]}' at {where} is not a placeholder (a field name is letters, "
                           "digits and _): rename the field, or write {{ and }} for literal braces")
        elif opened is not None:
            follows = _NAME.match(template, match.end())
            if follows:
                message = (f"the placeholder '{{{follows.group(0)}' at {where} is never closed: "
                           f"write {{{follows.group(0)}}}")
            else:
                message = f"a '{{' at {where} opens nothing: write {{{{ for a literal brace"
        elif closed is not None:
            message = f"a '}}' at {where} closes nothing: write }}}} for a literal brace"
        else:
            continue
        issues.append(TemplateIssue("brace", message, match.start(), "error"))
    return issues


def _position(text: str, offset: int) -> str:
    """``line L, column C`` of a character offset (1-based, as editors count)."""
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column} of the template"


def template_fields(template: str) -> list[str]:
    """The field names a template uses, in order of first appearance."""
    seen: dict[str, None] = {}
    for piece in parse(template):
        if piece.field is not None:
            seen.setdefault(piece.field)
    return list(seen)


def placeholder_spans(template: str) -> list[Span]:
    """Where each ``{field}`` placeholder sits in the template text (for the editor's highlighting)."""
    return [Span(p.field, p.offset, p.offset + len(p.text)) for p in parse(template) if p.field]


def escape(text: str) -> str:
    """Literal text made safe inside a template (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


# ------------------------------------------------------------------------------------- presets


def resolve_template(prompt_cfg: Any, chat_template: str | None = None, **chat_vars: Any) -> str:
    """The literal template for ``prompt.template``: a preset name is replaced by its text.

    ``prompt_cfg`` is a :class:`~studio.core.config.PromptConfig` or the template string itself.
    ``chat`` needs the tokenizer's ``chat_template`` (see :mod:`studio.core.prompt.tokens`); extra keyword
    arguments (``bos_token``, ``eos_token``) are passed to the Jinja template.
    """
    name = prompt_cfg if isinstance(prompt_cfg, str) else prompt_cfg.template
    response_field = "output" if isinstance(prompt_cfg, str) else prompt_cfg.response_field
    preset = _preset(name, response_field)
    if preset is not None:
        return preset
    if name == "chat":
        if not chat_template:
            raise TemplateError("prompt.template is 'chat' but the model's tokenizer has no chat template; "
                                "use 'alpaca' or write a template with {field} placeholders")
        return chat_to_template(chat_template, response_field=response_field, **chat_vars)
    return name


def _preset(name: str, response_field: str) -> str | None:
    """The text of an alpaca preset with the response field's placeholder (the raw-text preset:
    that placeholder alone, so that all of it is response), or None."""
    if name == RAW_TEXT:
        return "{" + response_field + "}"
    if name not in ("alpaca", "alpaca_no_input"):
        return None
    answer = "{" + response_field + "}"
    return (ALPACA if name == "alpaca" else ALPACA_NO_INPUT).replace("{output}", answer)


def chat_to_template(chat_template: str, response_field: str = "output", **chat_vars: Any) -> str:
    """Render a Jinja chat template into a ``{field}`` template.

    The user turn is the instruction, a blank line and the input (rows with an empty input render
    without the blank line); the assistant turn is the response, so the response span is the
    assistant's part up to the end.
    """
    return _render_chat(chat_template, "{instruction}" + _JOINED_INPUT, response_field, chat_vars)


def without_input(template: str) -> str:
    """The template a row with an empty input renders through (the same template when no rule applies)."""
    if template.startswith(_ALPACA_HEAD):
        template = _ALPACA_NO_INPUT_HEAD + template[len(_ALPACA_HEAD):]
    return template.replace(_JOINED_INPUT, "")


def _render_chat(chat_template: str, user: str, response_field: str, chat_vars: dict[str, Any]) -> str:
    from jinja2 import TemplateError as JinjaError

    # Sentinels that survive any template (no braces, no whitespace) are swapped for placeholders
    # after rendering, so braces that the chat template itself writes stay literal.
    names = ("instruction", "input", response_field)
    marks = {f"\x00F{i}\x00": name for i, name in enumerate(names)}
    user_text = user.replace("{instruction}", "\x00F0\x00").replace("{input}", "\x00F1\x00")
    # The same environment transformers renders chat templates in, so the text matches training time.
    try:
        text = compile_chat_template(chat_template).render(
            messages=[{"role": "user", "content": user_text}, {"role": "assistant", "content": "\x00F2\x00"}],
            add_generation_prompt=False,
            **{"bos_token": "", "eos_token": "", **chat_vars},
        )
    except JinjaError as exc:
        raise TemplateError(f"the tokenizer's chat template does not render: {exc}") from None
    out = escape(text)
    for mark, name in marks.items():
        out = out.replace(mark, "{" + name + "}")
    if "{" + response_field + "}" not in out:
        raise TemplateError("the tokenizer's chat template dropped the assistant message; "
                            "use 'alpaca' or write a template")
    return out


# ------------------------------------------------------------------------------------ rendering


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def render(template: str, row: Mapping[str, Any], response_field: str = "output") -> Rendered:
    """Render ``row`` through ``template`` (a literal template, or ``alpaca``/``alpaca_no_input``).

    The response runs from the response field's placeholder to the end of the text; a template
    without that placeholder gets the response appended. Fields missing from the row render empty.
    A row whose input is empty renders through :func:`without_input` (alpaca's no-input wording; no
    dangling blank line where a chat template joins the input to the instruction).
    """
    template = _preset(template, response_field) or template
    if not _text(row.get("input")).strip():
        template = without_input(template)
    parts: list[str] = []
    spans: list[Span] = []
    length = 0
    response_start: int | None = None
    for piece in parse(template):
        if piece.field is None:
            text = piece.text
        else:
            text = _text(row.get(piece.field))
            if piece.field == response_field and response_start is None:
                response_start = length
            spans.append(Span(piece.field, length, length + len(text)))
        parts.append(text)
        length += len(text)
    if response_start is None:
        response_start = length
        answer = _text(row.get(response_field))
        spans.append(Span(response_field, length, length + len(answer)))
        parts.append(answer)
    return Rendered("".join(parts), response_start, tuple(spans), template)


# ---------------------------------------------------------------------------------------- lint


def lint_template(
    template: str,
    fields: Iterable[str],
    response_field: str = "output",
    add_eos: bool = True,
) -> list[TemplateIssue]:
    """Problems with a template against the available fields (dataset columns), each with an offset.

    Finds: braces that are no placeholder (one never closed, a stray ``}``), placeholders naming no
    field (with the nearest field suggested), no whitespace/colon between the prompt and the
    response, text after the response placeholder, an end-of-turn marker written twice after the
    response (``double_eos``), no EOS, and a missing response placeholder.
    """
    template = _preset(template, response_field) or template
    known = list(fields)
    issues: list[TemplateIssue] = syntax_issues(template)
    pieces = parse(template)
    for piece in pieces:
        if piece.field is None or piece.field in known or piece.field == response_field:
            continue
        close = difflib.get_close_matches(piece.field, known, n=1, cutoff=0.5)
        hint = f"did you mean {{{close[0]}}}?" if close else f"fields available: {', '.join(known) or 'none'}"
        issues.append(TemplateIssue("unknown_field", f"unknown field {{{piece.field}}}: {hint}",
                                    piece.offset, "error"))
    at = next((i for i, p in enumerate(pieces) if p.field == response_field), None)
    if at is None:
        issues.append(TemplateIssue(
            "no_response", f"no {{{response_field}}} placeholder: the response is appended after the "
            "template's last character", len(template), "info"))
        before = template
        response_offset = len(template)
    else:
        response_offset = pieces[at].offset
        before = "".join(p.text for p in pieces[:at] if p.field is None)
        after = pieces[at + 1:]
        tail = "".join(p.text for p in after)
        doubled = _DOUBLED_MARKER.search(tail)
        if doubled:
            issues.append(TemplateIssue(
                "double_eos", f"the end of turn {doubled.group(1)} follows the response twice: the model "
                f"learns to write it twice; keep one", after[0].offset + doubled.start(), "error"))
        if after and not _END_MARKERS.fullmatch(tail):
            issues.append(TemplateIssue(
                "response_not_at_end", f"text after {{{response_field}}} is trained on as part of the "
                "answer; end the template with the response placeholder", after[0].offset))
    preceded_by_field = at is not None and at > 0 and pieces[at - 1].field is not None
    # TRL's standard pairs join ``{prompt}{answer}`` as they are: the data's prompt carries its own
    # separator, as TRL expects it to.
    trl_join = template == "{prompt}{" + response_field + "}"
    if not trl_join and (preceded_by_field or (before and not before[-1].isspace() and before[-1] != ":")):
        issues.append(TemplateIssue(
            "no_separator", f"nothing separates the prompt from the response; put a newline or "
            f"'### Response:' before {{{response_field}}}", response_offset))
    if not add_eos:
        issues.append(TemplateIssue(
            "no_eos", "prompt.add_eos is off: the model will not learn where an answer ends and "
            "will ramble until max_new_tokens", len(template)))
    return issues
