"""Out of memory outside forward/backward: free what the failed attempt held, and say what was done.

Forward/backward out-of-memory is the Trainer's halving (BatchSizeReduced). The other phases each
catch their own where it happens: evaluation retries with smaller batches, the optimizer step is
retried one tensor at a time, a checkpoint save is retried once and otherwise skipped, generation
is retried once. None of them ends a run that can go on; each says what it did as a WarningRaised
of kind ``oom``. The halving's event also
says how wrong the memory estimate was about the micro-batch that failed (:func:`estimate_for`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from studio.core import events as ev
from studio.core.config import RunConfig

OutOfMemory = torch.OutOfMemoryError
"""What the allocator raises (``torch.cuda.OutOfMemoryError`` is the same class)."""


def free(device: torch.device | None) -> None:
    """Give back what a failed attempt left: its tensors (once unreferenced) and the cached blocks."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def between_phases(device: torch.device | None) -> None:
    """Give back the cached blocks one phase left before another phase with other shapes allocates
    (the training step's activations before an evaluation or an answer, and theirs before the next
    step): the reserved peak is then the larger phase's, not the training step's cache plus the new
    phase's blocks on top (the VRAM estimate's phases, core/memory/phases.py, assume as much)."""
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def warn(emit: Callable[[ev.Event], object], message: str) -> None:
    """Tell every front end what an out-of-memory changed; the run goes on."""
    emit(ev.WarningRaised(kind="oom", message=message))


def estimate_for(config: RunConfig, micro_batch: int, device: torch.device | None,
                 capacity: int = 0) -> tuple[int, int]:
    """What core/memory/ estimated for ``micro_batch`` (on the path the engine takes) and the card's
    memory it was held against (``capacity`` when a plan gave one, else the card's total), for the
    halving's event to say how wrong the estimate was. (0, 0) off CUDA or when the model's shape is
    unknown: a missing number, never a wrong one."""
    from studio.core.memory import estimate
    from studio.core.model.info import ModelInfoError, load_model_info

    if device is None or device.type != "cuda":
        return 0, 0
    try:
        info = load_model_info(config.model.base_model, config.model.revision)
        estimated = estimate(config, info, micro_batch=micro_batch).total
    except (ModelInfoError, ValueError):
        return 0, 0
    return estimated, capacity or torch.cuda.get_device_properties(device).total_memory
