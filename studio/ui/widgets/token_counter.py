"""Token counting for the UI: the model's own tokenizer, or a clearly labelled approximation.

Offline there may be no tokenizer.json for the configured model; the panes still show counts, from a
word/punctuation splitter that lands near a BPE tokenizer on English and code, and say so.
No textual import: this runs in thread workers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Roughly how byte-level BPE cuts text: short letter runs with their leading space, digits in
# threes, each other symbol alone.
_APPROX_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?\d{1,3}| ?[^\sA-Za-z\d]|\s+")


@dataclass
class TokenCounter:
    """Counts tokens and locates them in the text (for showing where max length cuts)."""

    label: str
    """What the counts come from, shown beside them (``tokenizer: HuggingFaceTB/...``)."""

    exact: bool
    """False when the counts are the approximation (no tokenizer found)."""

    offsets: Callable[[str], list[tuple[int, int]]]
    """Character span of each token of a text (special tokens not added)."""

    eos_id: int | None = None
    """End-of-sequence id appended to responses (a stand-in id when approximate)."""

    bos_id: int | None = None
    """Beginning-of-sequence id when the model prepends one."""

    chat_template: str | None = None
    """The tokenizer's Jinja chat template, for the ``chat`` preset."""

    eos_token: str | None = None
    """End-of-sequence token text, passed to chat templates."""

    note: str = ""
    """Why the approximation is in use (the lookup error), empty when exact."""

    batch_counts: Callable[[list[str]], list[int]] | None = None
    """Fast batched counting when the tokenizer supports it."""

    tokenizer: Any = None
    """The ``tokenizers.Tokenizer`` itself (None when approximate), for studio.core.data's batching."""

    def tokenize(self, text: str) -> list[int]:
        """Stand-in ids, one a token: enough for :func:`studio.core.prompt.encode`'s counts."""
        return [0] * len(self.offsets(text))

    def count(self, texts: Iterable[str]) -> list[int]:
        """Token count of each text."""
        texts = [t if isinstance(t, str) else "" if t is None else str(t) for t in texts]
        if self.batch_counts is not None:
            return self.batch_counts(texts)
        return [len(self.offsets(t)) for t in texts]


def approximate_counter(note: str = "", model: str = "") -> TokenCounter:
    """The fallback counter: about one token per short word piece or symbol."""
    label = "≈ approximate token counts"
    if model:
        label += f" (no local tokenizer for {model.rstrip('/').split('/')[-1]}: 'studio pull')"

    def offsets(text: str) -> list[tuple[int, int]]:
        return [m.span() for m in _APPROX_PIECE.finditer(text)]

    return TokenCounter(label=label, exact=False,
                        offsets=offsets, eos_id=0, note=note)


def load_token_counter(model: str, revision: str | None = None) -> TokenCounter:
    """The counter for ``model`` through studio.core.prompt.tokens (no torch); the approximation if none."""
    from studio.core.prompt import tokens

    try:
        info = tokens.load_tokenizer_info(model, revision)
    except (FileNotFoundError, ValueError) as exc:
        return approximate_counter(str(exc), model)
    tokenizer = info.tokenizer

    def offsets(text: str) -> list[tuple[int, int]]:
        return list(tokenizer.encode(text, add_special_tokens=False).offsets)

    def batch(texts: list[str]) -> list[int]:
        return tokens.count_tokens(tokenizer, texts)

    name = Path(model).name if Path(model).exists() else model
    return TokenCounter(label=f"tokenizer: {name}", exact=True, offsets=offsets, eos_id=info.eos_id,
                        bos_id=info.bos_id if info.add_bos else None, chat_template=info.chat_template,
                        eos_token=info.eos_token, batch_counts=batch, tokenizer=tokenizer)
