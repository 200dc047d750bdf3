"""One Llama-style decoder layer as one function: norms, fused projections, RoPE, attention inside
each example of a flat token stream, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from studio.engine.fast import norm
from studio.engine.fast.attention import KeptAttention, Saved, with_stats
from studio.engine.fast.ops import rms_norm_torch, rope_torch, unrotate_liger, unrotate_torch
from studio.engine.fast.weights import Projection


@dataclass
class Segments:
    """Where examples start in a flat token stream (attention stays inside each)."""

    cu: torch.Tensor | None = None
    """int32 [n+1] cumulative example lengths (varlen attention), or None for full causal rows."""
    max_len: int = 0
    mask: torch.Tensor | None = None
    """bool [1, 1, T, T] block-diagonal causal mask for the SDPA fallback."""


@dataclass
class Layer:
    """One decoder layer's fused projections, norm weights and shape, run by :meth:`forward`."""

    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    kernels: dict | None = field(default=None, repr=False)
    varlen: tuple | None = field(default=None, repr=False)
    skip_last: bool = True
    """A recomputation for the backward skips the last product's value (:meth:`forward`)."""
    norm_with_stream: bool = False
    """The norms before q/k/v and gate/up run as :class:`~studio.engine.fast.norm.NormBranch`: their
    backward adds the residual stream's gradient of the same input in the same pass (:meth:`branch`)."""

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            # in_place: the incoming gradient (used by nothing else) is overwritten with the result.
            return self.kernels["rms_norm"].apply(x, w, self.eps, 0.0, "llama", True)
        return rms_norm_torch(x, w, self.eps)

    def branch(self, h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed ``h`` and ``h`` to carry on as the residual stream: through
        :class:`~studio.engine.fast.norm.NormBranch` where it can run (one backward pass for both of
        ``h``'s gradients), else the norm and ``h`` as they are (autograd sums the gradients)."""
        if self.norm_with_stream:
            done, both = norm.KERNELS.attempt(lambda: norm.NormBranch.apply(h, w, self.eps))
            if done:
                return both
        return self.norm(h, w), h

    def projections(self) -> tuple[Projection, Projection, Projection, Projection]:
        return self.qkv, self.o, self.gate_up, self.down

    def adapters(self, sink=None) -> tuple:
        """Each projection's adapters in fused form (see :meth:`Projection.adapters`)."""
        return tuple(p.adapters(sink) for p in (self.qkv, self.o, self.gate_up, self.down))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
                adapters: tuple | None = None, recompute: bool = False, keep=None, kept: tuple | None = None,
                kept_attention: Saved | None = None):
        """The layer's output; with ``recompute`` (a checkpointed layer rebuilt for its backward)
        the pair ``(h, down)`` whose sum the output is, where ``down`` only carries the backward:
        nothing in the layer reads its last product's value, so the recomputation skips that
        product (the down projection, 7% of a 7B step's products). The caller sends the output's
        gradient into both.

        ``keep(q, k, v)``: called with the rotated q, k and v as soon as they exist (a forward whose
        layer is recomputed later keeps them: engine/fast/offload.py). ``kept``: those three, given
        back to the recomputation, which then runs neither the q/k/v product nor RoPE
        (:meth:`Projection.from_kept`). A ``keep`` with an ``attention`` method is also handed the
        attention's output and log-sum-exp (engine/fast/attention.py's ``Saved``), and
        ``kept_attention`` gives them back: the recomputation then runs no attention."""
        b, t, _ = h.shape
        qkv_ad, o_ad, gu_ad, down_ad = adapters if adapters is not None else (None,) * 4
        x, h = self.branch(h, self.ln1)
        if kept is not None:
            q, k, v = self.qkv.from_kept(x, kept, cos, sin, self.unrotate(), qkv_ad)
        else:
            q, k, v = self.qkv_rotated(x, cos, sin, qkv_ad)
            if keep is not None:
                keep(q, k, v)
        attn = self.attention(q, k, v, seg, getattr(keep, "attention", None), kept_attention)
        attn = attn.reshape(b, t, self.heads * self.head_dim)
        h = self.o(attn, o_ad, residual=h)
        x, h = self.branch(h, self.ln2)
        # The update added inside SwiGLU's kernel where it can be (engine/fast/update.py), and down's
        # LoRA input-gradient term handed to SwiGLU's backward.
        handoff = self.down.handoff()
        act = self.gate_up.swiglu(x, gu_ad, handoff)
        if act is None:  # the product, then a SwiGLU of its own; down's backward keeps its term
            handoff = None
            gu = self.gate_up(x, gu_ad)
            if self.kernels:
                # liger returns the gradient flat: give it a flat input so the shapes agree.
                act = self.kernels["swiglu"].apply(gu.view(-1, gu.shape[-1]), True).view(*gu.shape[:-1], -1)
            else:
                gate, up = gu.chunk(2, dim=-1)
                act = F.silu(gate) * up
        if recompute:
            return h, self.down(act, down_ad, value=False, handoff=handoff)
        return self.down(act, down_ad, residual=h, handoff=handoff)

    def qkv_rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv_ad) -> tuple:
        """q, k and v ``[B, T, heads, head_dim]`` of the normed layer input ``x``, q and k rotated."""
        b, t, _ = x.shape
        if self.qkv.separated:
            q, k, v = self.qkv(x, qkv_ad)  # three contiguous outputs
        else:
            qkv = self.qkv(x, qkv_ad)
            q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                 self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.kernels:
            # liger's RoPE takes [B, H, T, D]; its kernel works on the [B, T, H, D] memory layout.
            qt, kt = self.kernels["rope"].apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = qt.transpose(1, 2), kt.transpose(1, 2)
        else:
            q, k = rope_torch(q, k, cos, sin)
        return q, k, v

    def unrotate(self):
        """RoPE's backward as :class:`~studio.engine.fast.weights.KeptQKV` calls it."""
        if self.kernels:
            return unrotate_liger(self.kernels["rope_backward"])
        return unrotate_torch

    def attention(self, q, k, v, seg: Segments, keep=None, kept: Saved | None = None) -> torch.Tensor:
        """Causal attention inside each example; returns [B, T, H, D]. ``keep(saved)``: handed the
        output and log-sum-exp where the kernel gives them (engine/fast/attention.py); ``kept``:
        those of this layer's forward, whose output is returned without running the kernel."""
        varlen = seg.cu is not None and self.varlen is not None
        if varlen:
            fn, causal, gqa = self.varlen
            kw = dict(causal)
            if self.kv_heads != self.heads:
                if gqa:
                    kw["enable_gqa"] = True
                else:
                    rep = self.heads // self.kv_heads
                    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            q, k, v = q[0], k[0], v[0]
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.kv_heads != self.heads:
                rep = self.heads // self.kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

        def run(q, k, v):
            if varlen:
                return fn(q, k, v, seg.cu, seg.cu, seg.max_len, seg.max_len, **kw)
            if seg.mask is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = None
        if kept is not None:
            out = KeptAttention.apply(q, k, v, kept, run)
        elif keep is not None:
            saved = with_stats(q, k, v, seg.cu, seg.max_len, seg.mask, varlen)
            if saved is not None:
                keep(saved)
                out = saved.out
        if out is None:
            out = run(q, k, v)
        return out.unsqueeze(0) if varlen else out.transpose(1, 2)


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril_()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]
