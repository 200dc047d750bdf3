"""Simulated CUDA out-of-memory errors for the OOM-halving tests, installed from outside the Trainer.

:func:`inject_oom` wraps a Trainer's ``forward`` so that the first training micro-batch of one
step raises ``torch.cuda.OutOfMemoryError``, as a real one would inside the step. A worker
subprocess gets the same through ``$STUDIO_WORKER_TRAINER=oom_injection:OomInjectingSession``
(tests/ on PYTHONPATH), with ``$STUDIO_INJECT_OOM_AT_STEP`` set to ``N`` (once, in step N) or
``N:always`` (every attempt of step N, so the trainer gives up at micro-batch 1).
"""

from __future__ import annotations

import os

import torch

from studio.engine.session import Session
from studio.engine.train import Trainer

INJECT_OOM_ENV = "STUDIO_INJECT_OOM_AT_STEP"


def inject_oom(trainer: Trainer, at_step: int, always: bool = False) -> None:
    """Make ``trainer`` run out of memory (simulated) in optimizer step ``at_step`` (1-based)."""
    forward = trainer.forward
    armed = True

    def failing_forward(batch):
        nonlocal armed
        # Evaluation runs without gradients and is not a training step.
        if armed and torch.is_grad_enabled() and trainer.step + 1 == at_step:
            armed = always
            raise torch.cuda.OutOfMemoryError(f"simulated out of memory at step {at_step} ({INJECT_OOM_ENV})")
        return forward(batch)

    trainer.forward = failing_forward


def inject_from_spec(trainer: Trainer, spec: str) -> None:
    """:func:`inject_oom` from a ``N`` or ``N:always`` spec."""
    at, _, mode = spec.partition(":")
    inject_oom(trainer, int(at), always=mode == "always")


class OomInjectingSession(Session):
    """The engine's Session, whose Trainers run out of memory as ``$STUDIO_INJECT_OOM_AT_STEP`` says."""

    def new_trainer(self) -> Trainer:
        trainer = super().new_trainer()
        if spec := os.environ.get(INJECT_OOM_ENV):
            inject_from_spec(trainer, spec)
        return trainer
