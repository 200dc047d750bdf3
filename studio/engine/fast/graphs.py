"""CUDA graphs of the decoder stack: forward and backward replayed, one graph per batch layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from studio.engine.fast.layer import Segments
from studio.engine.fast.offload import HostInputs

if TYPE_CHECKING:
    from studio.engine.fast.model import FastModel


class _AddInto(torch.autograd.Function):
    """Identity in the forward; the backward adds the incoming gradient into a fixed tensor and
    hands none back to the parameter (captured in a CUDA graph, every replay adds there)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        ctx.into = into
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.into.add_(grad)
        return None, None


class GradSink:
    """The adapters' gradients, added in place by the captured backward itself.

    ``make_graphed_callables`` returns a parameter's gradient as a static output of the captured
    backward, which autograd then adds into ``.grad``: two copies of every adapter gradient (0.15
    GiB for Llama-2-7B at r16 on all projections), one of them kept for good in the graph's pool.
    Captured through the sink, each parameter is used through :class:`_AddInto`, whose backward
    adds into one fixed tensor per parameter (``.grad`` of the steps that replay), and the graph
    hands back no gradient for it: one copy, and no host-side accumulation after each replay.
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.grads = [torch.zeros_like(p) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        return _AddInto.apply(param, self.grads[self._index[id(param)]])

    def bind(self) -> None:
        """Make each parameter's ``.grad`` its fixed tensor before a replay. A new accumulation
        window (``.grad`` set to None) zeroes them; a gradient an eager step made is copied in."""
        fresh = [g for p, g in zip(self.params, self.grads, strict=True) if p.grad is None]
        if fresh:
            torch._foreach_zero_(fresh)
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is g:
                continue
            if p.grad is not None:
                g.copy_(p.grad)
            p.grad = g


class _StackModule(nn.Module):
    """The decoder stack for one batch layout, as the module that CUDA-graph capture takes.

    Its parameters are the adapters (so the captured backward returns their gradients); the
    layout's example count and longest example are fixed in it, the boundaries come in as a tensor.
    """

    def __init__(self, fast: FastModel, max_len: int, flat: bool, host: HostInputs | None,
                 sink: GradSink | None):
        super().__init__()
        self.adapters = nn.ParameterList(fast.trainable())
        self._fast = [fast]  # a list: not a submodule, so its parameters are not counted twice
        self.max_len, self.flat = max_len, flat
        self.host = host
        self._sink = [sink]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        seg = Segments(cu=cu, max_len=self.max_len) if self.flat else Segments()
        # Only the captured pass goes through the sink: the warm-up passes before it run for real,
        # and their gradients (returned by make_graphed_callables' own autograd.grad) are dropped.
        sink = self._sink[0] if torch.cuda.is_current_stream_capturing() else None
        return self._fast[0].stack(h, cos, sin, seg, self.host, sink)


class Graphs:
    """CUDA graphs of the decoder stack, one per batch layout, captured on first use."""

    def __init__(self, fast: FastModel, limit: int, offload: bool = False):
        self.fast = fast
        self.limit = limit
        self.offload = offload
        """Each layout's layer inputs wait in its own pinned host buffers (engine/fast/offload.py)."""
        self.graphed: dict[tuple, nn.Module] = {}
        self.failed = ""
        self.sink: GradSink | None = None
        """The adapters' gradients as the captured backward adds into them (None until a capture,
        and again once the graphs are released)."""

    def release(self) -> None:
        """Drop the graphs, their pools and the sink's gradient tensors (a later step captures anew)."""
        self.graphed.clear()
        self.sink = None

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
                if self.sink is None:
                    self.sink = GradSink(self.fast.trainable())
                # allow_unused_input: through the sink, the captured backward returns no gradient
                # for the adapters (it adds them into the sink's tensors itself).
                module = torch.cuda.make_graphed_callables(
                    _StackModule(self.fast, seg.max_len, flat, host, self.sink), (h, cos, sin, cu),
                    num_warmup_iters=2, allow_unused_input=True)
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
        # The replayed backward adds into the sink's tensors: they must be the gradients now.
        self.sink.bind()
        return module(h, cos, sin, cu)
