"""The optimizer and learning-rate schedule a run's config asks for.

AdamW (torch's fused kernel on a GPU) or bitsandbytes' 8-bit / paged 8-bit AdamW; a linear warmup
then cosine, linear or constant decay. Only the LoRA's parameters (those that need gradients) are
optimized.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from studio.core import events as ev
from studio.core.config import TrainerConfig


def build_optimizer(model: Any, tc: TrainerConfig, device: torch.device,
                    emit: Callable[[ev.Event], None]) -> torch.optim.Optimizer:
    """``trainer.optimizer`` over ``model``'s trainable parameters; an 8-bit optimizer this machine
    cannot run falls back to torch AdamW with a WarningRaised saying so."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = tc.optimizer
    if name in ("adamw_8bit", "paged_adamw", "paged_adamw_8bit"):
        try:
            import bitsandbytes as bnb

            cls = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
                   "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[name]
            return cls(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)
        except Exception as exc:  # no GPU backend for 8-bit states
            emit(ev.WarningRaised(kind="config", message=(
                f"trainer.optimizer {name} is not available here ({str(exc).splitlines()[0]}); "
                "using torch AdamW")))
    # fused: one kernel for all adapter tensors instead of a few per tensor.
    return torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=tc.weight_decay,
                             fused=device.type == "cuda")


def build_scheduler(optimizer: torch.optim.Optimizer, tc: TrainerConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``trainer.scheduler`` with ``trainer.warmup_fraction`` of ``total_steps`` warming up."""
    warmup = math.ceil(tc.warmup_fraction * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule(tc.scheduler, warmup, total_steps))


def schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier at a step: linear warmup, then cosine, linear or constant."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor
