"""CUDA graphs of the decoder stack: forward and backward replayed, one graph per batch layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from studio.engine.fast.layer import Segments
from studio.engine.fast.offload import HostInputs

if TYPE_CHECKING:
    from studio.engine.fast.model import FastModel


class _StackModule(nn.Module):
    """The decoder stack for one batch layout, as the module that CUDA-graph capture takes.

    Its parameters are the adapters (so the captured backward returns their gradients); the
    layout's example count and longest example are fixed in it, the boundaries come in as a tensor.
    """

    def __init__(self, fast: FastModel, max_len: int, flat: bool, host: HostInputs | None):
        super().__init__()
        self.adapters = nn.ParameterList(fast.trainable())
        self._fast = [fast]  # a list: not a submodule, so its parameters are not counted twice
        self.max_len, self.flat = max_len, flat
        self.host = host

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        seg = Segments(cu=cu, max_len=self.max_len) if self.flat else Segments()
        return self._fast[0].stack(h, cos, sin, seg, self.host)


class Graphs:
    """CUDA graphs of the decoder stack, one per batch layout, captured on first use."""

    def __init__(self, fast: FastModel, limit: int, offload: bool = False):
        self.fast = fast
        self.limit = limit
        self.offload = offload
        """Each layout's layer inputs wait in its own pinned host buffers (engine/fast/offload.py)."""
        self.graphed: dict[tuple, nn.Module] = {}
        self.failed = ""

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments) -> torch.Tensor:
        flat = seg.cu is not None
        cu = seg.cu if flat else torch.zeros(1, dtype=torch.int32, device=h.device)
        key = (tuple(h.shape), cu.numel(), seg.max_len, h.requires_grad)
        module = self.graphed.get(key)
        if module is None:
            if self.failed or len(self.graphed) >= self.limit:
                return self.fast.stack(h, cos, sin, seg)
            # The capture fails if an earlier forward's autograd graph is still alive (a loss not yet
            # released): its gradient accumulators belong to the stream that forward ran on, the
            # default one, and the captured backward would wait on it. The Trainer releases each
            # micro-batch's loss after its backward (docs/speed.md).
            # make_graphed_callables creates the adapters' gradient accumulators inside its capture,
            # on the capture stream, and keeps them; every replay's backward (on the training stream)
            # then hands them gradients across streams, which autograd warns about once. Expected
            # here: the capture and the replays are correct (tests/test_fast_graphs.py).
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)
            try:
                host = HostInputs(h.device) if self.offload else None
                module = torch.cuda.make_graphed_callables(_StackModule(self.fast, seg.max_len, flat, host),
                                                           (h, cos, sin, cu), num_warmup_iters=2)
            except torch.cuda.OutOfMemoryError:
                raise  # the trainer halves the micro-batch; the smaller layout gets its own graph
            except Exception as exc:  # noqa: BLE001 - a capture failure leaves the eager path working
                self.failed = f"{type(exc).__name__}: {exc}"
                return self.fast.stack(h, cos, sin, seg)
            self.graphed[key] = module
            # The capture's warm-up ran on a side stream that is gone now: its cached blocks, and the
            # cuBLAS workspaces torch keeps for that stream (one per thread that ran products on it,
            # 32 MiB each on a Hopper card, never freed otherwise), serve nothing. Clearing the
            # workspace map frees those; the default stream's are allocated again at its next
            # product, and the capture stream's stay inside the graph's private pool, which only
            # that graph uses.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                torch.cuda.synchronize(h.device)
                clear()
            torch.cuda.empty_cache()
        # The captured backward hands back gradients that live in the graph's memory: gradients that
        # already exist make autograd add them in place instead of keeping (aliasing) that memory.
        for p in self.fast.trainable():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return module(h, cos, sin, cu)
