"""Checkpointed layer inputs kept in host memory: per-layer recomputation whose saved input waits
in pinned CPU memory between the forward and the backward.

With every layer checkpointed, what a step keeps on the GPU through the forward is each layer's
input: ``tokens x hidden`` in the compute dtype per layer (2.1 GB at 8192 tokens on a 7B model,
more than the rest of the activations together). :class:`HostInputs` copies each input to a
pinned host buffer on a side stream while the layer computes, and in the backward brings the next
one back while the current layer is recomputed, so the copies hide behind the compute; at most two
layer inputs are on the GPU at once. Each layer's rotated q, k and v wait there too, so that its
recomputation skips the q/k/v product and RoPE, and where Studio's fused attention runs (Gemma 2's
soft-cap, gpt-oss' sinks: engine/fast/fused_attention.py) the attention's output and log-sum-exp, so
that it skips the attention's forward as well (its backward kernels read exactly those beside q, k,
v and the output's gradient). The last layer's stay on the GPU: its backward comes right after the
loss, so its copies could hide behind nothing. :class:`OffloadedLayer` is the
recomputing layer (what ``torch.utils.checkpoint`` does, with the input saved on the host).

Eager steps and CUDA-graphed ones alike (core/plan.py's ``offload_for`` decides, and the estimator
follows; ``trainer.fast_path.host_offload: false`` turns it off). A graph replays the copies it
captured, to and from the same host buffers: each graphed layout gets its own :class:`HostInputs`,
whose buffers never move. No tensor is handed to the copy stream with ``record_stream`` (inside a
capture that defers its memory's reuse to the capture's end, which would keep every layer input in
the graph's pool): the input stays referenced until the main stream has waited for its copy, one
layer later, and is freed after that.
"""

from __future__ import annotations

import os

import torch

from studio.engine.fast.layer import Kept

QKV = ("q", "k", "v")
"""The names a layer's kept q, k and v are stored under, beside its index."""

ATTENTION = ("out", "lse")
"""The names a layer's kept attention output and log-sum-exp are stored under, beside its index."""


