"""One GPU timer for the microbenchmarks: the best of several timed repeats, CUDA events around a loop."""

from __future__ import annotations

from collections.abc import Callable


def best_ms(fn: Callable[[], object], loops: int = 1, repeats: int = 5, warm: bool = True) -> float:
    """Milliseconds one call of ``fn`` takes on the GPU: the fastest of ``repeats`` timed loops of
    ``loops`` calls each (after one untimed call with ``warm``: kernels jitted, cuBLAS heuristics
    settled), each loop between two synchronizations."""
    import torch

    if warm:
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(loops):
            fn()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) / loops)
    return best
