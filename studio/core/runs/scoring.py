"""Scores for comparing a model's answers with the targets of held-out rows.

Two numbers a person can read: exact match after normalisation (case, surrounding and repeated
whitespace, a trailing full stop) and a character-level similarity in 0..1 (difflib's ratio), which
credits an answer that is nearly right. The chat pane's held-out table and ``studio eval`` share
them, so the UI and the CLI report the same figures.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower case, whitespace runs collapsed to one space, ends trimmed, a final ``.`` dropped."""
    text = _SPACE.sub(" ", text.strip().lower())
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match(answer: str, target: str) -> bool:
    """True when the answer equals the target after :func:`normalise`."""
    return normalise(answer) == normalise(target)


def similarity(answer: str, target: str) -> float:
    """How alike the normalised texts are, 0 (nothing shared) to 1 (equal): difflib's ratio."""
    a, b = normalise(answer), normalise(target)
    if not a and not b:
        return 1.0
    # autojunk off: with it, characters frequent in long texts are ignored and the ratio drops.
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


@dataclass(frozen=True)
class Score:
    """One answer scored against its target."""

    exact: bool
    similarity: float


def score(answer: str, target: str) -> Score:
    """Exact match and similarity of one answer."""
    return Score(exact_match(answer, target), similarity(answer, target))


@dataclass(frozen=True)
class Totals:
    """Scores over many rows: the exact-match rate and the mean similarity, both 0..1."""

    rows: int
    exact_match: float
    similarity: float

    def line(self) -> str:
        """``exact 40.0% · similarity 0.72 (20 rows)``."""
        return f"exact {self.exact_match:.1%} · similarity {self.similarity:.2f} ({self.rows} rows)"


def totals(scores: Iterable[Score]) -> Totals:
    """The exact-match rate and mean similarity of ``scores`` (zeros for none)."""
    items = list(scores)
    if not items:
        return Totals(0, 0.0, 0.0)
    return Totals(
        len(items),
        sum(s.exact for s in items) / len(items),
        sum(s.similarity for s in items) / len(items),
    )
