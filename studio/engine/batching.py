"""Micro-batches: the seeded order of the data, padded (length-grouped) or packed rows.

The training data is a stream of *units*: one example each when padding, one packed row of several
examples when packing. Each epoch's order of units is a pure function of (seed, epoch), so a position
in the stream, a :class:`Cursor`, is all a checkpoint needs to carry to continue with exactly the
same batches. An optimizer step takes ``micro_batch_size * accumulation`` units and splits them
into micro-batches; halving the micro-batch after an out-of-memory error splits the same units
finer, so the step (and the run) stays the same.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from studio.core.prompt import IGNORE_INDEX

GROUP_SIZE = 256
"""Padded batching sorts by length within groups of this many examples of the shuffled order: batches
of similar lengths waste little padding, while the order across groups stays random. A constant
(not a multiple of the micro-batch) so that the order does not change when the micro-batch does."""


class Example(Protocol):
    """An encoded example (``studio.core.prompt.Encoded`` fits)."""

    input_ids: list[int]
    labels: list[int]


@dataclass(frozen=True)
class Cursor:
    """A position in the data stream: the epoch and the number of its units already used."""

    epoch: int = 0
    offset: int = 0


@dataclass
class MicroBatch:
    """Tensors for one forward/backward pass."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """None for packed rows: the model then finds each example from where position_ids restart."""

    tokens: int
    """Real (non-pad) tokens: what tokens/s counts."""

    label_tokens: int
    """Tokens that take loss (response tokens after the shift): the loss is averaged over these."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """The same batch on ``device`` (``non_blocking``: without waiting for the device, which
        needs a :meth:`pin`-ned batch to be truly asynchronous)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        mask = move(self.attention_mask) if self.attention_mask is not None else None
        return MicroBatch(move(self.input_ids), move(self.labels), move(self.position_ids), mask,
                          self.tokens, self.label_tokens)

    def pin(self) -> MicroBatch:
        """The same batch in page-locked host memory, which a CUDA copy reads without the host
        waiting for it."""
        mask = self.attention_mask.pin_memory() if self.attention_mask is not None else None
        return MicroBatch(self.input_ids.pin_memory(), self.labels.pin_memory(), self.position_ids.pin_memory(),
                          mask, self.tokens, self.label_tokens)


