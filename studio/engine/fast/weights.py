"""Frozen base weights and the fused QLoRA product.

Several projections that read one input (q/k/v, gate/up) become one matrix product: their 4-bit
weights are dequantized straight into one buffer, and the LoRA updates are added by the product's
epilogue. The backward re-dequantizes instead of keeping the bf16 weights alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from studio.engine.fast import dequant, update
from studio.engine.fast.dropout import dropout


class Workspace:
    """One buffer that every fused 4-bit weight of the model is dequantized into.

    A dequantized weight lives from its dequantization to the end of the one matrix product that
    reads it (:class:`LoraProduct` never saves it), and all of them run in order on one stream, so
    one buffer as large as the widest fused weight serves them all. Without it each product
    allocates its own: the allocator then keeps holes of the widest size around, and a CUDA graph's
    private pool keeps about two layers of dequantized weights (bench/results, docs/memory.md).
    """

    def __init__(self) -> None:
        self.numel = 0
        self.buffer: torch.Tensor | None = None

    def reserve(self, numel: int) -> None:
        """Make room for a weight of ``numel`` elements (before :meth:`allocate`)."""
        self.numel = max(self.numel, numel)

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the buffer now, before any CUDA graph capture (a capture must not allocate it)."""
        if self.numel and (self.buffer is None or self.buffer.numel() < self.numel):
            self.buffer = torch.empty(self.numel, dtype=dtype, device=device)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        assert self.buffer is not None and rows * cols <= self.buffer.numel(), "workspace not allocated"
        return self.buffer[:rows * cols].view(rows, cols)


