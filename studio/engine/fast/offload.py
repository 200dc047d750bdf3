"""Checkpointed layer inputs kept in host memory: per-layer recomputation whose saved input waits
in pinned CPU memory between the forward and the backward.

With every layer checkpointed, what a step keeps on the GPU through the forward is each layer's
input: ``tokens x hidden`` in the compute dtype per layer (2.1 GB at 8192 tokens on a 7B model,
more than the rest of the activations together). :class:`HostInputs` copies each input to a
pinned host buffer on a side stream while the layer computes, and in the backward brings the next
one back while the current layer is recomputed, so the copies hide behind the compute; at most two
layer inputs are on the GPU at once. :class:`OffloadedLayer` is the recomputing layer (what
``torch.utils.checkpoint`` does, with the input saved on the host).

Eager steps and CUDA-graphed ones alike (core/plan.py's ``offload_for`` decides, and the estimator
follows). A graph replays the copies it captured, to and from the same host buffers: each graphed
layout gets its own :class:`HostInputs`, whose buffers never move. No tensor is handed to the copy
stream with ``record_stream`` (inside a capture that defers its memory's reuse to the capture's end,
which would keep every layer input in the graph's pool): the input stays referenced until the main
stream has waited for its copy, one layer later, and is freed after that.
"""

from __future__ import annotations

import torch


class HostInputs:
    """Pinned host buffers for the layer inputs of one step, filled in the forward and read back,
    last layer first, in the backward. Buffers are kept between steps (one a layer)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._host: dict[int, torch.Tensor] = {}
        self._stored: dict[int, torch.Tensor] = {}
        self._fetched: dict[int, tuple[torch.Tensor, object]] = {}
        self._copying: tuple[torch.Tensor, object] | None = None
        """The input whose copy to the host may still be running, and that copy's event."""

    def _buffer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s pinned buffer, viewed as ``x``: one a layer, grown to the largest input
        seen (eager steps of packed data come in many token counts; a buffer per shape would pin
        host memory without bound)."""
        buffer = self._host.get(index)
        if buffer is None or buffer.numel() < x.numel() or buffer.dtype != x.dtype:
            buffer = torch.empty(x.numel(), dtype=x.dtype, pin_memory=self.cuda)
            self._host[index] = buffer
        return buffer[:x.numel()].view(x.shape)

    def reset(self) -> None:
        """Forget the inputs of a step that never finished its backward (an out-of-memory error
        mid-step, a forward without backward): each forward starts clean, or its backward could be
        handed a previous step's prefetched input."""
        self._stored.clear()
        self._fetched.clear()
        self._copying = None

    def _settle(self) -> None:
        """The main stream waits for the copy in flight; its input may be freed from then on."""
        if self._copying is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copying[1])
            self._copying = None

    def store(self, index: int, x: torch.Tensor) -> None:
        """Start copying layer ``index``'s input to the host."""
        host = self._buffer(index, x)
        self._stored[index] = host
        if not self.cuda:
            host.copy_(x)
            return
        self._settle()  # the previous layer's copy has overlapped that layer's compute
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._copying = (x, done)

    def finish(self) -> None:
        """End of the forward: the last copy joins the main stream (a CUDA graph's capture must
        end with no side-stream work outstanding)."""
        if self.cuda:
            self._settle()

    def prefetch(self, index: int) -> None:
        """Start bringing layer ``index``'s input back to the device (no-op if absent or on CPU)."""
        if index < 0 or index in self._fetched or index not in self._stored:
            return
        host = self._stored[index]
        if not self.cuda:
            self._fetched[index] = (host.clone(), None)
            return
        # Allocated on the main stream and used there only after waiting for ``done``: it is never
        # freed while the copy may still write it.
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        # The main stream is past the forward's last copy (finish) and done with out's memory.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._fetched[index] = (out, done)

    def load(self, index: int) -> torch.Tensor:
        """Layer ``index``'s input on the device, once its copy has arrived."""
        self.prefetch(index)
        out, done = self._fetched.pop(index)
        self._stored.pop(index, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return out


class OffloadedLayer(torch.autograd.Function):
    """``layer.forward(h, ...)`` run without keeping anything but its input, on the host; the
    backward brings the input back, recomputes the layer with autograd on and returns the input's
    and the adapters' gradients. ``tensors`` are the hoisted adapters flattened (``spec`` puts them
    back in shape); their gradients flow on to the adapter parameters."""

    @staticmethod
    def forward(ctx, h, cos, sin, layer, seg, index, host: HostInputs, spec, *tensors):
        host.store(index, h)
        ctx.layer, ctx.seg, ctx.index, ctx.host, ctx.spec = layer, seg, index, host, spec
        ctx.save_for_backward(cos, sin, *tensors)
        with torch.no_grad():
            return layer.forward(h, cos, sin, seg, unflatten(spec, tensors))

    @staticmethod
    def backward(ctx, dout):
        cos, sin, *tensors = ctx.saved_tensors
        h = ctx.host.load(ctx.index).requires_grad_(True)
        ctx.host.prefetch(ctx.index - 1)  # the layer below's input, while this one recomputes
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        adapters = unflatten(ctx.spec, leaves)
        with torch.enable_grad():
            if ctx.layer.skip_last:
                # The output's two terms; the last product's value is never computed (layer.py).
                outs, douts = ctx.layer.forward(h, cos, sin, ctx.seg, adapters, recompute=True), (dout, dout)
            else:
                outs, douts = ctx.layer.forward(h, cos, sin, ctx.seg, adapters), dout
        wanted = [h, *[t for t in leaves if t.requires_grad]]
        grads = iter(torch.autograd.grad(outs, wanted, douts, allow_unused=True))
        dh = next(grads)
        dtensors = [next(grads) if t.requires_grad else None for t in leaves]
        return (dh, None, None, None, None, None, None, None, *dtensors)


def flatten(adapters: tuple | None) -> tuple[object, list[torch.Tensor]]:
    """A layer's hoisted adapters (``Layer.adapters()``) as a spec and a flat tensor list."""
    if adapters is None:
        return None, []
    spec, tensors = [], []
    for item in adapters:
        if item is None:
            spec.append(None)
            continue
        a, bt, scale = item
        spec.append((a is not None, bt is not None, scale))
        tensors += [t for t in (a, bt) if t is not None]
    return tuple(spec), tensors


def unflatten(spec, tensors) -> tuple | None:
    if spec is None:
        return None
    it = iter(tensors)
    out = []
    for item in spec:
        if item is None:
            out.append(None)
            continue
        has_a, has_bt, scale = item
        out.append((next(it) if has_a else None, next(it) if has_bt else None, scale))
    return tuple(out)
