"""Causal attention inside each example of a flat token stream, as a decoder layer's description
asks for it: its scale, a sliding window, soft-capped scores, attention sinks.

- flash attention's varlen entry point on CUDA (:class:`~studio.engine.fast.ops.Varlen`): the scale
  and the window (``window_size=(W - 1, 0)``: a query sees itself and the W - 1 tokens before it)
  go to the kernel; rows without example boundaries get boundaries of their own when a window
  applies (the kernel's window is the only one on CUDA);
- SDPA elsewhere (the CPU, fp32 models): a block-diagonal causal mask, narrowed to the window;
- soft-capped scores (Gemma 2: ``tanh(s / cap) * cap`` before the mask) and attention sinks
  (gpt-oss: a learned logit per head that joins each query's softmax denominator and attends to
  nothing) have no kernel in torch or flash attention: on CUDA in half precision Studio's own
  Triton kernels compute them (:class:`~studio.engine.fast.fused_attention.FusedAttention`, flash
  attention's way, forward and backward); elsewhere (the CPU, fp32 models, ``kernels: false``, a
  kernel that fails to build) :class:`EagerAttention` computes them in plain torch, one key/value
  head and one block of queries at a time (their keys only: the earlier ones, within the window),
  and again in the backward, so that it keeps no ``tokens x tokens`` tensor between the two and its
  scores stay under :data:`~studio.core.memory.attention.EAGER_SCORES` values. An eager step knows where
  each example of the stream starts (:attr:`Segments.bounds`) and runs it example by example;
  inside a CUDA graph (no host sync) the mask comes from the boundaries on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from studio.core.memory.attention import EAGER_SCORES
from studio.engine.fast import fused_attention
from studio.engine.fast.fused_attention import FusedAttention
from studio.engine.fast.ops import Varlen


@dataclass
class Segments:
    """Where examples start in a flat token stream (attention stays inside each)."""

    cu: torch.Tensor | None = None
    """int32 [n+1] cumulative example lengths (varlen attention), or None for full causal rows."""
    max_len: int = 0
    mask: torch.Tensor | None = None
    """bool [1, 1, T, T] block-diagonal causal mask for the SDPA fallback."""
    bounds: tuple[tuple[int, int], ...] | None = None
    """Each example's first and past-last token in the stream, on the host (an eager step's): the
    attention in plain torch (:class:`EagerAttention`) then runs example by example."""


@dataclass(frozen=True)
class Span:
    """What a layer's attention does beyond Llama's: the description's scale, window and soft-cap."""

    scale: float | None = None
    """What q.k is multiplied by; None: 1 / sqrt(head_dim), every kernel's default."""
    window: int | None = None
    """A query sees itself and the ``window - 1`` tokens before it; None: every earlier token."""
    softcap: float | None = None
    """Scores become ``tanh(s / cap) * cap`` before the mask; None: not capped."""


LLAMA = Span()
"""A Llama layer's attention."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, varlen: Varlen | None,
           span: Span = LLAMA, sinks: torch.Tensor | None = None, fused: bool = False,
           keep: fused_attention.Keep | None = None, kept: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> torch.Tensor:
    """Causal attention inside each example of ``q``, ``k``, ``v`` (``[B, T, heads, head_dim]``,
    fewer key/value heads allowed), as ``span`` says, with ``sinks`` (``[heads]``, frozen) where
    the layer has them; returns ``[B, T, heads, head_dim]``. ``fused``: soft-capped scores and
    sinks go through :class:`~studio.engine.fast.fused_attention.FusedAttention` where it can run
    (else, and without it, :class:`EagerAttention`). ``keep`` and ``kept``: the fused attention's
    output and log-sum-exp, handed out by a forward and given back to its recomputation
    (FusedAttention's); no other attention keeps anything (``keep`` is then not called)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    t = q.shape[1]
    window = span.window if span.window is not None and span.window < t else None  # else it hides nothing
    if span.softcap is not None or sinks is not None:
        scale = span.scale if span.scale is not None else q.shape[-1] ** -0.5
        sinks = sinks.detach().float().contiguous() if sinks is not None else None
        eager = partial(_eager_gradients, seg, scale, span.softcap, sinks, window)
        if kept is not None:  # the forward ran the fused kernel on this layout: nothing to compute
            return FusedAttention.apply(q, k, v, _stream(seg, q)[1], scale, span.softcap, sinks, window, eager,
                                        None, kept)
        if fused and fused_attention.available(q.device, q.dtype, q.shape[-1]):
            streamed, cu = _stream(seg, q)
            if streamed:
                done, out = fused_attention.KERNELS.attempt(lambda: FusedAttention.apply(
                    q, k, v, cu, scale, span.softcap, sinks, window, eager, keep))
                if done:
                    return out
        return _eager(q, k, v, seg, scale, span.softcap, sinks, window)
    if varlen is not None and (seg.cu is not None or window is not None) and (window is None or varlen.window):
        return _varlen(q, k, v, seg, varlen, span.scale, window)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kv_heads != heads:
        rep = heads // kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    extra = {} if span.scale is None else {"scale": span.scale}
    if window is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_keep(seg, t, q.device, window), **extra)
    elif seg.mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, **extra)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    return out.transpose(1, 2)


