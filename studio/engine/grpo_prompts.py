"""GRPO's prompts as the Trainer's units: encoded prompts, their seeded order, and micro-batches of them.

A GRPO step takes ``effective_batch_size`` prompts from :class:`PromptStream` (the same seeded,
cursor-addressed order the SFT data stream keeps, never packed); each unit carries its place in the
step, the key of its completions' sampling noise (engine/sampler.py). A :class:`PromptBatch` is what
the Trainer hands engine/grpo.py's objective: its completions are sampled when it is trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from studio.core.config import RunConfig
from studio.core.grpo import rows as grpo_rows
from studio.engine.batching import Cursor, DataStream


@dataclass(frozen=True)
class PromptExample:
    """One training prompt: its tokens, its data row, and what the rewards get as the prompt."""

    input_ids: list[int]
    """The prompt's tokens as the policy reads them (BOS included where the model uses one)."""
    row: dict[str, Any]
    prompt: Any
    """What the rewards receive as the prompt: the rendered text, or the conversation's messages."""
    text: str
    """The prompt as text (the chat template's rendering for a conversation)."""
    truncated: bool = False
    """Whether the prompt lost its start to fit ``data.max_seq_length - max_completion_length``."""


@dataclass
class PromptBatch:
    """A micro-batch of prompts (its completions are sampled when it is trained on). Quacks like
    engine/batching.py's MicroBatch where the Trainer needs it to."""

    examples: list[PromptExample]
    positions: list[int]
    """Each prompt's place among the step's prompts (over every rank): the key of its noise."""
    label_tokens: int
    """The loss's divisor for these prompts: completions (grpo) or completions x max length (dr_grpo)."""
    tokens: int = 0

    def to(self, device: Any, non_blocking: bool = False) -> PromptBatch:
        """The same batch: its tensors are made when its completions are sampled."""
        return self

    def pin(self) -> PromptBatch:
        """The same batch (nothing to pin yet)."""
        return self


class PromptStream(DataStream):
    """The seeded order of the training prompts (padded, never packed). A step's units carry their
    place in the step, which keys each prompt's sampling noise."""

    def __init__(self, examples: Sequence[PromptExample], seed: int, max_len: int, per_prompt: int):
        super().__init__(examples, seed, packing=False, max_len=max_len)
        self.per_prompt = per_prompt
        """What one prompt adds to the loss's divisor (see :attr:`PromptBatch.label_tokens`)."""

    def take(self, cursor: Cursor, n: int) -> tuple[list[list[int]], Cursor]:
        """The next ``n`` prompts as ``[example index, place in the step]`` units."""
        units, after = super().take(cursor, n)
        return [[unit[0], place] for place, unit in enumerate(units)], after

    def collate(self, units: Sequence[Sequence[int]], pad_id: int) -> PromptBatch:  # type: ignore[override]
        """A micro-batch of the prompts in ``units``."""
        examples = [self.examples[unit[0]] for unit in units]
        return PromptBatch(examples, [unit[1] for unit in units], len(units) * self.per_prompt,
                           sum(len(e.input_ids) for e in examples))


def encode_prompts(rows: Sequence[dict[str, Any]], config: RunConfig, tokenizer: Any, render: Callable[[dict], str],
                   bos: int | None) -> list[PromptExample]:
    """Training prompts from GRPO rows: rendered (``render``: the session's prompt renderer) and
    tokenized as generation reads them; a prompt longer than ``data.max_seq_length -
    grpo.max_completion_length`` tokens loses its start."""
    from studio.core.prompt import bos_to_prepend

    room = max(1, config.data.max_seq_length - config.grpo.max_completion_length)
    out = []
    for row in rows:
        messages = grpo_rows.conversation(row)
        text = render(row)
        ids = tokenizer.encode(text, add_special_tokens=False)
        first = bos_to_prepend(text, bos, tokenizer.bos_token)
        head = [first] if first is not None else []
        truncated = len(head) + len(ids) > room
        if truncated:
            ids = ids[len(ids) - max(1, room - len(head)):]
        out.append(PromptExample(head + ids, dict(row), messages if messages is not None else text, text, truncated))
    return out
