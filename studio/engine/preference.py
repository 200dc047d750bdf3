"""Preference training (DPO, ORPO): pairs of answers, their log-probs, the losses and the metrics.

A pair is one prompt rendered twice (studio/core/data/encoding.py): with the chosen answer as the
response and with the rejected one, through the run's template or, for TRL's conversational pairs,
the chat template. A micro-batch of ``n`` pairs is ``2n`` padded rows, the chosen
answers first; its ``label_tokens`` is ``n``, so the Trainer's step loss (summed over micro-batches,
divided by the step's count) is the mean over the step's pairs however the step is split: exact
resume and out-of-memory halving work as for SFT.

Each answer's log-prob is the sum of its response tokens' log-probs (``log p(y | x)``).

- DPO (Rafailov et al. 2023): with ``r = beta * (log p(y|x) - log p_ref(y|x))``, the loss of a pair
  is ``-log sigmoid(r_chosen - r_rejected)``. The reference is the base model itself, the adapter
  switched off (no second copy of the weights), run without gradients and without dropout, before
  the policy's pass (whose saved activations are then not alive beside its working set).
- ORPO (Hong et al. 2024): with ``a`` an answer's *mean* token log-prob and ``odds = p / (1 - p)``
  taken at ``p = exp(a)``, the loss of a pair is ``-a_chosen - beta * log sigmoid(log odds_chosen -
  log odds_rejected)``: the chosen answer's language-model loss plus the odds-ratio term. No
  reference model.

Two paths compute the log-probs. The plain one (:func:`sequence_logps`) runs the PEFT model to its
logits and switches the adapter off with peft's ``disable_adapter()``. The fast one
(studio/engine/fast/, when the session built it) runs ``FastModel.sequence_logps``: the fused
layers (the policy's pass replayed as a CUDA graph on a GPU), only the answer tokens through the
vocabulary, fused with the output projection (no ``tokens x vocab`` logits), and the reference pass
through the same layers with every adapter off (in a training step, replayed as a CUDA graph of the
same batch layout in the policy graph's memory pool: engine/fast/graphs.py's ReferenceGraph).

Metrics (PreferenceLogged) are kept on the device during a step and read once at its end.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from studio.core import events as ev
from studio.core.memory.phases import SCORE_TOKENS
from studio.core.prompt import IGNORE_INDEX, Encoded
from studio.engine.batching import DataStream, MicroBatch, collate

if TYPE_CHECKING:
    from studio.engine.fast import FastModel


@dataclass(frozen=True)
class Pair:
    """One prompt with its chosen and its rejected answer, encoded."""

    chosen: Encoded
    rejected: Encoded

    @property
    def input_ids(self) -> list[int]:
        """Both rows' tokens: what the data stream sorts by (a pair costs both)."""
        return self.chosen.input_ids + self.rejected.input_ids

    @property
    def truncated(self) -> bool:
        """Whether either answer was cut to ``data.max_seq_length``."""
        return self.chosen.truncated or self.rejected.truncated


def collate_pairs(pairs: Sequence[Pair], pad_id: int) -> MicroBatch:
    """``2n`` padded rows (chosen answers, then rejected) whose ``label_tokens`` is the pair count."""
    rows = [[p.chosen] for p in pairs] + [[p.rejected] for p in pairs]
    batch = collate(rows, pad_id, packing=False)
    batch.label_tokens = len(pairs)
    return batch


class PairStream(DataStream):
    """The seeded order of the training pairs; padded, never packed (each pair is two rows)."""

    def __init__(self, pairs: Sequence[Pair], seed: int, max_len: int):
        super().__init__(pairs, seed, packing=False, max_len=max_len)

    def collate(self, units: Sequence[Sequence[int]], pad_id: int) -> MicroBatch:
        """One micro-batch of the pairs in ``units``."""
        return collate_pairs([self.examples[i] for unit in units for i in unit], pad_id)


