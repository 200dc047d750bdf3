"""CUDA-graph captures run with Python's garbage collection held off (engine/fast/graphs.py's
``without_collection``): a collection inside a capture can destroy an earlier graph left in a
reference cycle, whose freed memory breaks the capture, and torch 2.9+ no longer collects before one.
On the CPU: the context itself, that the decoder stack's capture runs inside it, and that it
captures from leaf inputs."""

from __future__ import annotations

import gc
import weakref

import torch

from studio.engine.fast import graphs
from studio.engine.fast.layer import Segments


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_garbage_is_collected_before_and_none_during() -> None:
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    del cycle
    was = gc.isenabled()
    gc.enable()
    try:
        with graphs.without_collection():
            assert alive() is None, "the cycle made before the capture is collected at its start"
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()  # a caller that had collection off keeps it off
        with graphs.without_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


class _Stack:
    """What Graphs needs of the fast model: one adapter weight, a stack that returns its input."""

    def __init__(self) -> None:
        self.weight = torch.nn.Parameter(torch.ones(2))

    def stack(self, h, cos, sin, seg, host=None, sink=None, reference=False):
        return h

    def trainable(self):
        return [self.weight]


def test_the_stack_is_captured_with_collection_held_off(monkeypatch) -> None:
    """Graphs.run hands the stack to make_graphed_callables inside ``without_collection``; a capture
    that fails leaves the eager stack's result (and says why)."""
    seen: list[bool] = []

    def make_graphed_callables(module, sample, num_warmup_iters, pool):
        seen.append(gc.isenabled())
        raise RuntimeError("capture failed")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    was = gc.isenabled()
    gc.enable()
    try:
        runner = graphs.Graphs(_Stack(), offload=False)
        h = torch.randn(1, 4, 2)
        out = runner.run(h, torch.zeros(4, 1), torch.zeros(4, 1), Segments())
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False]
    assert out is h and "capture failed" in runner.failed


def test_the_stack_is_captured_from_leaves_sharing_the_inputs_memory(monkeypatch) -> None:
    """The capture's sample inputs (the graph's static inputs) are leaves in the given tensors' memory,
    each needing a gradient where the given one does: Granite's embedding multiplier, applied to the
    embeddings that PEFT's input-gradient hook made a leaf in every run, gives a stack input made by
    an op, and a capture that hands its gradient to that op's node fails on the GPU ("operation would
    make the legacy stream depend on a capturing blocking stream": the family grid's Granite rows ran
    eager at 7ae829a and 511983e, 20-35% above their estimate)."""
    seen: list[tuple[torch.Tensor, ...]] = []

    def make_graphed_callables(module, sample, num_warmup_iters, pool):
        seen.append(sample)
        raise RuntimeError("capture failed")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    embeddings = torch.randn(1, 4, 2).requires_grad_()  # as PEFT's hook leaves them
    h = embeddings * 12.0  # Granite's embedding_multiplier
    cos, sin, cu = torch.randn(4, 2), torch.randn(4, 2), torch.tensor([0, 4], dtype=torch.int32)
    graphs.Graphs(_Stack(), offload=False).run(h, cos, sin, Segments(cu=cu, max_len=4))
    (sample,) = seen
    assert all(x.grad_fn is None for x in sample), [x.grad_fn for x in sample]
    assert [x.requires_grad for x in sample] == [True, False, False, False]
    assert [x.data_ptr() for x in sample] == [x.data_ptr() for x in (h, cos, sin, cu)]
