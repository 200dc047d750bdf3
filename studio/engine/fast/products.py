"""The fused QLoRA products as autograd functions: ``y = r + x W^T + s (x A^T) B^T`` for frozen
weights W (:class:`~studio.engine.fast.frozen.FrozenWeights`) that are dequantized again, never
saved, in the backward, with the backward written by hand.

``A`` stacks the adapters' A matrices ``[n*r, in]``; ``Bt`` holds their B matrices transposed on a
block diagonal ``[n*r, sum(out)]``, so several adapters over one input cost two small products.
With :class:`AdapterDropout`, each adapter reads its own masked copy of ``x``.

The small term comes first, both ways: in the forward the LoRA update's product (inner size the
rank) writes the output and the base product adds itself in its epilogue; in the backward the LoRA
term writes the input gradient and the base products add themselves in theirs. The base products
are bound by their arithmetic, so reading the output there costs nothing, where the update added
after them would read and write the whole output once more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from studio.engine.fast import update
from studio.engine.fast.dropout import dropout
from studio.engine.fast.frozen import FrozenWeights


class AdapterDropout:
    """Dropout on each adapter's input inside one fused product: the rate, mask site and rank of
    each stacked adapter (in A's order) and the model's seed tensor. Masks come from
    engine/fast/dropout.py: regenerated in the backward, never saved."""

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
                 want_da: bool) -> torch.Tensor | None:
        """Write the sum of the adapters' input gradients (each masked as its input was) into
        ``dx``, whose contents are never read (None: no input gradient is wanted); return dA."""
        das = []
        for j, (p, site, rows) in enumerate(zip(self.rates, self.sites, self.slices, strict=True)):
            dyb_j = dyb[:, rows]
            if dx is not None:
                dropout(dyb_j @ a[rows], p, self.seed, site, out=dx, accumulate=j > 0)
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
    matrices, scaled (None without adapters). The LoRA term writes the input gradient, the base
    products add themselves in their epilogues."""
    want_da = ctx.needs_input_grad[2]
    if not ctx.needs_input_grad[0]:
        if dyb is None or not want_da:
            return None, None
        if ctx.drop is not None:
            return None, ctx.drop.backward(x2, a, dyb, None, want_da)
        return None, dyb.t() @ x2
    if dyb is None:
        return base(None), None
    if ctx.drop is not None:
        dx = x2.new_empty(x2.shape)
        da = ctx.drop.backward(x2, a, dyb, dx, want_da)
        return base(dx), da
    dx = base(dyb @ a)
    return dx, (dyb.t() @ x2 if want_da else None)


def _adapter_input(x2: torch.Tensor, a: torch.Tensor, drop: AdapterDropout | None) -> torch.Tensor:
    """``x A^T`` (each adapter's input masked with ``drop``)."""
    return x2 @ a.t() if drop is None else drop.project(x2, a)


class LoraProduct(torch.autograd.Function):
    """``y = r + x W^T + s (x A^T) B^T`` with an optional residual ``r`` (the stream the layer adds
    its output to), in the order of the module's docstring. The residual is added last, in a pass
    of its own: folded into the update's product (the eighth session's order) it met the update
    before the base product did, and in bf16 a small update added to the large stream rounds away
    (the per-step losses lagged the HF loop's by up to 3.3%; bench/results/archive/h100_v10_loss_bisect.json).
    With ``in_kernel`` and a residual, the base product writes the output alone and update.py's
    kernel adds the update, then the stream. With ``value`` False only the backward is real: the
    output is a zero that owns no memory, and no product runs (layer.py's recomputation)."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None,
                value: bool = True, residual: torch.Tensor | None = None, in_kernel: bool = False,
                handoff: update.Handoff | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        width = sum(weights.out_features)
        r2 = residual.reshape(-1, width) if residual is not None else None
        xa = _adapter_input(x2, a, drop) if a is not None else None
        y = None
        if value and weights.bias is not None:
            y = _biased(weights, x2, xa, bt, scale, r2, in_kernel)
        elif value and xa is not None and in_kernel and r2 is not None:
            y = _update_then_residual(weights, x2, xa, bt, scale, r2)
        if y is None:
            if not value:
                y = x2.new_zeros(()).expand(x2.shape[0], width)
                if r2 is not None:
                    y = y + r2
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
        ctx.residual = residual is not None
        ctx.handoff = handoff if drop is None else None
        return y.view(*shape[:-1], width)

    @staticmethod
    def backward(ctx, dy):
        dx, da, dbt = _fused_backward(ctx, ctx.saved_tensors, dy.reshape(-1, dy.shape[-1]))
        dres = dy if ctx.residual else None  # the residual passes straight through
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None, dres, None, None


def _shaped(dx: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    return None if dx is None else dx.view(shape)


def _biased(weights: FrozenWeights, x2: torch.Tensor, xa: torch.Tensor | None, bt: torch.Tensor | None,
            scale: float, r2: torch.Tensor | None, in_kernel: bool) -> torch.Tensor:
    """``r2 + (x2 W^T + (bias + scale xa bt))`` for weights with a frozen bias: the bias is the base
    of the update's product, which writes the output, and the base product adds itself in its
    epilogue (the order of the module's docstring); the stream comes last (with the update, by
    update.py's kernel where it runs)."""
    if xa is not None and r2 is not None and in_kernel:
        y = _update_then_residual(weights, x2, xa, bt, scale, r2)
        if y is not None:
            return y
    if xa is None:
        y = weights.biased_product(x2)
    else:
        y = torch.addmm(weights.bias, xa, bt, alpha=scale)
        weights.forward_product(x2, into=y)
    if r2 is not None:
        y.add_(r2)
    return y


def _update_then_residual(weights: FrozenWeights, x2: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor,
                          scale: float, r2: torch.Tensor) -> torch.Tensor | None:
    """``r2 + (x2 W^T + scale xa bt)`` (the bias, where the weights have one, the base of their
    product) with the base product writing the output alone and one kernel adding the update,
    then the stream (engine/fast/update.py), where the update's product would write it first;
    None where the kernels cannot run here."""
    if update.broken():
        return None
    y = weights.biased_product(x2) if weights.bias is not None else weights.forward_product(x2)
    done, _ = update.KERNELS.attempt(lambda: update.add_update_and_residual_(y, xa, bt, scale, r2))
    return y if done else None


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
    columns = [cols for _, _, cols in ctx.weights.groups()]
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
    ``scale * (x A^T) B^T`` tile by tile (update.LoraGated). The backward takes the whole output's
    gradient, exactly as :class:`LoraProduct`'s does."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xa = _adapter_input(x2, a, drop)
        y = weights.biased_product(x2) if weights.bias is not None else weights.forward_product(x2)
        ctx.save_for_backward(x2, a, bt, xa)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.mark_non_differentiable(xa)
        return y.view(*shape[:-1], y.shape[-1]), xa

    @staticmethod
    def backward(ctx, dy, _dxa):
        dx, da, dbt = _fused_backward(ctx, ctx.saved_tensors, dy.reshape(-1, dy.shape[-1]))
        return _shaped(dx, ctx.shape), None, da, dbt, None, None


class SeparateLoraProduct(torch.autograd.Function):
    """:class:`LoraProduct` for projections whose outputs are read apart (q, k and v), one product
    a projection: each output is a tensor of its own, so what reads one (RoPE's kernel, the
    attention) gets it contiguous instead of copying a column block out of a fused output, and
    the backward takes their gradients as they come instead of concatenating them first."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xa = _adapter_input(x2, a, drop) if a is not None else None
        outs = []
        held = None
        for index, rows, cols in weights.groups():
            if index != held:  # a weight split in groups (Phi-3's qkv_proj) is dequantized once
                whole, held = weights.piece(index), index
            w = (whole if rows is None else whole[rows]).t()
            if weights.bias is not None and xa is not None:  # the bias the base of the update's product
                y = torch.addmm(weights.bias[cols], xa, bt[:, cols], alpha=scale)
                y.addmm_(x2, w)
            elif weights.bias is not None:
                y = torch.addmm(weights.bias[cols], x2, w)
            elif xa is not None:
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
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        blocks = [d.reshape(-1, d.shape[-1]) for d in dys]
        dx, da, dbt = _blocks_backward(ctx, ctx.saved_tensors, blocks)
        return _shaped(dx, ctx.shape), None, da, dbt, None, None


class KeptQKV(torch.autograd.Function):
    """The q/k/v product and RoPE of a recomputed layer whose rotated q, k and v were kept from
    its forward (engine/fast/offload.py brings them back from the host): the values are the kept
    ones, so the recomputation runs neither the product (a third of its products on a 7B model)
    nor RoPE, and the backward is theirs: RoPE's inverse rotation of the q and k gradients, then
    :class:`SeparateLoraProduct`'s backward. ``kept`` is the tuple ``(q, k, v)``,
    ``[B, T, heads, head_dim]``; ``unrotate(dq, dk, cos, sin)`` is RoPE's backward. With ``unrotate``
    None, ``kept`` are the product's outputs as they were (a layer with q/k norms between the
    product and RoPE, or no RoPE: it runs those again on them) and the backward is the product's."""

    @staticmethod
    def forward(ctx, x, weights: FrozenWeights, a, bt, scale: float, drop: AdapterDropout | None,
                kept: tuple, cos, sin, unrotate):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if a is not None:
            ctx.save_for_backward(x2, a, bt, _adapter_input(x2, a, drop))  # B's gradient reads x A^T
        else:
            ctx.save_for_backward(x2)
        ctx.weights, ctx.scale, ctx.shape, ctx.drop = weights, scale, shape, drop
        ctx.cos, ctx.sin, ctx.unrotate = cos, sin, unrotate
        return kept

    @staticmethod
    def backward(ctx, dq, dk, dv):
        if ctx.unrotate is not None:
            dq, dk = ctx.unrotate(dq, dk, ctx.cos, ctx.sin)
        blocks = [d.reshape(-1, d.shape[-2] * d.shape[-1]) for d in (dq, dk, dv)]
        dx, da, dbt = _blocks_backward(ctx, ctx.saved_tensors, blocks)
        return _shaped(dx, ctx.shape), None, da, dbt, None, None, None, None, None, None
