"""GRPO's built-in rewards: exact match, a regular expression, the last number (GSM8K-style), length.

Each is made from its config entry (studio/core/config/sections.py's RewardConfig) as a function with TRL's
signature, as your own rewards are (studio/core/grpo/rewards.py calls them all the same way). A
completion may be text or a conversational completion (a list of messages): its text is read by
:func:`completion_text`.

Plain Python: the UI and ``studio config check`` import this.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from studio.core.config import RewardConfig

BUILTINS = ("exact_match", "regex", "number_match", "length")
"""Names of the built-in rewards."""

NEEDS = {"exact_match": "column", "number_match": "column", "regex": "pattern", "length": "max_chars"}
"""The option each built-in cannot do without."""

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
"""A number as answers write it: 42, -3.5, .5, 1,234,567."""


def completion_text(completion: Any) -> str:
    """A completion as text: itself, or a conversational completion's (last) message content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content") or "")
    return "" if completion is None else str(completion)


def last_number(text: Any) -> float | None:
    """The last number written in ``text`` (commas between thousands allowed), or None."""
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _exact_match(column: str) -> Callable[..., list[float]]:
    def exact_match(completions: list[Any], **columns: Any) -> list[float]:
        answers = columns[column]
        return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]

    return exact_match


def _number_match(column: str) -> Callable[..., list[float | None]]:
    def number_match(completions: list[Any], **columns: Any) -> list[float | None]:
        out: list[float | None] = []
        for completion, answer in zip(completions, columns[column], strict=True):
            want = answer if isinstance(answer, (int, float)) and not isinstance(answer, bool) else last_number(answer)
            got = last_number(completion_text(completion))
            if want is None:
                out.append(None)  # the row has no number to compare with: the reward does not apply
            else:
                out.append(float(got is not None and math.isclose(got, float(want), rel_tol=1e-9, abs_tol=1e-6)))
        return out

    return number_match


def _regex(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern)

    def regex(completions: list[Any], **_: Any) -> list[float]:
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]

    return regex


def _length(max_chars: int) -> Callable[..., list[float]]:
    def length(completions: list[Any], **_: Any) -> list[float]:
        return [max(0.0, min(1.0, 2.0 - len(completion_text(c)) / max_chars)) for c in completions]

    return length


def builtin(spec: RewardConfig) -> tuple[Callable[..., Any], frozenset[str] | None]:
    """The built-in ``spec`` names, made with its option, and the arguments it takes."""
    if spec.name in ("exact_match", "number_match"):
        make = _exact_match if spec.name == "exact_match" else _number_match
        return make(str(spec.column)), frozenset({"completions", str(spec.column)})
    if spec.name == "regex":
        return _regex(str(spec.pattern)), frozenset({"completions"})
    return _length(int(spec.max_chars or 1)), frozenset({"completions"})