def _stream(seg: Segments, q: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """Whether the fused attention can take ``seg``'s layout, and the example boundaries it takes:
    a one-row stream's ``cu`` (the device's, or made from the host's bounds), None for rows that
    are one example each; not a mask alone."""
    if seg.cu is not None:
        return q.shape[0] == 1, seg.cu
    if seg.bounds is not None and len(seg.bounds) > 1:
        if q.shape[0] != 1:
            return False, None
        starts = [a for a, _ in seg.bounds] + [seg.bounds[-1][1]]
        return True, torch.tensor(starts, dtype=torch.int32, device=q.device)
    return seg.mask is None or seg.bounds is not None, None


def _eager(q, k, v, seg: Segments, scale: float, cap: float | None, sinks: torch.Tensor | None,
           window: int | None) -> torch.Tensor:
    """:class:`EagerAttention` of the layout ``seg``: example by example where the host knows the
    bounds (a one-row stream of an eager step), else with the mask made from it."""
    if seg.bounds is not None and len(seg.bounds) > 1 and q.shape[0] == 1:
        return torch.cat([EagerAttention.apply(q[:, a:b], k[:, a:b], v[:, a:b],
                                               _keep(Segments(), b - a, q.device, window), scale, cap, sinks, window)
                          for a, b in seg.bounds], dim=1)
    return EagerAttention.apply(q, k, v, _keep(seg, q.shape[1], q.device, window), scale, cap, sinks, window)


def _eager_gradients(seg: Segments, scale: float, cap: float | None, sinks: torch.Tensor | None,
                     window: int | None, q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """:func:`_eager`'s gradients of q, k and v from the output's: the fused attention's backward
    where its kernels fail to build after its forward's did."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = _eager(*leaves, seg, scale, cap, sinks, window)
        return torch.autograd.grad(out, leaves, dout)


def _varlen(q, k, v, seg: Segments, varlen: Varlen, scale: float | None, window: int | None) -> torch.Tensor:
    b, t, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    cu, max_len = seg.cu, seg.max_len
    if cu is None:  # full rows, each an example: boundaries of their own, made on the device
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=q.device)
        max_len = t
    q, k, v = (x.reshape(b * t, x.shape[2], head_dim) for x in (q, k, v))
    kw = dict(varlen.causal)
    if window is not None:
        kw["window_size"] = (window - 1, 0)
    if scale is not None:
        if varlen.scale:
            kw["scale"] = scale
        else:  # the kernel's own scale is 1 / sqrt(head_dim): fold the rest into q
            q = q * (scale * head_dim ** 0.5)
    if kv_heads != heads:
        if varlen.gqa:
            kw["enable_gqa"] = True
        else:
            rep = heads // kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = varlen.fn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out.view(b, t, heads, head_dim)


def _keep(seg: Segments, t: int, device: torch.device, window: int | None) -> torch.Tensor:
    """bool ``[1, 1, T, T]``: which key each of ``t`` queries sees: the earlier tokens of its own
    example, within ``window`` when given."""
    pos = torch.arange(t, device=device)
    if seg.mask is not None:
        keep = seg.mask
    else:
        keep = pos[:, None] >= pos[None, :]
        if seg.cu is not None:
            # each token's example from the boundaries on the device (no host sync: graph-safe)
            example = torch.searchsorted(seg.cu[1:], pos.to(seg.cu.dtype), right=True)
            keep = keep & (example[:, None] == example[None, :])
        keep = keep[None, None]
    if window is not None:
        keep = keep & (pos[:, None] - pos[None, :] < window)
    return keep


class EagerAttention(torch.autograd.Function):
    """``softmax(mask(capped(q k^T s)) | sink) v``, one key/value head (and the query heads sharing
    it) and one block of queries at a time (:func:`_blocks`): the scores in fp32, soft-capped
    (``tanh(. / cap) * cap``) where ``cap`` is given, the head's sink logit (``sinks [heads]``, fp32,
    no gradient) a column of the softmax that attends to nothing, the weights rounded to v's dtype
    before their product (transformers' eager attention's order). The backward computes the scores
    again instead of keeping them; a sink leaves its form unchanged (its value row is zero).
    ``keep``: bool ``[B or 1, 1, T, T]``; ``window``: the one baked into it, or None."""

    @staticmethod
    def forward(ctx, q, k, v, keep, scale: float, cap: float | None, sinks: torch.Tensor | None,
                window: int | None = None):
        out = torch.empty_like(q)
        for g, qg, kg, vg in _groups(q, k, v):
            rep = qg.shape[1]
            for rows, cols in _blocks(qg, window):
                _, p = _weights(qg[:, :, rows], kg[:, :, cols], keep[..., rows, cols], scale, cap,
                                _sink_of(sinks, g, rep))
                out[:, rows, g * rep:(g + 1) * rep] = (p.to(vg.dtype) @ vg[:, :, cols]).transpose(1, 2)
        ctx.save_for_backward(q, k, v, keep, sinks)
        ctx.scale, ctx.cap, ctx.window = scale, cap, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, keep, sinks = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for g, qg, kg, vg in _groups(q, k, v):
            rep = qg.shape[1]
            for rows, cols in _blocks(qg, ctx.window):
                kc, vc = kg[:, :, cols], vg[:, :, cols]
                capped, p = _weights(qg[:, :, rows], kc, keep[..., rows, cols], ctx.scale, ctx.cap,
                                     _sink_of(sinks, g, rep))
                dog = dout[:, rows, g * rep:(g + 1) * rep].transpose(1, 2)  # [B, rep, rows, D]
                dv[:, cols, g] += (p.to(vg.dtype).transpose(-1, -2) @ dog).sum(1)
                dp = (dog @ vc.transpose(-1, -2)).float()
                ds = p * (dp - (dp * p).sum(-1, keepdim=True))
                if capped is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2; masked scores have p = 0
                    ds = ds * (1 - capped * capped)
                ds = (ds * ctx.scale).to(q.dtype)
                dq[:, rows, g * rep:(g + 1) * rep] = (ds @ kc).transpose(1, 2)
                dk[:, cols, g] += (ds.transpose(-1, -2) @ qg[:, :, rows]).sum(1)
        return dq, dk, dv, None, None, None, None, None


def _blocks(qg: torch.Tensor, window: int | None):
    """Blocks of queries whose scores against their keys (every earlier one, or those within
    ``window``) stay under :data:`EAGER_SCORES` values: each block's query rows and key columns."""
    b, rep, t, _ = qg.shape
    size = max(1, EAGER_SCORES // (b * rep * t))
    for start in range(0, t, size):
        end = min(t, start + size)
        first = max(0, start - window + 1) if window is not None else 0
        yield slice(start, end), slice(first, end)


def _groups(q, k, v):
    """Per key/value head ``g``: its query heads ``[B, rep, T, D]`` and its key and value ``[B, 1, T, D]``."""
    rep = q.shape[2] // k.shape[2]
    for g in range(k.shape[2]):
        yield (g, q[:, :, g * rep:(g + 1) * rep].transpose(1, 2), k[:, :, g:g + 1].transpose(1, 2),
               v[:, :, g:g + 1].transpose(1, 2))


def _sink_of(sinks: torch.Tensor | None, g: int, rep: int) -> torch.Tensor | None:
    """The sinks of key/value head ``g``'s query heads, shaped ``[1, rep, 1, 1]`` (None without sinks)."""
    return None if sinks is None else sinks[g * rep:(g + 1) * rep].view(1, rep, 1, 1)


def _weights(qg, kg, keep, scale: float, cap: float | None, sink: torch.Tensor | None):
    """``tanh(q k^T scale / cap)`` (None without a cap) and the attention weights (fp32) of one
    key/value head's queries over the keys, the sink's share of each softmax left out."""
    scores = (qg @ kg.transpose(-1, -2)).float() * scale
    capped = None
    if cap is not None:
        capped = torch.tanh(scores / cap)
        scores = capped * cap
    scores = scores.masked_fill_(~keep, float("-inf"))
    if sink is None:
        return capped, torch.softmax(scores, dim=-1)
    # the sink joins the denominator: softmax over [scores, sink], its own column dropped
    both = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return capped, torch.softmax(both, dim=-1)[..., :-1]
