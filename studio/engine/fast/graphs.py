"""CUDA graphs of the decoder stack: forward and backward replayed, one graph per batch layout; DPO's
reference pass (the stack with the adapters off, no gradients) as a forward-only graph of the same
layout, in the same memory pool."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from studio.engine.fast.layer import Segments
from studio.engine.fast.offload import HostInputs

MAX_GRAPHS = 2
"""Layouts beyond this many run without graphs: each layout's graphs keep their own memory pool."""


@contextlib.contextmanager
def without_collection() -> Iterator[None]:
    """Python's garbage collection run once before a CUDA-graph capture, and held off during it.

    A collection inside the capture may destroy an earlier graph that sits in a reference cycle (as
    make_graphed_callables' do), and freeing its memory is an operation the capture forbids: the
    capture fails and the run takes eager steps. torch 2.9 and later no longer collect before a
    capture (pytorch/pytorch#158193), so a capture that allocates many Python objects (one of a
    40-layer model) can trigger one."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def clear_cublas_workspaces(device: torch.device) -> None:
    """Let go of the cuBLAS workspaces torch keeps, one per stream and thread that ran a product
    (32 MiB each on a Hopper card), once the device is idle; a stream's next product allocates its
    own again (inside a capture: in the graph's private pool).

    Before a capture: every ``torch.cuda.graph`` captures on one shared stream, whose workspace an
    earlier, already destroyed graph may have allocated inside its own, now dead pool; the new
    graph would bake that address in, and the clearing after its own capture, with the
    allocator emptied, would hand the memory back to the driver under it (an illegal memory access
    at the next replay; bench/NOTES.md section 10). After a capture: the warm-up's side stream is
    gone, and its workspace serves nothing."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize(device)
        clear()


class Stack(Protocol):
    """What the graphs replay: the decoder stack (model.FastModel) and the adapters it trains."""

    def stack(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
              host: HostInputs | None = None, sink: GradSink | None = None, reference: bool = False) -> torch.Tensor:
        """The decoder layers and the final norm (layer inputs in ``host``, gradients into ``sink``;
        ``reference``: every adapter off)."""

    def trainable(self) -> list[torch.Tensor]:
        """The adapter weights the stack trains, in a fixed order."""


class _Sink(torch.autograd.Function):
    """The parameters in the forward, cut off from autograd; the backward adds each one's gradient
    into its fixed tensor and hands the anchor (the one input autograd sees) a zero."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, params: list[torch.Tensor], intos: list[torch.Tensor]):
        ctx.intos = intos
        return tuple(p.detach() for p in params)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        pairs = [(into, g) for into, g in zip(ctx.intos, grads, strict=True) if g is not None]
        if pairs:
            torch._foreach_add_([into for into, _ in pairs], [g for _, g in pairs])
        # A defined gradient for the anchor: with none, the captured backward ends on a stream
        # dependency outside the capture (bench/diag_sink.py) and the capture fails.
        return grads[0].new_zeros((), dtype=torch.float32), None, None


class GradSink:
    """The adapters' gradients, added in place by the captured backward itself.

    ``make_graphed_callables`` returns a parameter's gradient as a static output of the captured
    backward, which autograd then adds into ``.grad``: two copies of every adapter gradient (0.15
    GiB for Llama-2-7B at r16 on all projections), one of them kept for good in the graph's pool,
    and one eager addition per adapter after every replay. Through the sink, the captured stack uses
    the adapters through :class:`_Sink`, whose backward adds their gradients into fixed tensors
    (``.grad`` of the steps that replay): one copy, added inside the graph. The graph's only
    parameter is a scalar anchor, whose gradient is always zero; the captured backward ends there,
    not at the adapters' gradient accumulators, which belong to whatever stream created them (an
    earlier eager forward's loss still alive would otherwise make the capture fail).
    """

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.grads = [torch.zeros_like(p) for p in params]
        self._into = {id(p): g for p, g in zip(params, self.grads, strict=True)}
        self.anchor = nn.Parameter(torch.zeros((), device=params[0].device))

    def __call__(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` as the products use them, their gradients going to this sink."""
        return list(_Sink.apply(self.anchor, params, [self._into[id(p)] for p in params]))

    def bound(self) -> bool:
        """Whether the parameters' ``.grad`` are the sink's tensors now (an accumulation going on)."""
        return any(p.grad is g for p, g in zip(self.params, self.grads, strict=True))

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

    Its only parameter is the :class:`GradSink`'s anchor (the backward adds the adapters' gradients
    itself); the layout's example count and longest example are fixed in it, the boundaries come in
    as a tensor.
    """

    def __init__(self, fast: Stack, max_len: int, flat: bool, host: HostInputs | None, sink: GradSink):
        super().__init__()
        self.anchor = sink.anchor
        self._fast = [fast]  # a list: not a submodule, so its parameters are not counted twice
        self.max_len, self.flat = max_len, flat
        self.host = host
        self._sink = [sink]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        seg = Segments(cu=cu, max_len=self.max_len) if self.flat else Segments()
        return self._fast[0].stack(h, cos, sin, seg, self.host, self._sink[0])


Layout = tuple[tuple[int, ...], int, int]
"""A batch layout: the stack input's shape, the length of its example boundaries ``cu`` (1: rows
without boundaries) and its longest example."""


class ReferenceGraph:
    """DPO's reference pass for one batch layout: the decoder stack with every adapter off, without
    gradients, captured as a forward-only CUDA graph.

    It is captured before the layout's policy graph, into a memory pool of its own that the policy's
    capture then shares (``pool``): the policy's forward and backward take the blocks the reference
    pass freed, so the layout's pool holds the larger of the two working sets, not both, and nothing
    of the pass sits in the allocator's general pool. Replays go in capture order (the reference
    forward, then the policy's forward and backward), which is what makes the sharing safe; the
    static output stays referenced here (no capture reuses its blocks) and is read by the head
    before the policy replays. The static inputs are the first call's tensors, copied into before
    each replay; the policy graph takes them as its own (the same batch's embeddings, tables and
    boundaries), so the layout keeps one set."""

    def __init__(self, fast: Stack, inputs: tuple[torch.Tensor, ...], max_len: int, flat: bool):
        # Detached: a run's embeddings may be a leaf that requires grad (PEFT's input-gradient hook
        # for checkpointing), into which no later batch could be copied.
        self.inputs = tuple(x.detach() for x in inputs)
        h, cos, sin, cu = self.inputs
        seg = Segments(cu=cu, max_len=max_len) if flat else Segments()
        self._pass = lambda: fast.stack(h, cos, sin, seg, reference=True)
        self.output: torch.Tensor | None = None
        self._capture()

    def _capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        # Once eagerly first: kernels' first calls (autotuning, lazy buffers) must not be captured.
        self._pass()
        clear_cublas_workspaces(self.inputs[0].device)
        with without_collection(), torch.cuda.graph(self.graph, pool=self.pool):
            self.output = self._pass()

    def _replay(self) -> None:
        self.graph.replay()

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The final hidden states of ``inputs`` (h, cos, sin, cu), by a replay: the static output,
        overwritten by the next replay."""
        with torch.no_grad():
            for static, given in zip(self.inputs, inputs, strict=True):
                if static.data_ptr() != given.data_ptr():
                    static.copy_(given)
        self._replay()
        return self.output


