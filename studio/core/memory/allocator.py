"""What the card holds beyond a run's tensors: the CUDA context, cuBLAS workspaces, the allocator's pages.

torch's caching allocator hands tensors out of segments it maps from the driver and keeps them
mapped when the tensors are freed, so ``max_memory_reserved`` runs ahead of ``max_memory_allocated``
by the free blocks it caches and by its mapping steps; the CUDA context sits outside both counters.

Plain Python: it must never import torch.
"""

from __future__ import annotations

CUDA_CONTEXT_BYTES = 758 * 2**20
"""CUDA context, library handles and loaded kernels: on the card (nvidia-smi shows it) but outside
torch's counters. Measured through NVML on an H100 (torch 2.11, CUDA 13): 610 MiB for the bare
context, 676 MiB once cuBLAS is up, 758 MiB in both QLoRA training runs of
bench/results/current/vram_overhead_check_h100.json. Other drivers and cards differ by some 100 MiB."""

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS workspace, allocated through torch's caching allocator on the first matmul."""

STEP_WORKSPACES = 2
"""cuBLAS workspaces of an eager run: torch keeps one per thread and stream that ran a product, and
products run on the default stream from the main thread (forward) and autograd's (backward)."""

SLACK_FLOOR = 32 * 2**20
"""Reserved beyond allocated that every run has: small-pool segments (2 MiB each for tensors under
1 MiB) and 20 MiB segments of 1-10 MiB tensors."""

PAGE = 2 * 2**20
"""The allocator maps memory in 2 MiB pages: a reserved peak is a whole number of them."""

LARGE_PAGE = 20 * 2**20
"""With expandable segments the large pool (tensors over 1 MiB) maps its one segment in 20 MiB steps."""

SMALL_PAGE = 2 * 2**20
"""... and the small pool (tensors of at most 1 MiB) its own segment in 2 MiB steps."""

SMALL_TENSOR = 2**20
"""Tensors of at most this many bytes go to the small pool."""


def expandable_segments_from_env(alloc_conf: str | None) -> bool:
    """Whether Studio's engine runs with expandable segments, given PYTORCH_CUDA_ALLOC_CONF.

    Unset (None), the engine sets ``expandable_segments:True``; a value set by the user wins, and
    PyTorch leaves expandable segments off unless that value turns them on.
    """
    if alloc_conf is None:
        return True
    for option in alloc_conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip() == "True"
    return False