class HostInputs:
    """Pinned host buffers for the layer inputs of one step, filled in the forward and read back,
    last layer first, in the backward. Buffers are kept between steps (one a layer)."""

    def __init__(self, device: torch.device, keep_budget: int | None = None):
        self.device = device
        self.last: int | None = None
        """The last layer's index (:meth:`reset` takes it from the stack). Its tensors stay where
        they are instead of crossing to the host and back: its backward comes first, right after the
        loss, so their copies could not hide behind any compute (the forward's end would wait for
        the way out, the backward's start for the way back)."""
        self.keep_budget = keep_budget
        """Most bytes of pinned host memory the kept tensors may take (None: a quarter of the
        host memory available when the first is kept); layers past it keep nothing and recompute
        their q, k and v (and attention) as before."""
        self._kept_bytes = 0
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._host: dict[object, torch.Tensor] = {}
        self._stored: dict[object, torch.Tensor] = {}
        self._fetched: dict[object, tuple[torch.Tensor, object]] = {}
        self._copying: list[tuple[torch.Tensor, object]] = []
        """The tensors whose copies to the host may still be running, and those copies' events."""

    def _buffer(self, index, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s pinned buffer, viewed as ``x``: one a layer, grown to the largest input
        seen (eager steps of packed data come in many token counts; a buffer per shape would pin
        host memory without bound)."""
        buffer = self._host.get(index)
        if buffer is None or buffer.numel() < x.numel() or buffer.dtype != x.dtype:
            buffer = torch.empty(x.numel(), dtype=x.dtype, pin_memory=self.cuda)
            self._host[index] = buffer
        return buffer[:x.numel()].view(x.shape)

    def reset(self, layers: int | None = None) -> None:
        """Forget the inputs of a step that never finished its backward (an out-of-memory error
        mid-step, a forward without backward): each forward starts clean, or its backward could be
        handed a previous step's prefetched input. ``layers``: how many the stack has."""
        if layers is not None:
            self.last = layers - 1
        self._stored.clear()
        self._fetched.clear()
        self._copying = []

    def _settle(self) -> None:
        """The main stream waits for the copies in flight; their tensors may be freed from then on."""
        if self._copying:
            torch.cuda.current_stream(self.device).wait_event(self._copying[-1][1])  # copies run in order
            self._copying = []

    def store(self, index, x: torch.Tensor, settle: bool = True) -> None:
        """Start copying ``x`` to the host under the key ``index`` (a layer's index for its input;
        ``(index, name)`` for a tensor kept beside it). ``settle``: the main stream first waits for
        the copies still in flight (a layer's input does: the previous layer's copies have
        overlapped that layer's compute, and their tensors are freed from here on); with False,
        this copy queues behind them and the tensors stay referenced until the next settling."""
        if self._stays(index):
            if settle and self.cuda:
                self._settle()
            self._fetched[index] = (x.detach(), None)  # never copied: load hands it back as it is
            return
        host = self._buffer(index, x)
        self._stored[index] = host
        if not self.cuda:
            host.copy_(x)
            return
        if settle:
            self._settle()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._copying.append((x, done))

    def _stays(self, index) -> bool:
        """Whether the tensor stored under ``index`` stays on the device (the last layer's)."""
        layer = index[0] if isinstance(index, tuple) else index
        return layer == self.last

    def holds(self, index) -> bool:
        """Whether a tensor is stored under ``index`` (on the host or staying on the device)."""
        return index in self._stored or index in self._fetched

    def finish(self) -> None:
        """End of the forward: the last copy joins the main stream (a CUDA graph's capture must
        end with no side-stream work outstanding)."""
        if self.cuda:
            self._settle()

    def prefetch(self, index) -> None:
        """Start bringing the tensor stored under ``index`` back to the device (no-op if absent)."""
        if index in self._fetched or index not in self._stored:
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

    def may_keep(self, index: int, names: tuple[str, ...], tensors) -> bool:
        """Whether layer ``index`` keeps ``tensors`` (stored under ``names``: its q, k and v, or its
        attention's output and log-sum-exp) on the host: it already has buffers for them (a
        graph's replay, a later step), or they fit in what is left of :attr:`keep_budget`."""
        grow = 0
        for name, t in zip(names, tensors, strict=True):
            buffer = self._host.get((index, name))
            if buffer is None or buffer.numel() < t.numel() or buffer.dtype != t.dtype:
                had = buffer.numel() * buffer.element_size() if buffer is not None else 0
                grow += t.numel() * t.element_size() - had
        if grow <= 0 or self._stays(index):
            return True
        if self.keep_budget is None:
            self.keep_budget = available_host_memory() // 4
        if self._kept_bytes + grow > self.keep_budget:
            return False
        self._kept_bytes += grow
        return True

    def prefetch_layer(self, index: int) -> None:
        """Start bringing layer ``index``'s input back, and what it kept."""
        self.prefetch(index)
        for name in QKV + ATTENTION:
            self.prefetch((index, name))

    def keep(self, index: int, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
        """Start copying layer ``index``'s ``tensors`` to the host under ``names``, if they fit the
        budget: queued behind the input's copy; the next layer's input settles them."""
        if not self.may_keep(index, names, tensors):
            return
        for name, t in zip(names, tensors, strict=True):
            self.store((index, name), t, settle=False)

    def keeper(self, index: int) -> LayerKeep:
        """What layer ``index``'s forward hands its q, k, v and attention to (layer.py's ``Keep``)."""
        return LayerKeep(self, index)

    def load_kept(self, index: int) -> Kept | None:
        """What layer ``index`` kept, on the device, or None if it kept nothing."""
        qkv, attention = self._load_group(index, QKV), self._load_group(index, ATTENTION)
        if qkv is None and attention is None:
            return None
        return Kept(qkv, attention)

    def _load_group(self, index: int, names: tuple[str, ...]) -> tuple | None:
        """Layer ``index``'s tensors kept under ``names`` (kept together or not at all), or None."""
        if not self.holds((index, names[0])):
            return None
        return tuple(self.load((index, name)) for name in names)

    def load(self, index) -> torch.Tensor:
        """The tensor stored under ``index`` on the device, once its copy has arrived."""
        self.prefetch(index)
        out, done = self._fetched.pop(index)
        self._stored.pop(index, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return out


class LayerKeep:
    """layer.py's ``Keep`` of one layer's forward: what it hands over is copied to the host."""

    def __init__(self, host: HostInputs, index: int):
        self.host, self.index = host, index

    def qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the layer's q, k and v (rotated where the layer keeps them so)."""
        self.host.keep(self.index, QKV, (q, k, v))

    def attention(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep the fused attention's output and log-sum-exp."""
        self.host.keep(self.index, ATTENTION, (out, lse))


class OffloadedLayer(torch.autograd.Function):
    """``layer.forward(h, ...)`` run without keeping anything but its input, on the host (and a
    sparse layer's routing, ``routing``: engine/fast/routing.py's KeptRouting, a few bytes a token on
    the device); the backward brings the input back, recomputes the layer with autograd on and
    returns the input's and the adapters' gradients. ``tensors`` are the hoisted adapters flattened (``spec`` puts them
    back in shape); their gradients flow on to the adapter parameters."""

    @staticmethod
    def forward(ctx, h, cos, sin, layer, seg, index, host: HostInputs, spec, routing, *tensors):
        host.store(index, h)
        ctx.layer, ctx.seg, ctx.index, ctx.host, ctx.spec, ctx.routing = layer, seg, index, host, spec, routing
        ctx.save_for_backward(cos, sin, *tensors)
        with torch.no_grad():
            return layer.forward(h, cos, sin, seg, unflatten(spec, tensors), keep=host.keeper(index),
                                 routing=routing)

    @staticmethod
    def backward(ctx, dout):
        cos, sin, *tensors = ctx.saved_tensors
        # The first layer's input (the frozen embeddings' output) wants no gradient: its products
        # then run no input-gradient product (products._input_gradient).
        want_dh = ctx.needs_input_grad[0]
        h = ctx.host.load(ctx.index).requires_grad_(want_dh)
        kept = ctx.host.load_kept(ctx.index)
        ctx.host.prefetch_layer(ctx.index - 1)  # the layer below's, while this one recomputes
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        adapters = unflatten(ctx.spec, leaves)
        with torch.enable_grad():
            # The output's two terms; the last product's value is never computed (layer.py).
            outs = ctx.layer.forward(h, cos, sin, ctx.seg, adapters, recompute=True, kept=kept, routing=ctx.routing)
        wanted = [*([h] if want_dh else []), *[t for t in leaves if t.requires_grad]]
        grads = iter(torch.autograd.grad(outs, wanted, (dout, dout), allow_unused=True))
        dh = next(grads) if want_dh else None
        dtensors = [next(grads) if t.requires_grad else None for t in leaves]
        return (dh, None, None, None, None, None, None, None, None, *dtensors)


def available_host_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable; elsewhere the free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def flatten(adapters: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """A layer's adapters (``Layer.adapters()``) as a spec and a flat list of their tensors (what
    an autograd function takes as inputs, so that the adapters get their gradients through it)."""
    spec, tensors = [], []
    for a, bt, scale in adapters:
        spec.append((a is not None, bt is not None, scale))
        tensors += [t for t in (a, bt) if t is not None]
    return tuple(spec), tensors


def unflatten(spec: tuple, tensors) -> tuple:
    """:func:`flatten`'s inverse."""
    it = iter(tensors)
    return tuple((next(it) if has_a else None, next(it) if has_bt else None, scale)
                 for has_a, has_bt, scale in spec)