class Graphs:
    """CUDA graphs of the decoder stack, one per batch layout (at most :data:`MAX_GRAPHS` layouts),
    captured on first use; with DPO, each layout's reference pass too (:class:`ReferenceGraph`)."""

    def __init__(self, fast: Stack, offload: bool):
        self.fast = fast
        self.offload = offload
        """Each layout's layer inputs wait in its own pinned host buffers (engine/fast/offload.py)."""
        self.graphed: dict[tuple, nn.Module] = {}
        self.references: dict[Layout, ReferenceGraph] = {}
        """Each layout's captured reference pass, whose pool its policy graph shares."""
        self.failed = ""
        self.sink: GradSink | None = None
        """The adapters' gradients as the captured backward adds into them (None until a capture,
        and again once the graphs are released)."""

    def release(self) -> None:
        """Drop the graphs (policy and reference), their pools and the sink's gradient tensors (a
        later step captures anew).

        make_graphed_callables wraps each graph in an autograd Function class made for it, and a
        class sits in reference cycles: dropping the last reference leaves the graph, and with it
        its private pool, alive until the cyclic garbage collector runs. Collected here, so that
        the pool is free for what comes next (the final evaluation, an answer), which
        ``torch.cuda.empty_cache`` can then give back."""
        had = bool(self.graphed) or bool(self.references) or self.sink is not None
        self.graphed.clear()
        self.references.clear()
        self.sink = None
        if had:
            gc.collect()

    def _layouts(self) -> set[Layout]:
        """The layouts captured, by a policy graph, a reference graph or both."""
        return {key[:3] for key in self.graphed} | set(self.references)

    def fit(self, total: int, slots: int, max_len: int) -> tuple[int, int]:
        """The example slots and longest example of the layout to use for a flat stream of ``total``
        tokens that needs ``slots`` and ``max_len``: the captured layout of that length where it is
        at least as wide (reused), else one as wide as both (:meth:`run` then replaces the old one)."""
        for shape, cu_len, length in self._layouts():
            if shape[1] == total and cu_len > 1:  # 1: rows without boundaries
                slots, max_len = max(slots, cu_len - 1), max(max_len, length)
        return slots, max_len

    def _replace(self, layout: Layout) -> None:
        """Drop the captured layouts of ``layout``'s length that it now covers (see :meth:`fit`),
        both graphs and their pool, before ``layout`` is captured: one layout's memory at a time."""
        shape, cu_len, length = layout
        if cu_len == 1:
            return

        def covered(other: Layout) -> bool:
            return other != layout and other[0] == shape and 1 < other[1] <= cu_len and other[2] <= length

        narrower = [k for k in self.graphed if covered(k[:3])]
        for k in narrower:
            del self.graphed[k]
        stale = [k for k in self.references if covered(k)]
        for k in stale:
            del self.references[k]
        if narrower or stale:
            gc.collect()  # the graph's autograd class sits in reference cycles (see release)
            torch.cuda.empty_cache()

    def _room(self, layout: Layout) -> bool:
        """Whether ``layout`` may have graphs: no capture failed, and it is captured already or
        fewer than :data:`MAX_GRAPHS` layouts are."""
        return not self.failed and (layout in self._layouts() or len(self._layouts()) < MAX_GRAPHS)

    def run_reference(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments) -> torch.Tensor:
        """DPO's reference pass of a training step (no gradients, every adapter off) through the
        layout's :class:`ReferenceGraph`, captured on first use before the policy graph of that
        layout. Eager where the layout has no room for graphs, where its policy graph was captured
        without one (capture order must be replay order), or where the capture fails
        (``failed`` says why; the policy's steps then run eagerly too)."""
        flat = seg.cu is not None
        cu = seg.cu if flat else torch.zeros(1, dtype=torch.int32, device=h.device)
        layout = (tuple(h.shape), cu.numel(), seg.max_len)
        graph = self.references.get(layout)
        if graph is None:
            self._replace(layout)
            if not self._room(layout) or any(key[:3] == layout for key in self.graphed):
                return self.fast.stack(h, cos, sin, seg, reference=True)
            try:
                graph = ReferenceGraph(self.fast, (h, cos, sin, cu), seg.max_len, flat)
            except torch.cuda.OutOfMemoryError:
                raise  # the trainer halves the micro-batch; the smaller layout gets its own graphs
            except Exception as exc:  # noqa: BLE001 - a capture failure leaves the eager path working
                self.failed = f"reference pass: {type(exc).__name__}: {exc}"
                return self.fast.stack(h, cos, sin, seg, reference=True)
            self.references[layout] = graph
        return graph(h, cos, sin, cu)

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments) -> torch.Tensor:
        flat = seg.cu is not None
        cu = seg.cu if flat else torch.zeros(1, dtype=torch.int32, device=h.device)
        layout = (tuple(h.shape), cu.numel(), seg.max_len)
        key = (*layout, h.requires_grad)
        module = self.graphed.get(key)
        if module is None:
            self._replace(layout)
            if not self._room(layout):
                return self.fast.stack(h, cos, sin, seg)
            # Autograd may warn once that a gradient accumulator made inside a capture (which
            # make_graphed_callables keeps) is fed from another stream: expected, the capture and
            # the replays are correct (tests/engine/test_fast_graphs.py).
            quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
            if quiet is not None:
                quiet(False)
            if self.sink is None:
                self.sink = GradSink(self.fast.trainable())
            # The warm-up passes add into the sink's tensors too: keep what a step in progress
            # has accumulated there (a new layout in the middle of an accumulation window).
            kept = [g.clone() for g in self.sink.grads] if self.sink.bound() else None
            # After the layout's reference pass: its pool, and its static inputs as this graph's
            # (this batch's values, copied in; the reference replay copies the next ones in first).
            reference = self.references.get(layout)
            # Leaves: make_graphed_callables keeps the sample tensors as the graph's static inputs,
            # and a sample made by an op (Granite's embedding multiplier on the embeddings PEFT's
            # input-gradient hook made a leaf) would hand its gradient on, inside the backward's
            # capture, to that op's node, recorded on the default stream; the legacy stream then
            # waits on the capturing one, which CUDA forbids. The same memory, detached.
            sample = tuple(x.detach().requires_grad_(x.requires_grad) for x in (h, cos, sin, cu))
            if reference is not None:
                with torch.no_grad():
                    for static, given in zip(reference.inputs, sample, strict=True):
                        static.copy_(given)
                # the same memory, each tensor needing a gradient where this batch's does (a capture
                # must see the inputs' real requires_grad)
                sample = tuple(static.detach().requires_grad_(given.requires_grad)
                               for static, given in zip(reference.inputs, sample, strict=True))
            try:
                host = HostInputs(h.device) if self.offload else None
                if h.device.type == "cuda":  # (a CPU test's stand-in captures)
                    clear_cublas_workspaces(h.device)
                with without_collection():
                    module = torch.cuda.make_graphed_callables(
                        _StackModule(self.fast, seg.max_len, flat, host, self.sink), sample,
                        num_warmup_iters=2, pool=None if reference is None else reference.pool)
            except torch.cuda.OutOfMemoryError:
                raise  # the trainer halves the micro-batch; the smaller layout gets its own graph
            except Exception as exc:  # noqa: BLE001 - a capture failure leaves the eager path working
                self.failed = f"{type(exc).__name__}: {exc}"
                self._restore(kept)
                return self.fast.stack(h, cos, sin, seg)
            finally:
                if kept is not None and not self.failed:
                    self._restore(kept)
            self.graphed[key] = module
            # The capture's warm-up ran on a side stream that is gone now: its cached blocks, and the
            # cuBLAS workspaces torch keeps for that stream (one per thread that ran products on it,
            # 32 MiB each on a Hopper card, never freed otherwise), serve nothing. Clearing the
            # workspace map frees those; the default stream's are allocated again at its next
            # product, and the capture stream's stay inside the graph's private pool, which only
            # that layout's graphs use (the reference graph, captured first, used the same one).
            if h.device.type == "cuda":
                clear_cublas_workspaces(h.device)
            torch.cuda.empty_cache()
        self.sink.bind()  # the replayed backward adds into the sink's tensors: the gradients now
        return module(h, cos, sin, cu)

    def _restore(self, kept: list[torch.Tensor] | None) -> None:
        if kept is not None and self.sink is not None:
            torch._foreach_copy_(self.sink.grads, kept)
