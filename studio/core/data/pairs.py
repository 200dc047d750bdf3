"""Preference data (DPO / ORPO): pairs of a chosen and a rejected answer to one prompt.

Two shapes are read (docs/preference.md):

- flat: a prompt column (any template fields) plus a chosen and a rejected column of text;
- chat: a conversation plus chosen and rejected final turns. The conversation is a ``prompt`` (or
  ``messages`` / ``conversation``) column of ``{role, content}`` messages, or it is left out and the
  chosen and rejected columns are whole conversations that share it as their prefix (TRL's
  layout). The conversation becomes a transcript, one ``role: content`` line a turn, in the
  template's first prompt field; the chosen and rejected answers are the final turns' text.

Also here: lint for pairs (identical answers, an empty side) and the word-level difference of the
two answers that the dataset pane marks. Plain Python: the UI imports this.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from studio.core.config import RunConfig

PREFERENCE_METHODS = ("dpo", "orpo")
"""``trainer.method`` values that train on pairs."""

CONVERSATION_COLUMNS = ("prompt", "messages", "conversation")
"""Columns the chat shape's conversation is looked for in, in this order."""


def is_preference(config: RunConfig) -> bool:
    """Whether ``config`` trains on chosen / rejected pairs."""
    return config.trainer.method in PREFERENCE_METHODS


def is_messages(value: Any) -> bool:
    """Whether ``value`` is a list of ``{role, content}`` messages (one side of a conversational pair)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, Mapping) and "content" in m for m in value))


def transcript(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation as text: one ``role: content`` line a turn (the prompt a chat pair trains on)."""
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages)


def _final_turn(value: Any) -> str:
    if is_messages(value):
        return str(value[-1].get("content") or "")
    return "" if value is None else str(value)


def flatten_pair(row: Mapping[str, Any], prompt_field: str, chosen: str, rejected: str) -> dict[str, Any]:
    """``row`` with a chat-shaped pair flattened (module docstring); a flat row comes back as it is.

    ``prompt_field`` receives the conversation's transcript, ``chosen`` and ``rejected`` the text of
    the final turns.
    """
    c, r = row.get(chosen), row.get(rejected)
    conversation = next((row[k] for k in (prompt_field, *CONVERSATION_COLUMNS) if is_messages(row.get(k))), None)
    if conversation is None and not (is_messages(c) or is_messages(r)):
        return dict(row)
    out = dict(row)
    if conversation is None and is_messages(c) and is_messages(r):
        shared = 0
        while shared < min(len(c), len(r)) - 1 and c[shared] == r[shared]:
            shared += 1
        conversation = c[:shared]
        c, r = c[shared:], r[shared:]
    out[prompt_field] = transcript(conversation or [])
    out[chosen], out[rejected] = _final_turn(c), _final_turn(r)
    return out


def flatten_table(dataset: Any, config: RunConfig, prompt_field: str) -> Any:
    """``dataset`` with chat-shaped pair columns replaced by text columns (:func:`flatten_pair`), as a
    new Dataset; unchanged (the same object) when its pairs are flat already."""
    from studio.core.data.browse import arrow_table, column_values

    columns = config.data.columns
    chosen = columns.get(config.prompt.response_field, config.prompt.response_field)
    rejected = columns.get(config.prompt.rejected_field, config.prompt.rejected_field)
    target = columns.get(prompt_field, prompt_field)
    table = arrow_table(dataset)
    names = table.column_names
    wanted = [c for c in dict.fromkeys((target, *CONVERSATION_COLUMNS, chosen, rejected)) if c in names]
    values = {c: column_values(dataset, c) for c in wanted}
    if not any(is_messages(v) for c in wanted for v in values[c][:50]):
        return dataset

    rows = [flatten_pair(dict(zip(values, cells, strict=True)), target, chosen, rejected)
            for cells in zip(*values.values(), strict=True)]
    return _replace_columns(dataset, {name: [str(row.get(name) or "") for row in rows]
                                      for name in (target, chosen, rejected)})