class FrozenWeights:
    """The frozen base weights of one or more projections that share an input, used as one matrix.

    4-bit weights are dequantized on every call (one kernel each, into the model's shared
    :class:`Workspace` when there is one); their double-quantized scales can be expanded to fp32
    once here (``cache_absmax``), since they never change while training. With ``split`` (the
    default) the products run one projection at a time, each writing its own columns of the output:
    the dequantized buffer then holds one projection (gate, not gate and up: -86 MiB on a 7B model)
    and unquantized bases are read where they are instead of concatenated on every call.
    """

    def __init__(self, bases: Sequence[nn.Module], dtype: torch.dtype, cache_absmax: bool,
                 workspace: Workspace | None = None, split: bool = True, triton_dequant: bool = True):
        self.bases = list(bases)
        self.dtype = dtype
        self.out_features = [int(b.out_features) for b in self.bases]
        self.in_features = int(self.bases[0].in_features)
        self.quantized = [is_4bit(b) for b in self.bases]
        self.split = split and len(self.bases) > 1
        self.workspace = workspace if any(self.quantized) else None
        self.libraries: dict[str, str] = {}
        """The BLAS library (``"cublas"``, ``"cublaslt"``) the base products ask torch for, by
        direction (``"forward"``, ``"backward"``); none given: torch's choice
        (``FastOptions.product_library``)."""
        if self.workspace is not None:
            widest = max(self.out_features) if self.split else sum(self.out_features)
            self.workspace.reserve(widest * self.in_features)
        self._absmax: list[torch.Tensor | None] = []
        self._kernels: list[dequant.NF4Weight | None] = []
        """Each 4-bit weight's one-kernel dequantization (dequant.py), where it covers the weight."""
        for base, q in zip(self.bases, self.quantized, strict=True):
            absmax = expanded_absmax(base.weight.quant_state) if q and cache_absmax else None
            self._absmax.append(absmax)
            device = base.weight.device
            if q and triton_dequant and dequant.supports(base.weight.quant_state, dtype) \
                    and dequant.available(device):
                self._kernels.append(dequant.NF4Weight(base.weight.quant_state, device, absmax))
            else:
                self._kernels.append(None)

    @property
    def one_kernel(self) -> bool:
        """Whether its 4-bit weights are dequantized by Studio's kernel (dequant.py) right now."""
        return any(k is not None for k in self._kernels) and not dequant.broken()

    def matrix(self) -> torch.Tensor:
        """The bf16 (compute dtype) weight ``[sum(out_features), in_features]``."""
        if not any(self.quantized):
            if len(self.bases) == 1:
                return self.bases[0].weight.to(self.dtype)
            return torch.cat([b.weight.to(self.dtype) for b in self.bases])
        rows = sum(self.out_features)
        out = self._buffer(rows)
        row = 0
        for base, absmax, kernel, n in zip(self.bases, self._absmax, self._kernels, self.out_features,
                                           strict=True):
            _dequantize_into(base, absmax, out[row:row + n], kernel)
            row += n
        return out

    def _buffer(self, rows: int) -> torch.Tensor:
        if self.workspace is not None:
            return self.workspace.take(rows, self.in_features)
        return torch.empty(rows, self.in_features, dtype=self.dtype, device=self.bases[0].weight.device)

    def _piece(self, index: int) -> torch.Tensor:
        """Projection ``index``'s weight ``[out_features[index], in_features]`` in the compute dtype
        (a 4-bit one dequantized into the buffer: valid until the next piece)."""
        base = self.bases[index]
        if not self.quantized[index]:
            return base.weight.to(self.dtype)
        out = self._buffer(self.out_features[index])
        _dequantize_into(base, self._absmax[index], out, self._kernels[index])
        return out

    def _columns(self):
        row = 0
        for index, n in enumerate(self.out_features):
            yield index, slice(row, row + n)
            row += n

    def forward_product(self, x2: torch.Tensor, into: torch.Tensor | None = None,
                        base: torch.Tensor | None = None) -> torch.Tensor:
        """``x2 @ W^T``: ``[tokens, sum(out_features)]``; added to ``into`` in place when given
        (the product's epilogue reads it: no pass of its own), or written beside ``base`` (the
        result is ``base + x2 @ W^T``, a new tensor)."""
        with blas_library(self.libraries.get("forward")):
            return self._forward_product(x2, into, base)

    def _forward_product(self, x2: torch.Tensor, into: torch.Tensor | None,
                         base: torch.Tensor | None) -> torch.Tensor:
        if not self.split:
            w = self.matrix().t()
            if into is not None:
                return into.addmm_(x2, w)
            return x2 @ w if base is None else torch.addmm(base, x2, w)
        y = into if into is not None else x2.new_empty(x2.shape[0], sum(self.out_features))
        for index, cols in self._columns():
            # A column block of a row-major output is a strided matrix cuBLAS writes in place.
            w = self._piece(index).t()
            if into is not None:
                y[:, cols].addmm_(x2, w)
            elif base is not None:
                torch.addmm(base[:, cols], x2, w, out=y[:, cols])
            else:
                torch.mm(x2, w, out=y[:, cols])
        return y

    def backward_product(self, dy2: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``dy2 @ W``: ``[tokens, in_features]``, summed over the projections; added to ``into``
        in place when given (in the products' epilogues)."""
        if not self.split:
            w = self.matrix()
            with blas_library(self.libraries.get("backward")):
                return dy2 @ w if into is None else into.addmm_(dy2, w)
        return self.backward_blocks([dy2[:, cols] for _, cols in self._columns()], into)

    def backward_blocks(self, blocks: Sequence[torch.Tensor], into: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_j blocks[j] @ W_j``: the input gradient from each projection's output gradient
        (added to ``into`` in place when given)."""
        dx = into
        with blas_library(self.libraries.get("backward")):
            for index, block in enumerate(blocks):
                w = self._piece(index)
                if dx is None:
                    dx = block @ w
                else:
                    dx.addmm_(block, w)
        return dx


_AS_IS = nullcontext()


def blas_library(name: str | None) -> AbstractContextManager:
    """Ask torch for the BLAS library ``name`` (``"cublas"``, ``"cublaslt"``) for the products run
    inside; None: leave torch's choice as it is (one shared do-nothing context: the products call
    this on every step). The choice is torch's process-wide setting, put back on the way out.
    Inside a CUDA graph's capture the library's kernels are what the graph records, so a replay
    keeps them. Without CUDA there is no choice to make."""
    if not name or not torch.cuda.is_available():
        return _AS_IS
    return _asking(name)


@contextmanager
def _asking(name: str) -> Iterator[None]:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def is_4bit(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def expanded_absmax(state) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        return absmax.float()
    return state.absmax.float()


def _dequantize_into(base: nn.Module, absmax: torch.Tensor | None, out: torch.Tensor,
                     kernel: dequant.NF4Weight | None = None) -> None:
    if kernel is not None:  # one kernel, the scales included (dequant.py); bitsandbytes' if it fails
        done, _ = dequant.KERNELS.attempt(lambda: kernel(base.weight.data, out))
        if done:
            return
    state = base.weight.quant_state
    if absmax is None:
        absmax = expanded_absmax(state)
    args = (base.weight.data, absmax, state.blocksize, state.quant_type, out.shape, out.dtype)
    if out.device.type == "cuda":
        torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=out)
    else:  # bitsandbytes' CPU backend has no out= variant
        out.copy_(torch.ops.bitsandbytes.dequantize_4bit.default(*args))


class AdapterDropout:
    """Dropout on each adapter's input inside one fused product: the rate, mask site and rank of
    each stacked adapter (in :class:`LoraProduct`'s A order) and the model's seed tensor. Masks
    come from engine/fast/dropout.py: regenerated in the backward, never saved."""

    def __init__(self, rates: Sequence[float], sites: Sequence[int], ranks: Sequence[int], seed: torch.Tensor):
        self.rates, self.sites, self.ranks, self.seed = list(rates), list(sites), list(ranks), seed
        self.slices = []
        row = 0
        for r in self.ranks:
            self.slices.append(slice(row, row + r))
            row += r

    def project(self, x2: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``[drop_j(x) A_j^T for each adapter j]`` side by side: ``[tokens, sum(r)]``."""
        parts = [dropout(x2, p, self.seed, site) @ a[rows].t()
                 for p, site, rows in zip(self.rates, self.sites, self.slices, strict=True)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def backward(self, x2: torch.Tensor, a: torch.Tensor, dyb: torch.Tensor, dx: torch.Tensor | None,
                 want_da: bool, fresh: bool = False) -> torch.Tensor | None:
        """Add each adapter's input gradient (masked as its input was) into ``dx`` (with ``fresh``,
        the first one overwrites it: ``dx``'s contents are never read; None: no input gradient is
        wanted); return dA."""
        das = []
        for j, (p, site, rows) in enumerate(zip(self.rates, self.sites, self.slices, strict=True)):
            dyb_j = dyb[:, rows]
            if dx is not None:
                dropout(dyb_j @ a[rows], p, self.seed, site, out=dx, accumulate=not (fresh and j == 0))
            if want_da:
                das.append(dyb_j.t() @ dropout(x2, p, self.seed, site))
        if not want_da:
            return None
        return torch.cat(das) if len(das) > 1 else das[0]


def _input_gradient(ctx, x2: torch.Tensor, dyb: torch.Tensor | None, a: torch.Tensor | None,
                    base: Callable[[torch.Tensor | None], torch.Tensor]
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A fused product's input gradient and A's gradient (each None unless autograd wants it:
    inputs 0 and 2 of the products; the first layer's input, the frozen embeddings' output, wants
    none, and its products then run no backward product at all). ``base(into)`` is the frozen
    products' share (added into ``into`` when given); ``dyb`` the output gradient through the B
    matrices, scaled (None without adapters).

    The LoRA term comes first: its product (inner size the rank) writes the input gradient and
    the base products add themselves in their epilogues, where the other order reads and writes
    the whole gradient once more (``ctx.backward_first``; False: the order before, for
    benchmarks). With dropout, each adapter's term is masked as its input was."""
    want_da = ctx.needs_input_grad[2]
    if not ctx.needs_input_grad[0]:
        if dyb is None or not want_da:
            return None, None
        if ctx.drop is not None:
            return None, ctx.drop.backward(x2, a, dyb, None, want_da)
        return None, dyb.t() @ x2
    if dyb is None:
        return base(None), None
    if ctx.backward_first and ctx.drop is not None:
        dx = x2.new_empty(x2.shape)
        da = ctx.drop.backward(x2, a, dyb, dx, want_da, fresh=True)
        return base(dx), da
    if ctx.backward_first:
        dx = base(dyb @ a)
    else:
        dx = base(None)
        if ctx.drop is not None:
            return dx, ctx.drop.backward(x2, a, dyb, dx, want_da)
        dx.addmm_(dyb, a)
    return dx, (dyb.t() @ x2 if want_da else None)


class LoraProduct(torch.autograd.Function):
    """``y = r + x W^T + s (x A^T) B^T`` for a frozen W that is rebuilt, never saved, in the
    backward, and an optional residual ``r`` (the stream the layer adds its output to).

    ``A`` stacks the adapters' A matrices ``[n*r, in]``; ``Bt`` holds their B matrices transposed on
    a block diagonal ``[n*r, sum(out)]``, so several adapters over one input cost two small products.
    With ``drop`` (:class:`AdapterDropout`), each adapter reads its own masked copy of ``x``.

    The small term comes first: the LoRA update's product (inner size the rank) writes the output,
    and the base product adds itself in its epilogue. The base product is bound by its arithmetic,
    so reading the output there costs nothing, where the update added after it would read and
    write the whole output once more. The residual is added last, in a pass of its own: folded into
    the update's product (the eighth session's order) it met the update before the base product
    did, and in bf16 a small update added to the large stream rounds away (the per-step losses
    lagged the HF loop's by up to 3.3%; bench/results/h100_v10_loss_bisect.json).
    """

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None,
                value: bool = True, residual: torch.Tensor | None = None, update_first: bool = True,
                backward_first: bool = True, in_kernel: bool = False, handoff: update.Handoff | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        width = sum(weights.out_features)
        r2 = residual.reshape(-1, width) if residual is not None else None
        xa = None
        if a is not None:
            xa = x2 @ a.t() if drop is None else drop.project(x2, a)
        y = None
        if value and xa is not None and update_first and in_kernel and r2 is not None:
            y = _update_then_residual(weights, x2, xa, bt, scale, r2)
        if y is None:
            if not value:
                # Only the backward is wanted (a recomputation whose output nothing reads): no base
                # product, no LoRA update; a zero of the output's shape that owns no memory.
                y = x2.new_zeros(()).expand(x2.shape[0], width)
                if r2 is not None:
                    y = y + r2
            elif xa is not None and not update_first:  # the order before (bench/speed.py's lever)
                y = weights.forward_product(x2)
                y.addmm_(xa, bt, alpha=scale)
                if r2 is not None:
                    y += r2
            elif xa is not None:
                y = x2.new_empty(x2.shape[0], width)
                y.addmm_(xa, bt, beta=0, alpha=scale)  # beta 0: y's contents are never read
                weights.forward_product(x2, into=y)
                if r2 is not None:
                    # The stream comes last, as in the plain order: added to it directly, an update
                    # under half the stream's last bf16 digit (early in training, most of them) would
                    # round away to nothing, and the model would not see what it has learned.
                    y.add_(r2)
            else:
                y = weights.forward_product(x2, base=r2)
        if xa is not None:
            ctx.save_for_backward(x2, a, bt, xa)
        else:
            ctx.save_for_backward(x2)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.residual, ctx.backward_first = residual is not None, backward_first
        ctx.handoff = handoff if drop is None and backward_first else None
        return y.view(*shape[:-1], width)

    @staticmethod
    def backward(ctx, dy):
        dx, da, dbt = _fused_backward(ctx, ctx.saved_tensors, dy.reshape(-1, dy.shape[-1]))
        dres = dy if ctx.residual else None  # the residual passes straight through
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None, dres, None, None, None, None


def _shaped(dx: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    return None if dx is None else dx.view(shape)


def _update_then_residual(weights: FrozenWeights, x2: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor,
                          scale: float, r2: torch.Tensor) -> torch.Tensor | None:
    """``r2 + (x2 W^T + scale xa bt)`` with the base product writing the output alone and one kernel
    adding the update, then the stream (engine/fast/update.py), where the update's product would
    write it first; None where the kernels cannot run here."""
    if update.broken():
        return None
    y = weights.forward_product(x2)
    done, _ = _in_kernel(lambda: update.add_update_and_residual_(y, xa, bt, scale, r2))
    return y if done else None


def _in_kernel(run: Callable[[], torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
    """Run one of engine/fast/update.py's kernels: (True, its result), or (False, None) when it
    cannot build here (the kernels are then given up on for this process, and the caller takes its
    usual order)."""
    return update.KERNELS.attempt(run)


def _fused_backward(ctx, saved, dy2: torch.Tensor):
    """(input gradient, A's, B^T's) of a fused product from its whole output's gradient; ``saved``
    is ``(x2,)`` or ``(x2, a, bt, xa)``."""
    x2 = saved[0]
    a = bt = xa = dyb = dbt = None
    if len(saved) > 1:
        _, a, bt, xa = saved
        dyb = (dy2 @ bt.t()).mul_(ctx.scale)
    handoff = getattr(ctx, "handoff", None)
    if handoff is not None and dyb is not None and ctx.needs_input_grad[0]:
        # The LoRA term dyb @ A goes to the next kernel back (update.Handoff), which adds it to the
        # gradient as it reads it: the base product writes the input gradient alone.
        dx = ctx.weights.backward_product(dy2)
        handoff.give(dyb, a)
        da = dyb.t() @ x2 if ctx.needs_input_grad[2] else None
    else:
        dx, da = _input_gradient(ctx, x2, dyb, a, lambda into: ctx.weights.backward_product(dy2, into))
    if xa is not None and ctx.needs_input_grad[3]:
        dbt = (xa.t() @ dy2).mul_(ctx.scale)
    return dx, da, dbt


def _blocks_backward(ctx, saved, blocks: Sequence[torch.Tensor]):
    """:func:`_fused_backward` from each projection's output gradient apart
    (:class:`SeparateLoraProduct`)."""
    x2 = saved[0]
    columns = [cols for _, cols in ctx.weights._columns()]
    a = bt = xa = dyb = dbt = None
    if len(saved) > 1:
        _, a, bt, xa = saved
        for cols, block in zip(columns, blocks, strict=True):
            if dyb is None:
                dyb = block @ bt[:, cols].t()
            else:
                dyb.addmm_(block, bt[:, cols].t())
        dyb.mul_(ctx.scale)
    dx, da = _input_gradient(ctx, x2, dyb, a, lambda into: ctx.weights.backward_blocks(blocks, into))
    if xa is not None and ctx.needs_input_grad[3]:
        dbt = bt.new_empty(bt.shape)
        for cols, block in zip(columns, blocks, strict=True):
            torch.mm(xa.t(), block, out=dbt[:, cols])
        dbt.mul_(ctx.scale)
    return dx, da, dbt


class DeferredLoraProduct(torch.autograd.Function):
    """:class:`LoraProduct` whose update is left to the reader: returns the base product ``x W^T``
    standing for the whole output, and ``x A^T`` (no gradient) for the reader to add
    ``scale * (x A^T) B^T`` tile by tile (update.LoraSwiGLU). The backward takes the whole output's
    gradient, exactly as :class:`LoraProduct`'s does."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None,
                backward_first: bool = True):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xa = x2 @ a.t() if drop is None else drop.project(x2, a)
        y = weights.forward_product(x2)
        ctx.save_for_backward(x2, a, bt, xa)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.residual, ctx.backward_first = False, backward_first
        ctx.mark_non_differentiable(xa)
        return y.view(*shape[:-1], y.shape[-1]), xa

    @staticmethod
    def backward(ctx, dy, _dxa):
        dx, da, dbt = _fused_backward(ctx, ctx.saved_tensors, dy.reshape(-1, dy.shape[-1]))
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None


class SeparateLoraProduct(torch.autograd.Function):
    """:class:`LoraProduct` for projections whose outputs are read apart (q, k and v), one product
    a projection: each output is a tensor of its own, so what reads one (RoPE's kernel, the
    attention) gets it contiguous instead of copying a column block out of the fused output, and
    the backward takes their gradients as they come instead of concatenating them first. Same
    order as :class:`LoraProduct`: each output is written by its LoRA update's product and the
    base product adds itself in its epilogue."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None,
                backward_first: bool = True):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xa = None
        if a is not None:
            xa = x2 @ a.t() if drop is None else drop.project(x2, a)
        outs = []
        for index, cols in weights._columns():
            w = weights._piece(index).t()
            with blas_library(weights.libraries.get("forward")):
                if xa is not None:
                    y = x2.new_empty(x2.shape[0], cols.stop - cols.start)
                    y.addmm_(xa, bt[:, cols], beta=0, alpha=scale)  # beta 0: y's contents are never read
                    y.addmm_(x2, w)
                else:
                    y = x2 @ w
            outs.append(y.view(*shape[:-1], y.shape[-1]))
        if xa is not None:
            ctx.save_for_backward(x2, a, bt, xa)
        else:
            ctx.save_for_backward(x2)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.backward_first = backward_first  # the forward's order is always the update first
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        blocks = [d.reshape(-1, d.shape[-1]) for d in dys]
        dx, da, dbt = _blocks_backward(ctx, ctx.saved_tensors, blocks)
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None


class KeptQKV(torch.autograd.Function):
    """The q/k/v product and RoPE of a recomputed layer whose rotated q, k and v were kept from
    its forward (engine/fast/offload.py brings them back from the host): the values are the kept
    ones, so the recomputation runs neither the product (a third of its products on a 7B model)
    nor RoPE, and the backward is theirs: RoPE's inverse rotation of the q and k gradients, then the
    product's backward exactly as :class:`SeparateLoraProduct` (``separate``) or
    :class:`LoraProduct` (one fused output) computes it. ``kept`` is the tuple ``(q, k, v)``,
    ``[B, T, heads, head_dim]``; ``unrotate(dq, dk, cos, sin)`` is RoPE's backward."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None,
                backward_first: bool, separate: bool, kept: tuple, cos, sin, unrotate):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if a is not None:
            xa = x2 @ a.t() if drop is None else drop.project(x2, a)  # B's gradient reads it
            ctx.save_for_backward(x2, a, bt, xa)
        else:
            ctx.save_for_backward(x2)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.backward_first, ctx.separate = backward_first, separate
        ctx.cos, ctx.sin, ctx.unrotate = cos, sin, unrotate
        return kept

    @staticmethod
    def backward(ctx, dq, dk, dv):
        dq, dk = ctx.unrotate(dq, dk, ctx.cos, ctx.sin)
        blocks = [d.reshape(-1, d.shape[-2] * d.shape[-1]) for d in (dq, dk, dv)]
        if ctx.separate:
            dx, da, dbt = _blocks_backward(ctx, ctx.saved_tensors, blocks)
        else:  # what autograd hands a fused output split three ways: the blocks side by side
            dx, da, dbt = _fused_backward(ctx, ctx.saved_tensors, torch.cat(blocks, dim=1))
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None, None, None, None, None, None


def has_adapter(module: nn.Module, adapter: str) -> bool:
    return hasattr(module, "lora_A") and adapter in module.lora_A


class Projection:
    """Linears reading the same input (with or without a LoRA adapter each), as one product."""

    def __init__(self, modules: Sequence[nn.Module], adapter: str, dtype: torch.dtype, cache_absmax: bool,
                 workspace: Workspace | None = None, split: bool = True, triton_dequant: bool = True):
        self.modules = list(modules)
        bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in modules]
        self.weights = FrozenWeights(bases, dtype, cache_absmax, workspace, split, triton_dequant)
        self.dtype = dtype
        adapted = [m for m in modules if has_adapter(m, adapter)]
        self.present = [has_adapter(m, adapter) for m in modules]
        self.a = [m.lora_A[adapter].weight for m in adapted]
        self.b = [m.lora_B[adapter].weight for m in adapted]
        self.scales = [float(m.scaling[adapter]) for m in adapted]
        drop = [m.lora_dropout[adapter] for m in adapted]
        self.dropout = [d.p if isinstance(d, nn.Dropout) else 0.0 for d in drop]
        self.ranks = [int(a.shape[0]) for a in self.a]
        self.drop: AdapterDropout | None = None
        self.separate = False
        """Each projection's output a tensor of its own (:class:`SeparateLoraProduct`; split
        products only): :meth:`__call__` returns a tuple."""
        self.update_first = True
        """The LoRA update's product writes the output and the base product adds itself to it
        (:class:`LoraProduct`); False: the base product first (the order before, for benchmarks)."""
        self.backward_first = True
        """The same order for the input gradient (:func:`_input_gradient`)."""
        self.hand_off = False
        """:meth:`handoff` gives a Handoff (where the rest allows)."""
        self.in_kernel = False
        """The update is added by the kernel that reads the base product's output (update.py): the
        residual's add for o and down (:class:`LoraProduct`), SwiGLU for gate/up (:meth:`swiglu`)."""

    def use_dropout(self, seed: torch.Tensor, first_site: int) -> None:
        """Give the adapters with dropout their masks: from ``seed``, at sites ``first_site + j``."""
        if any(self.dropout):
            sites = [first_site + j for j in range(len(self.a))]
            self.drop = AdapterDropout(self.dropout, sites, self.ranks, seed)

    def adapters(self, sink: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """The adapters as the fused product takes them: stacked A, block-diagonal B^T, scale.

        Built from the fp32 parameters through autograd, so their gradients flow back to each
        adapter; a projection without an adapter gets an empty block. ``sink`` maps the parameters
        to the tensors the products use in their place (graphs.py routes the gradients through it).
        """
        if not self.a:
            return None, None, 1.0
        a_params, b_params = self.a, self.b
        if sink is not None:
            used = sink([*self.a, *self.b])
            a_params, b_params = used[:len(self.a)], used[len(self.a):]
        a = torch.cat(a_params).to(self.dtype) if len(a_params) > 1 else a_params[0].to(self.dtype)
        # Scales folded into B when they differ (rare: per-module alpha); else passed as alpha.
        same = all(s == self.scales[0] for s in self.scales)
        adapted = iter(zip(b_params, self.scales, strict=True))
        bts = []
        for present, n in zip(self.present, self.weights.out_features, strict=True):
            if present:
                b, s = next(adapted)
                bts.append(b.t() if same else b.t() * s)
            else:
                bts.append(a.new_zeros(0, n))
        bt = (torch.block_diag(*bts) if len(bts) > 1 else bts[0]).to(self.dtype)
        return a, bt, self.scales[0] if same else 1.0

    def __call__(self, x: torch.Tensor, adapters: tuple | None = None, value: bool = True,
                 residual: torch.Tensor | None = None, handoff: update.Handoff | None = None) -> torch.Tensor:
        """The product, plus ``residual`` when given (added inside the products: no pass of its
        own). With ``value=False`` only its backward is real (see :class:`LoraProduct`): the
        output is a zero that owns no memory, and the base product is skipped."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        drop = self.drop if self.drop is not None and self.modules[0].training else None
        if self.separated:
            assert value and residual is None, "separate outputs take no residual"
            return SeparateLoraProduct.apply(x, self.weights, a, bt, scale, drop, self.backward_first)
        return LoraProduct.apply(x, self.weights, a, bt, scale, drop, value, residual, self.update_first,
                                 self.backward_first, self.in_kernel, handoff)

    def handoff(self) -> update.Handoff | None:
        """A :class:`~studio.engine.fast.update.Handoff` for this product's LoRA input-gradient term,
        where the kernel that made its input can take it (the SwiGLU before the down product): the
        update kernels on, no adapter dropout (its mask would have to go along), the LoRA term's
        order in the backward. None otherwise."""
        dropping = self.drop is not None and self.modules[0].training
        if not (self.in_kernel and self.hand_off) or not self.a or dropping or not self.backward_first \
                or update.broken():
            return None
        return update.Handoff()

    def swiglu(self, x: torch.Tensor, adapters: tuple | None = None,
               handoff: update.Handoff | None = None) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate/up projection's output, the update added inside SwiGLU's
        kernel (update.LoraSwiGLU); None where that is off or cannot run (the caller then runs the
        product and its own SwiGLU). ``handoff``: the next product's (:meth:`handoff`), whose LoRA
        input-gradient term SwiGLU's backward then adds."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        if not self.in_kernel or a is None or update.broken():
            return None
        drop = self.drop if self.drop is not None and self.modules[0].training else None
        gu, xa = DeferredLoraProduct.apply(x, self.weights, a, bt, scale, drop, self.backward_first)
        split = None
        if len(self.present) == 2:  # gate's rows of the block-diagonal B^T first, then up's
            ranks = iter(self.ranks)
            r_gate = next(ranks) if self.present[0] else 0
            r_up = next(ranks) if self.present[1] else 0
            split = (0, r_gate, r_gate, r_up)
        # bt without its autograd history: the product's backward gives the adapters their gradients.
        done, act = _in_kernel(lambda: update.LoraSwiGLU.apply(gu, xa, bt.detach(), scale, split, handoff))
        return act if done else None

    def from_kept(self, x: torch.Tensor, kept: tuple, cos: torch.Tensor, sin: torch.Tensor, unrotate,
                  adapters: tuple | None = None) -> tuple:
        """A recomputation's q, k and v, rotated, from the forward's kept copies (:class:`KeptQKV`):
        the values are ``kept``, the backward is the product's and RoPE's."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        drop = self.drop if self.drop is not None and self.modules[0].training else None
        return KeptQKV.apply(x, self.weights, a, bt, scale, drop, self.backward_first, self.separated,
                             tuple(kept), cos, sin, unrotate)

    @property
    def separated(self) -> bool:
        """Whether :meth:`__call__` returns each projection's output apart (a tuple)."""
        return self.separate and self.weights.split
