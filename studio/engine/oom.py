"""Out of memory outside forward/backward: free what the failed attempt held, and say what was done.

Forward/backward out-of-memory is the Trainer's halving (BatchSizeReduced). The other phases each
catch their own where it happens: evaluation retries with smaller batches, the optimizer step is
retried one tensor at a time, a checkpoint save is retried once and otherwise skipped, generation
is retried once. None of them ends a run that can go on; each says what it did as a non-fatal
WorkerFailed of kind ``oom`` (shown as a warning by every front end).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from studio.core import events as ev

OutOfMemory = torch.OutOfMemoryError
"""What the allocator raises (``torch.cuda.OutOfMemoryError`` is the same class)."""


def free(device: torch.device | None) -> None:
    """Give back what a failed attempt left: its tensors (once unreferenced) and the cached blocks."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def warn(emit: Callable[[ev.Event], object], message: str) -> None:
    """Tell every front end what an out-of-memory changed; the run goes on."""
    emit(ev.WorkerFailed(kind="oom", fatal=False, message=message))