def _replace_columns(dataset: Any, columns: dict[str, list[str]]) -> Any:
    """``dataset`` with these text columns set (replaced or added), as a new Dataset."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    from studio.core.data.browse import arrow_table

    table = arrow_table(dataset)
    for name, values in columns.items():
        column = pa.array(values, pa.string())
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, column)
        else:
            table = table.append_column(name, column)
    return Dataset(InMemoryTable(table))


def split_shared_start(chosen: str, rejected: str) -> tuple[str, str, str]:
    """``(prompt, chosen answer, rejected answer)`` of two texts that share their start (TRL's
    implicit prompt): cut where they first differ, moved back to the start of that word, so the
    answers begin with the word they differ in (and the space before it, as TRL does)."""
    cut = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        cut += 1
    while cut > 0 and not chosen[cut - 1].isspace():
        cut -= 1
    if cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


def shared_prompt(dataset: Any, config: RunConfig, source: str) -> Any:
    """TRL's standard pairs with no prompt column: each row's prompt is the start its chosen and
    rejected texts share (:func:`split_shared_start`), written into a ``prompt`` column; the answers
    keep the rest."""
    from studio.core.data.browse import column_values
    from studio.core.data.load import DataError

    columns = config.data.columns
    chosen = columns.get(config.prompt.response_field, config.prompt.response_field)
    rejected = columns.get(config.prompt.rejected_field, config.prompt.rejected_field)
    target = columns.get("prompt", "prompt")
    prompts: list[str] = []
    answers: tuple[list[str], list[str]] = ([], [])
    for row, (c, r) in enumerate(zip(column_values(dataset, chosen), column_values(dataset, rejected), strict=True)):
        head, c_rest, r_rest = split_shared_start(str(c or ""), str(r or ""))
        if not head:
            raise DataError(f"{source}: row {row}: there is no prompt column and '{chosen}' and '{rejected}' do "
                            "not start alike (TRL's implicit prompt is the start they share); add a 'prompt' "
                            "column, or map one with data.columns: {prompt: COLUMN}")
        prompts.append(head)
        answers[0].append(c_rest)
        answers[1].append(r_rest)
    return _replace_columns(dataset, {target: prompts, chosen: answers[0], rejected: answers[1]})


def conversation_pair(row: Mapping[str, Any], prompt_field: str, chosen: str, rejected: str,
                      where: str = "") -> dict[str, Any]:
    """One of TRL's conversational pairs as ``{prompt_field: [messages], chosen: [messages],
    rejected: [messages]}``: text answers become one assistant turn, a text prompt one user turn,
    and with no prompt the turns ``chosen`` and ``rejected`` share at their start are the prompt.
    Raises :class:`~studio.core.prompt.chat.ChatFormatError` naming ``where`` for a value that is neither."""
    from studio.core.prompt.chat import ChatFormatError, parse_turns

    def turns(value: Any, role: str, side: str) -> list[dict[str, Any]]:
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        return [t.as_message() for t in parse_turns(value, f"{where}, {side}")]

    c = turns(row.get(chosen), "assistant", chosen)
    r = turns(row.get(rejected), "assistant", rejected)
    given = row.get(prompt_field)
    if given not in (None, "", []):
        before = turns(given, "user", prompt_field)
    else:
        shared = 0
        while shared < min(len(c), len(r)) - 1 and c[shared] == r[shared]:
            shared += 1
        before, c, r = c[:shared], c[shared:], r[shared:]
    if not before:
        raise ChatFormatError(f"{where}: the pair has no prompt (no '{prompt_field}' and no turns that "
                              f"'{chosen}' and '{rejected}' share); give the conversation before the answers")
    return {prompt_field: before, chosen: c, rejected: r}


# ----------------------------------------------------------------------------------------- lint


@dataclass(frozen=True)
class PairIssue:
    """A pair that teaches nothing or the wrong thing."""

    kind: str
    """``identical`` (chosen equals rejected), ``empty_chosen`` or ``empty_rejected``."""
    row: int
    message: str


def _normalise(text: str) -> str:
    # Spaces only: case can be the very preference a pair teaches (capitals over small letters).
    return " ".join(text.split())


def lint_pairs(chosen: Sequence[str], rejected: Sequence[str], chosen_name: str = "chosen",
               rejected_name: str = "rejected") -> list[PairIssue]:
    """Rows whose two answers are the same (after collapsing spaces) or where one is empty."""
    issues: list[PairIssue] = []
    for row, (c, r) in enumerate(zip(chosen, rejected, strict=True)):
        if not c.strip():
            issues.append(PairIssue("empty_chosen", row, f"row {row}: the {chosen_name} answer is empty; fill "
                                    "it in or drop the row (the model would learn to prefer saying nothing)"))
        if not r.strip():
            issues.append(PairIssue("empty_rejected", row, f"row {row}: the {rejected_name} answer is empty; "
                                    "give the worse answer or drop the row"))
        if c.strip() and _normalise(c) == _normalise(r):
            issues.append(PairIssue("identical", row, f"row {row}: {chosen_name} and {rejected_name} are the "
                                    "same text; the pair carries no preference, drop or fix it"))
    return issues


# ----------------------------------------------------------------------------------------- diff

_WORDS = re.compile(r"\S+|\s+")


@dataclass(frozen=True)
class Piece:
    """A run of an answer's text, ``changed`` when the other answer does not have it there."""

    text: str
    changed: bool


def difference(chosen: str, rejected: str) -> tuple[list[Piece], list[Piece]]:
    """Both answers cut into runs of words, those that differ from the other answer marked."""
    a, b = _WORDS.findall(chosen), _WORDS.findall(rejected)
    left: list[Piece] = []
    right: list[Piece] = []
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if i2 > i1:
            left.append(Piece("".join(a[i1:i2]), op != "equal"))
        if j2 > j1:
            right.append(Piece("".join(b[j1:j2]), op != "equal"))
    return left, right