def sequence_logps(model: Any, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the summed log-prob of its response tokens, how many there are, and how many of them
    are the argmax. Only response positions go through the fp32 log-softmax (the full logits would
    be the step's largest tensor)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False).logits
    targets = batch.labels[:, 1:]
    keep = targets != IGNORE_INDEX
    rows = keep.nonzero()[:, 0]
    picked = logits[:, :-1][keep].float()
    wanted = targets[keep]
    token_logps = picked.log_softmax(-1).gather(-1, wanted[:, None])[:, 0]
    sums = torch.zeros(batch.input_ids.shape[0], device=picked.device).index_add(0, rows, token_logps)
    hits = torch.zeros_like(sums).index_add(0, rows, (picked.argmax(-1) == wanted).float())
    return sums, keep.sum(1).float(), hits


class PreferenceObjective:
    """The DPO or ORPO loss of a session's model, and the metrics of the current step or evaluation."""

    def __init__(self, method: str, beta: float, model: Any, device: torch.device,
                 compute_dtype: torch.dtype, encode: Callable[[dict], Pair]):
        self.method = method
        self.beta = beta
        self.model = model
        self.device = device
        self.compute_dtype = compute_dtype
        self.encode = encode
        """Row -> Pair with the run's template and tokenizer (held-out margins use it)."""
        self.fast: FastModel | None = None
        """The session's fast path (engine/fast's FastModel) once it is built, or None: the log-probs
        then come from its fused layers and loss instead of the PEFT model's logits."""
        self._sums: dict[str, torch.Tensor] = {}
        self._pairs = 0

    def _autocast(self) -> Any:
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype,
                              enabled=self.device.type == "cuda" and self.compute_dtype != torch.float32)

    def start_step(self) -> None:
        """Forget the metrics gathered so far (a new step, an evaluation, a step redone after an OOM)."""
        self._sums = {}
        self._pairs = 0

    def _logps(self, batch: MicroBatch, reference: bool = False, in_step: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the summed log-prob of its answer, its token count and its argmax hits, by the
        fine-tune or (``reference``, under no_grad) the base, on the session's path; ``in_step``: the
        reference pass of a training step (the fast path replays it as a CUDA graph beside the
        policy's). The fast path scores an evaluation's rows a few at a time, as its SFT evaluation
        does (``FastModel.score``: at most SCORE_TOKENS tokens a pass)."""
        fast = self.fast
        if fast is None:
            off = self.model.disable_adapter() if reference else contextlib.nullcontext()
            with off, self._autocast():
                return sequence_logps(self.model, batch)
        if reference or torch.is_grad_enabled():
            return fast.sequence_logps(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids,
                                       reference=reference, in_step=in_step)
        rows = max(1, SCORE_TOKENS // max(1, batch.input_ids.shape[1]))
        mask = batch.attention_mask
        parts = [fast.sequence_logps(batch.input_ids[i:i + rows], batch.labels[i:i + rows],
                                     None if mask is None else mask[i:i + rows], batch.position_ids[i:i + rows])
                 for i in range(0, batch.input_ids.shape[0], rows)]
        return tuple(torch.cat(values) for values in zip(*parts, strict=True))

    def _reference_logps(self, batch: MicroBatch) -> torch.Tensor:
        """The base model's summed log-probs: adapter off, no gradients, no dropout."""
        if self.fast is not None:  # no adapter runs, so no dropout either: the modules' mode can stay
            in_step = torch.is_grad_enabled()  # a training step's (an evaluation runs under no_grad)
            with torch.no_grad():
                return self._logps(batch, reference=True, in_step=in_step)[0]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._logps(batch, reference=True)[0]
        finally:
            if was_training:
                self.model.train()

    def forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss of the micro-batch's pairs and how many of them rank chosen first; the
        Trainer calls this in place of its cross-entropy for preference runs."""
        n = batch.label_tokens
        reference = self._reference_logps(batch) if self.method == "dpo" else None
        sums, counts, hits = self._logps(batch)
        chosen, rejected = sums[:n], sums[n:]
        if reference is not None:
            chosen_reward = self.beta * (chosen - reference[:n])
            rejected_reward = self.beta * (rejected - reference[n:])
            losses = -F.logsigmoid(chosen_reward - rejected_reward)
        else:
            mean_chosen, mean_rejected = chosen / counts[:n].clamp(min=1), rejected / counts[n:].clamp(min=1)
            # log(1 - p) as log(-expm1(log p)): exact where p is close to 1.
            log_odds = (mean_chosen - mean_rejected) - (torch.log(-torch.expm1(mean_chosen).clamp(max=-1e-7))
                                                         - torch.log(-torch.expm1(mean_rejected).clamp(max=-1e-7)))
            losses = -mean_chosen - self.beta * F.logsigmoid(log_odds)
            chosen_reward, rejected_reward = self.beta * mean_chosen, self.beta * mean_rejected
        wins = (chosen_reward > rejected_reward).float()
        self._add(loss=losses, margin=chosen_reward - rejected_reward, chosen=chosen, rejected=rejected,
                  accuracy=wins, chosen_tokens=counts[:n], chosen_hits=hits[:n])
        self._pairs += n
        return losses.sum(), wins.sum()

    def _add(self, **values: torch.Tensor) -> None:
        for name, value in values.items():
            total = value.detach().sum()
            self._sums[name] = self._sums[name] + total if name in self._sums else total

    def logged(self, step: int, split: str = "train") -> ev.PreferenceLogged:
        """The metrics since :meth:`start_step`, averaged over the pairs (one device sync)."""
        names = ("loss", "margin", "chosen", "rejected", "accuracy")
        values = torch.stack([self._sums[k] for k in names]).tolist() if self._pairs else [0.0] * 5
        n = max(1, self._pairs)
        loss, margin, chosen, rejected, accuracy = (v / n for v in values)
        return ev.PreferenceLogged(step=step, split=split, method=self.method, loss=loss, reward_margin=margin,
                                   chosen_logp=chosen, rejected_logp=rejected, accuracy=accuracy, pairs=self._pairs)

    def evaluate(self, pairs: Sequence[Pair], step: int, batch_pairs: int, pad_id: int
                 ) -> tuple[ev.EvalLogged, ev.PreferenceLogged]:
        """The preference loss on ``pairs`` (EvalLogged: its loss; perplexity and next-token accuracy
        of the chosen answers) and the preference metrics (PreferenceLogged, split validation)."""
        was_training = self.model.training
        self.model.eval()
        self.start_step()
        try:
            with torch.no_grad():
                order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i].input_ids))
                for start in range(0, len(order), max(1, batch_pairs)):
                    chunk = [pairs[i] for i in order[start:start + batch_pairs]]
                    self.forward(collate_pairs(chunk, pad_id).to(self.device))
            metrics = self.logged(step, "validation")
            tokens = float(self._sums["chosen_tokens"])
            nll = -float(self._sums["chosen"]) / max(1.0, tokens)
            accuracy = float(self._sums["chosen_hits"]) / max(1.0, tokens)
        finally:
            self.start_step()
            if was_training:
                self.model.train()
        return (ev.EvalLogged(step=step, loss=metrics.loss, perplexity=math.exp(min(nll, 50.0)),
                              token_accuracy=accuracy, rows=len(pairs), method=self.method), metrics)

    def margin(self, row: dict, adapter: bool) -> float:
        """``log p(chosen) - log p(rejected)`` for one row, by the fine-tune or (``adapter`` False)
        the base: above 0, that model prefers the chosen answer."""
        batch = collate_pairs([self.encode(row)], 0).to(self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                sums = self._logps(batch, reference=not adapter)[0]
        finally:
            if was_training:
                self.model.train()
        return float(sums[0] - sums[1])
