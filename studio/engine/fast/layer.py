"""One Llama-style decoder layer as one function: norms, fused projections, RoPE, attention inside
each example of a flat token stream, SwiGLU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from studio.engine.fast import norm
from studio.engine.fast.ops import rms_norm_torch, rope_torch, unrotate_liger, unrotate_torch
from studio.engine.fast.projection import Projection


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
    liger: dict | None = field(default=None, repr=False)
    """liger-kernel's kernels by name (ops.liger_kernels), or None: torch's operations."""
    varlen: tuple | None = field(default=None, repr=False)
    """Flash-attention's varlen entry point (ops.varlen_attention), or None: SDPA."""
    norm_with_stream: bool = False
    """The norms before q/k/v and gate/up run as :class:`~studio.engine.fast.norm.NormBranch`: their
    backward adds the residual stream's gradient of the same input in the same pass (:meth:`branch`)."""

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` with weight ``w`` (liger's kernel where it is on)."""
        if self.liger:
            # in_place: the incoming gradient (used by nothing else) is overwritten with the result.
            return self.liger["rms_norm"].apply(x, w, self.eps, 0.0, "llama", True)
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
        """q/k/v, o, gate/up and down, in that order."""
        return self.qkv, self.o, self.gate_up, self.down

    def adapters(self, sink=None) -> tuple:
        """Each projection's adapters in fused form (see :meth:`Projection.adapters`)."""
        return tuple(p.adapters(sink) for p in (self.qkv, self.o, self.gate_up, self.down))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, adapters: tuple,
                recompute: bool = False, keep: Callable[..., None] | None = None, kept: tuple | None = None):
        """The layer's output, from its adapters as :meth:`adapters` builds them; with ``recompute``
        (a checkpointed layer rebuilt for its backward) the pair ``(h, down)`` whose sum the output
        is, where ``down`` only carries the backward: nothing in the layer reads its last product's
        value, so the recomputation skips that product (the down projection, 7% of a 7B step's
        products). The caller sends the output's gradient into both.

        ``keep(q, k, v)``: called with the rotated q, k and v as soon as they exist (a forward whose
        layer is recomputed later keeps them: engine/fast/offload.py). ``kept``: those three, given
        back to the recomputation, which then runs neither the q/k/v product nor RoPE
        (:meth:`Projection.from_kept`)."""
        b, t, _ = h.shape
        qkv_ad, o_ad, gu_ad, down_ad = adapters
        x, h = self.branch(h, self.ln1)
        if kept is not None:
            q, k, v = self.qkv.from_kept(x, kept, cos, sin, self.unrotate(), qkv_ad)
        else:
            q, k, v = self.qkv_rotated(x, cos, sin, qkv_ad)
            if keep is not None:
                keep(q, k, v)
        attn = self.attention(q, k, v, seg)
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
            if self.liger:
                # liger returns the gradient flat: give it a flat input so the shapes agree.
                act = self.liger["swiglu"].apply(gu.view(-1, gu.shape[-1]), True).view(*gu.shape[:-1], -1)
            else:
                gate, up = gu.chunk(2, dim=-1)
                act = F.silu(gate) * up
        if recompute:
            return h, self.down(act, down_ad, value=False, handoff=handoff)
        return self.down(act, down_ad, residual=h, handoff=handoff)

    def qkv_rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv_ad) -> tuple:
        """q, k and v ``[B, T, heads, head_dim]`` of the normed layer input ``x``, q and k rotated."""
        b, t, _ = x.shape
        q, k, v = self.qkv.separately(x, qkv_ad)  # three contiguous outputs
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.liger:
            # liger's RoPE takes [B, H, T, D]; its kernel works on the [B, T, H, D] memory layout.
            qt, kt = self.liger["rope"].apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = qt.transpose(1, 2), kt.transpose(1, 2)
        else:
            q, k = rope_torch(q, k, cos, sin)
        return q, k, v

    def unrotate(self):
        """RoPE's backward as :class:`~studio.engine.fast.products.KeptQKV` calls it."""
        if self.liger:
            return unrotate_liger(self.liger["rope_backward"])
        return unrotate_torch

    def attention(self, q, k, v, seg: Segments) -> torch.Tensor:
        """Causal attention inside each example; returns [B, T, H, D]."""
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
            out = fn(q[0], k[0], v[0], seg.cu, seg.cu, seg.max_len, seg.max_len, **kw)
            return out.unsqueeze(0)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if seg.mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2)
