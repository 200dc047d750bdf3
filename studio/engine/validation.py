"""The Trainer's evaluation: the held-out rows scored during training, whatever the method.

SFT: loss, perplexity and next-token accuracy on the validation rows' responses, in batches halved
on out-of-memory (the training step is not affected). DPO / ORPO: the preference objective's own
held-out margins (studio/engine/preference.py). GRPO: the rewards of one greedy completion per
held-out prompt (studio/engine/grpo.py). :class:`Validation` is a part of
:class:`~studio.engine.train.Trainer`, kept apart so the loop reads on its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from studio.core import events as ev
from studio.core.grpo.rewards import RewardFailed
from studio.engine import oom
from studio.engine.batching import eval_batches

if TYPE_CHECKING:
    from studio.engine.session import Session


class Validation:
    """The evaluation methods of the Trainer: it sets the attributes declared here and provides
    ``load()``, ``forward(batch)``, ``model``, ``tokenizer`` and ``device``."""

    session: Session
    step: int
    micro_batch_size: int
    best_eval_loss: float | None
    _eval_batch_cap: int | None
    emit: Any

    def evaluate(self, record_best: bool = True) -> ev.EvalLogged:
        """Loss, perplexity and next-token accuracy on the validation rows' responses; emits EvalLogged.
        ``record_best=False`` (the base model's evaluation at step 0) leaves ``best_eval_loss`` alone."""
        self.load()
        examples = self.session.data.validation
        if not examples:
            event = ev.EvalLogged(step=self.step, loss=float("nan"), perplexity=float("nan"), rows=0)
            return event
        if self.session.grpo is not None:
            # GRPO has no loss to hold out: the rewards of one greedy completion per held-out prompt.
            self._evaluate_grpo(examples)
            return ev.EvalLogged(step=self.step, loss=float("nan"), perplexity=float("nan"), rows=len(examples))
        if self.session.preference is not None:
            event, metrics = self.session.preference.evaluate(examples, self.step, self.micro_batch_size,
                                                              self.tokenizer.pad_token_id)
            if record_best:
                self.best_eval_loss = min(event.loss, self.best_eval_loss or math.inf)
            self.emit(event)
            self.emit(metrics)
            return event
        size = min(self.micro_batch_size, self._eval_batch_cap or self.micro_batch_size)
        oom.between_phases(self.device)
        try:
            result = self._evaluate_in_batches(examples, size)
        finally:
            oom.between_phases(self.device)
        if result is None:
            return ev.EvalLogged(step=self.step, loss=float("nan"), perplexity=float("nan"), rows=0)
        loss_sum, correct, total = result
        loss = loss_sum / max(1, total)
        if record_best and (self.best_eval_loss is None or loss < self.best_eval_loss):
            self.best_eval_loss = loss
        event = ev.EvalLogged(step=self.step, loss=loss, perplexity=math.exp(min(loss, 50.0)),
                              token_accuracy=correct / max(1, total), rows=len(examples))
        self.emit(event)
        return event

    def _evaluate_grpo(self, examples: list[Any]) -> None:
        """A GRPO run's evaluation (engine/grpo.py), its sampling batch halved on out-of-memory as
        an SFT evaluation's is; skipped with a warning when even one prompt at a time does not fit."""
        assert self.session.grpo is not None
        size = min(self.micro_batch_size, self._eval_batch_cap or self.micro_batch_size)
        while True:
            event = None
            try:
                event = self.session.grpo.evaluate(examples, self.step, size)
            except oom.OutOfMemory:
                pass
            except RewardFailed as exc:  # a held-out row the training rows never hit: training goes on
                self.emit(ev.WarningRaised(kind=ev.FailureKind.REWARD, message=(
                    f"{exc}; this evaluation is skipped, training goes on")))
                return
            if event is not None:
                self.emit(event)
                return
            oom.free(self.device)  # outside the except block: the failed batch is unreferenced now
            if size <= 1:
                oom.warn(self.emit, (f"out of memory evaluating at step {self.step} even one prompt at a time: "
                                     "this evaluation is skipped, training goes on; lower trainer.eval_max_rows "
                                     "or grpo.max_completion_length"))
                return
            old, size = size, max(1, size // 2)
            self._eval_batch_cap = size
            oom.warn(self.emit, (f"out of memory evaluating at step {self.step} in batches of {old} prompts: "
                                 f"retrying in batches of {size}; training is not affected"))

    def _evaluate_in_batches(self, examples: list[Any], size: int) -> tuple[float, int, int] | None:
        """:meth:`_eval_pass`, halving the batch on out-of-memory; None (and a warning) when even one
        row at a time does not fit."""
        while True:
            result = None
            try:
                result = self._eval_pass(examples, size)
            except oom.OutOfMemory:
                pass
            if result is not None:
                break
            oom.free(self.device)  # outside the except block: the failed batch is unreferenced now
            if size <= 1:
                oom.warn(self.emit, (f"out of memory evaluating at step {self.step} even one row at a time: "
                                     "this evaluation is skipped, training goes on; lower "
                                     "data.max_seq_length or trainer.eval_max_rows"))
                return None
            old, size = size, max(1, size // 2)
            self._eval_batch_cap = size
            oom.warn(self.emit, (f"out of memory evaluating at step {self.step} in batches of {old} rows: "
                                 f"retrying in batches of {size}; training is not affected"))
        return result

    def _eval_pass(self, examples: list[Any], size: int) -> tuple[float, int, int]:
        """One pass over ``examples`` in batches of ``size``: (loss sum, argmax hits, label tokens)."""
        was_training = self.model.training
        self.model.eval()
        total = correct = 0
        loss_sum = 0.0
        try:
            with torch.no_grad():
                for batch in eval_batches(examples, size, self.tokenizer.pad_token_id):
                    loss, hits = self.forward(batch.to(self.device))
                    loss_sum += float(loss)
                    correct += int(hits)
                    total += batch.label_tokens
        finally:
            if was_training:
                self.model.train()
        return loss_sum, correct, total
