"""One GPU timer for the microbenchmarks: the best of several timed repeats, CUDA events around a loop."""

from __future__ import annotations

from collections.abc import Callable


def best_ms(fn: Callable[[], object], loops: int = 1, repeats: int = 5, warm: bool = True) -> float:
    """Milliseconds one call of ``fn`` takes on the GPU: the fastest of ``repeats`` timed loops of
    ``loops`` calls each (after one untimed call with ``warm``: kernels jitted, cuBLAS heuristics
    settled), each loop between two synchronizations."""

    if warm:
        fn()
    return min(loop_ms(fn, loops) for _ in range(repeats))


def loop_ms(fn: Callable[[], object], loops: int) -> float:
    """Milliseconds a call of ``fn`` takes on the GPU, over one loop of ``loops`` calls between two
    synchronizations (CUDA events around the loop)."""
    import torch

    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loops):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / loops