class DataStream:
    """The seeded, epoch-by-epoch order of the training units."""

    def __init__(self, examples: Sequence[Example], seed: int, packing: bool, max_len: int):
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        self.seed = seed
        self.packing = packing
        self.max_len = max_len
        self._plans: dict[int, list[list[int]]] = {}

    def units(self, epoch: int) -> list[list[int]]:
        """The units of ``epoch`` in order; each unit is a list of example indices."""
        plan = self._plans.get(epoch)
        if plan is None:
            # Only the current and next epoch are ever needed; forget older ones.
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            plan = self._plans[epoch] = self._plan(epoch)
        return plan

    def units_per_epoch(self, epoch: int = 0) -> int:
        """How many units an epoch has (packed epochs differ slightly from one another)."""
        return len(self.units(epoch))

    def _plan(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        if self.packing:
            return pack(order, [len(self.examples[i].input_ids) for i in order], self.max_len)
        units: list[list[int]] = []
        for start in range(0, len(order), GROUP_SIZE):
            group = order[start:start + GROUP_SIZE]
            # Longest first: an out-of-memory error shows at the start of a group, not at the end.
            group.sort(key=lambda i: -len(self.examples[i].input_ids))
            units.extend([i] for i in group)
        return units

    def most_examples(self, rows: int, epoch: int = 0) -> int:
        """The most examples one micro-batch of ``rows`` units of ``epoch`` holds, each packed row's
        padding counted as one more (the fast path sizes its CUDA-graph layout by it)."""
        plan = self.units(epoch)
        return max(sum(len(unit) + self.packing for unit in plan[i:i + rows]) for i in range(0, len(plan), rows))

    def take(self, cursor: Cursor, n: int) -> tuple[list[list[int]], Cursor]:
        """The next ``n`` units from ``cursor`` (running into the next epoch if needed) and the cursor
        after them."""
        taken: list[list[int]] = []
        epoch, offset = cursor.epoch, cursor.offset
        while len(taken) < n:
            plan = self.units(epoch)
            if offset >= len(plan):
                epoch, offset = epoch + 1, 0
                continue
            grab = plan[offset:offset + n - len(taken)]
            taken.extend(grab)
            offset += len(grab)
        return taken, Cursor(epoch, offset)

    def epoch_progress(self, cursor: Cursor) -> float:
        """The cursor as a fractional epoch count (1.5 = half-way through the second epoch)."""
        return cursor.epoch + cursor.offset / max(1, self.units_per_epoch(cursor.epoch))

    def collate(self, units: Sequence[Sequence[int]], pad_id: int) -> MicroBatch:
        """One micro-batch of ``units``: padded rows, or packed rows when packing."""
        return collate([[self.examples[i] for i in unit] for unit in units], pad_id, self.packing)


def pack(order: Sequence[int], lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Greedily fill rows of at most ``max_len`` tokens with consecutive examples of ``order``."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for index, length in zip(order, lengths, strict=True):
        if row and used + length > max_len:
            rows.append(row)
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(row)
    return rows


def collate(units: Sequence[Sequence[Example]], pad_id: int, packing: bool) -> MicroBatch:
    """Tensors for ``units`` (one list of examples per row), right-padded to the longest row.

    Packed rows: examples are concatenated, position_ids restart at 0 for each, and no attention
    mask is given, so that transformers restricts attention to each example (it detects packed
    sequences from the restarts). The padding after a packed row gets its own restart, so it is a
    separate sequence that no real token attends to. Padded rows: one example per row with an
    attention mask.
    """
    rows_ids: list[list[int]] = []
    rows_labels: list[list[int]] = []
    rows_pos: list[list[int]] = []
    for unit in units:
        ids: list[int] = []
        labels: list[int] = []
        pos: list[int] = []
        for example in unit:
            ids.extend(example.input_ids)
            # The first token of an example is never a target: it must not be predicted from the
            # previous example's last token.
            labels.append(IGNORE_INDEX)
            labels.extend(example.labels[1:])
            pos.extend(range(len(example.input_ids)))
        rows_ids.append(ids)
        rows_labels.append(labels)
        rows_pos.append(pos)
    width = max(len(r) for r in rows_ids)
    tokens = sum(len(r) for r in rows_ids)
    mask_rows = []
    for ids, labels, pos in zip(rows_ids, rows_labels, rows_pos, strict=True):
        pad = width - len(ids)
        mask_rows.append([1] * len(ids) + [0] * pad)
        ids.extend([pad_id] * pad)
        labels.extend([IGNORE_INDEX] * pad)
        pos.extend(range(pad) if packing else range(len(pos), len(pos) + pad))
    labels_t = torch.tensor(rows_labels, dtype=torch.long)
    label_tokens = int((labels_t[:, 1:] != IGNORE_INDEX).sum())
    return MicroBatch(
        input_ids=torch.tensor(rows_ids, dtype=torch.long),
        labels=labels_t,
        position_ids=torch.tensor(rows_pos, dtype=torch.long),
        attention_mask=None if packing else torch.tensor(mask_rows, dtype=torch.long),
        tokens=tokens,
        label_tokens=label_tokens,
    )


def eval_batches(examples: Sequence[Example], batch_size: int, pad_id: int) -> list[MicroBatch]:
    """Padded batches of ``examples`` in length order, for evaluation (no shuffling, no packing)."""
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids))
    return [collate([[examples[i]] for i in order[s:s + batch_size]], pad_id, packing=False)
            for s in range(0, len(order), batch_size)]
