"""One decoder layer as one function: norms, fused projections, RoPE, attention inside each example
of a flat token stream, the gated MLP or a mixture of experts (engine/fast/moe.py). One
implementation for every family core/decoder/ describes: what a family does beyond a Llama layer
is a field here (engine/fast/build.py fills them in from the description and the loaded modules),
and each is a branch taken only where a field says so; a Llama layer's fields are the defaults, and
it runs the operations it always ran, in their order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from studio.engine.fast import norm
from studio.engine.fast.attention import LLAMA, Segments, Span, attend
from studio.engine.fast.moe import ExpertProjection, SparseMlp
from studio.engine.fast.ops import (
    rms_norm_scaled_torch,
    rms_norm_torch,
    rope_partial_torch,
    rope_torch,
    unrotate_liger,
    unrotate_torch,
)
from studio.engine.fast.projection import Projection
from studio.engine.fast.routing import KeptRouting

__all__ = ["LLAMA_NORM", "Keep", "Kept", "Layer", "NormKind", "Segments"]


@dataclass(frozen=True)
class NormKind:
    """How the model's RMSNorms compute (core/decoder's NormSpec, less the eps each module holds)."""

    offset: float = 0.0
    """Added to the weight before it scales (Gemma: 1.0)."""
    scaled: bool = False
    """The weight scales the fp32 value before the cast (Gemma, OLMo 2; liger's "gemma" mode);
    False: the normalised value is cast first, then scaled (Llama; liger's "llama" mode)."""


LLAMA_NORM = NormKind()


class Keep(Protocol):
    """Where a forward whose layer is recomputed later hands what that recomputation can take back
    instead of computing it again (engine/fast/offload.py's ``LayerKeep``: into host memory)."""

    def qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q, k and v as soon as they exist (:attr:`Layer.keeps_rotated` says which form)."""

    def attention(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The fused attention's output and log-sum-exp (engine/fast/fused_attention.py: the other
        attentions hand nothing)."""


@dataclass(frozen=True)
class Kept:
    """What a forward kept (:class:`Keep`), given back to its layer's recomputation; None: not kept."""

    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """q, k and v: the recomputation runs no q/k/v product (:meth:`Projection.from_kept`)."""
    attention: tuple[torch.Tensor, torch.Tensor] | None = None
    """The fused attention's output and log-sum-exp: the recomputation runs no attention forward,
    and the attention's backward reads them (FusedAttention's ``kept``)."""


@dataclass
class Layer:
    """One decoder layer's fused projections, norm weights and shape, run by :meth:`forward`.

    The fields after ``norm_with_stream`` say what the layer does beyond a Llama layer; their
    defaults are a Llama layer's."""

    qkv: Projection
    o: Projection
    gate_up: Projection | ExpertProjection
    """The gated MLP's gate/up, or a sparse layer's experts' (:attr:`moe`)."""
    down: Projection | ExpertProjection
    ln1: torch.Tensor | None
    """The norm before attention (``attn_in``); None: the stream goes in as it is (OLMo 2)."""
    ln2: torch.Tensor | None
    """The norm before the MLP (``mlp_in``; Llama's post_attention_layernorm); None: none."""
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    liger: dict | None = field(default=None, repr=False)
    """liger-kernel's kernels by name (ops.liger_kernels), or None: torch's operations."""
    varlen: tuple | None = field(default=None, repr=False)
    """Flash-attention's varlen entry point (ops.Varlen), or None: SDPA."""
    norm_with_stream: bool = False
    """The norms before q/k/v and gate/up run as :class:`~studio.engine.fast.norm.NormBranch`: their
    backward adds the residual stream's gradient of the same input in the same pass (:meth:`branch`).
    Llama's norm kind only (the kernel computes its casting)."""
    norm_kind: NormKind = LLAMA_NORM
    """How every norm of the layer computes."""
    attn_out: torch.Tensor | None = None
    """The norm on the attention's output before the residual add (Gemma 2/3, OLMo 2)."""
    mlp_out: torch.Tensor | None = None
    """The norm on the MLP's output before the residual add (Gemma 2/3, OLMo 2)."""
    qk_norm: str = "none"
    """q/k norms before RoPE: ``head`` (over head_dim: Qwen3, Gemma 3) or ``projection`` (over the
    whole projection: OLMo 2); ``none``."""
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    rope: bool = True
    """The layer rotates q and k (False: SmolLM3's no-RoPE layers)."""
    partial: bool = False
    """Only the first values of each head rotate (cos' width; Phi-4-mini)."""
    table: int | None = None
    """Which RoPE table of the stack's (stacked along a first dimension, one per layer type: Gemma 3)
    this layer reads; None: the stack has one table, not stacked."""
    span: Span = LLAMA
    """The attention's scale, window and soft-cap."""
    sinks: torch.Tensor | None = None
    """The attention heads' sink logits ``[heads]`` (frozen: gpt-oss' ``self_attn.sinks``); None: no sinks."""
    fused_attention: bool = False
    """Soft-capped scores and sinks run Studio's fused Triton attention
    (:mod:`~studio.engine.fast.fused_attention`) where it can; False: always the eager one."""
    activation: str = "silu"
    """The gated MLP's activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU)."""
    residual_scale: float = 1.0
    """Each branch's output is multiplied by this before the residual add (Granite)."""
    moe: SparseMlp | None = None
    """The layer's MLP is this mixture of experts (its gate_up and down are the experts'); None: dense."""

    def norm(self, x: torch.Tensor, w: torch.Tensor, eps: float | None = None, in_place: bool = True) -> torch.Tensor:
        """RMSNorm of ``x`` with weight ``w`` (liger's kernel where it is on). ``in_place``: liger's
        backward overwrites the incoming gradient with the result (right where nothing else reads
        that gradient: not for a norm on a branch's output, whose gradient is the stream's too)."""
        eps = self.eps if eps is None else eps
        kind = self.norm_kind
        if kind.scaled or kind.offset:
            if self.liger:
                return self.liger["rms_norm"].apply(x, w, eps, kind.offset, "gemma" if kind.scaled else "llama",
                                                    in_place)
            if kind.scaled:
                return rms_norm_scaled_torch(x, w, eps, kind.offset)
            return rms_norm_torch(x, w.float() + kind.offset, eps)
        if self.liger:
            return self.liger["rms_norm"].apply(x, w, eps, 0.0, "llama", in_place)
        return rms_norm_torch(x, w, eps)

    def branch(self, h: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed ``h`` and ``h`` to carry on as the residual stream: through
        :class:`~studio.engine.fast.norm.NormBranch` where it can run (one backward pass for both of
        ``h``'s gradients), else the norm and ``h`` as they are (autograd sums the gradients);
        ``h`` itself for both without a norm (``w`` None)."""
        if w is None:
            return h, h
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

    @property
    def keeps_rotated(self) -> bool:
        """What a forward keeps for its recomputation (:meth:`forward`'s ``keep``) is q and k after
        RoPE, which the recomputation's backward turns back (products.KeptQKV): a layer whose RoPE
        comes right after the product. With q/k norms between the two, or no RoPE, it is the
        product's outputs, and the recomputation runs the norms and RoPE again under autograd."""
        return self.rope and self.qk_norm == "none"

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, adapters: tuple,
                recompute: bool = False, keep: Keep | None = None, kept: Kept | None = None,
                routing: KeptRouting | None = None):
        """The layer's output, from its adapters as :meth:`adapters` builds them; with ``recompute``
        (a checkpointed layer rebuilt for its backward) the pair ``(h, down)`` whose sum the output
        is, where (unless the MLP's output is normed or scaled first) ``down`` only carries the
        backward: nothing in the layer reads its last product's value, so the recomputation skips
        that product (the down projection, 7% of a 7B step's products). The caller sends the
        output's gradient into both. A sparse layer's block skips down's product and the combine
        in any recomputation (torch's checkpointing's too) where nothing else reads its value.

        ``keep``: a forward whose layer is recomputed later hands it q, k and v, and the fused
        attention's output and log-sum-exp (engine/fast/offload.py). ``kept``: what it kept, given
        back to the recomputation, which then runs no q/k/v product (:meth:`Projection.from_kept`)
        and no attention forward. ``routing``: where a sparse layer's checkpointed forward keeps its
        routing for the recomputation, which then sorts nothing
        (:class:`~studio.engine.fast.routing.KeptRouting`)."""
        b, t, _ = h.shape
        qkv_ad, o_ad, gu_ad, down_ad = adapters
        if self.table is not None:
            cos, sin = cos[self.table], sin[self.table]
        x, h = self.branch(h, self.ln1)
        q, k, v = self.queries(x, cos, sin, qkv_ad, keep.qkv if keep is not None else None,
                               kept.qkv if kept is not None else None)
        attn = self.attention(q, k, v, seg, keep.attention if keep is not None else None,
                              kept.attention if kept is not None else None)
        attn = attn.reshape(b, t, self.heads * self.head_dim)
        if self._fused_residual(self.attn_out):
            h = self.o(attn, o_ad, residual=h)
        else:
            h = h + self._branch_output(self.o(attn, o_ad), self.attn_out)
        x, h = self.branch(h, self.ln2)
        if self.moe is not None:
            read = not self._fused_residual(self.mlp_out)  # a recomputation's value then matters
            out = self._branch_output(self.moe(x, gu_ad, down_ad, routing, read), self.mlp_out)
            return (h, out) if recompute else h + out
        # The update added inside the activation's kernel where it can be (engine/fast/update.py:
        # SwiGLU and GeGLU), and down's LoRA input-gradient term handed to that kernel's backward.
        handoff = self.down.handoff()
        act = self.gate_up.gated(x, gu_ad, handoff, self.activation)
        if act is None:  # the product, then an activation of its own; down's backward keeps its term
            handoff = None
            act = self.gated(self.gate_up(x, gu_ad))
        if self._fused_residual(self.mlp_out):
            if recompute:
                return h, self.down(act, down_ad, value=False, handoff=handoff)
            return self.down(act, down_ad, residual=h, handoff=handoff)
        out = self._branch_output(self.down(act, down_ad, handoff=handoff), self.mlp_out)
        return (h, out) if recompute else h + out

    def _fused_residual(self, post: torch.Tensor | None) -> bool:
        """Whether a branch's last product adds the residual stream in its epilogue: where nothing
        (a norm, a multiplier) comes between the product and the add."""
        return post is None and self.residual_scale == 1.0

    def _branch_output(self, y: torch.Tensor, post: torch.Tensor | None) -> torch.Tensor:
        """A branch's output as the residual stream adds it: normed (``post``), then scaled."""
        if post is not None:
            y = self.norm(y, post, in_place=False)
        if self.residual_scale != 1.0:
            y = y * self.residual_scale
        return y

    def gated(self, gu: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of gate/up's output (gate's columns first)."""
        if self.activation == "silu":
            if self.liger:
                # liger returns the gradient flat: give it a flat input so the shapes agree.
                return self.liger["swiglu"].apply(gu.view(-1, gu.shape[-1]), True).view(*gu.shape[:-1], -1)
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up
        gate, up = gu.chunk(2, dim=-1)
        if self.liger and "geglu" in self.liger:
            return self.liger["geglu"].apply(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv_ad, keep, kept) -> tuple:
        """q, k and v ``[B, T, heads, head_dim]`` of the normed layer input ``x``, q and k normed
        and rotated as the layer does; ``keep`` (:meth:`Keep.qkv`) and ``kept`` (:attr:`Kept.qkv`)
        as :meth:`forward` takes them."""
        if self.keeps_rotated:
            if kept is not None:
                return self.qkv.from_kept(x, kept, cos, sin, self.unrotate(), qkv_ad)
            q, k, v = self.qkv_rotated(x, cos, sin, qkv_ad)
            if keep is not None:
                keep(q, k, v)
            return q, k, v
        if kept is not None:
            q, k, v = self.qkv.from_kept(x, kept, None, None, None, qkv_ad)
        else:
            q, k, v = self.heads_of(x, qkv_ad)
            if keep is not None:
                keep(q, k, v)
        if self.qk_norm == "head":
            q, k = self.norm(q, self.q_norm, self.qk_eps), self.norm(k, self.k_norm, self.qk_eps)
        elif self.qk_norm == "projection":  # over all heads together, before the split into heads
            b, t = q.shape[:2]
            q = self.norm(q.reshape(b, t, -1), self.q_norm, self.qk_eps).view(q.shape)
            k = self.norm(k.reshape(b, t, -1), self.k_norm, self.qk_eps).view(k.shape)
        if self.rope:
            q, k = self.rotate(q, k, cos, sin)
        return q, k, v

    def heads_of(self, x: torch.Tensor, qkv_ad) -> tuple:
        """The q/k/v product's three outputs (``[B, T, heads, head_dim]``, contiguous each)."""
        b, t, _ = x.shape
        q, k, v = self.qkv.separately(x, qkv_ad)  # three contiguous outputs
        return (q.view(b, t, self.heads, self.head_dim), k.view(b, t, self.kv_heads, self.head_dim),
                v.view(b, t, self.kv_heads, self.head_dim))

    def qkv_rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv_ad) -> tuple:
        """q, k and v ``[B, T, heads, head_dim]`` of the normed layer input ``x``, q and k rotated."""
        q, k, v = self.heads_of(x, qkv_ad)
        q, k = self.rotate(q, k, cos, sin)
        return q, k, v

    def _liger_rope(self) -> bool:
        return bool(self.liger) and (not self.partial or self.liger.get("partial_rope", False))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """RoPE of q and k (``[B, T, heads, head_dim]``): liger's kernel where it is on (in place)."""
        if self._liger_rope():
            # liger's RoPE takes [B, H, T, D]; its kernel works on the [B, T, H, D] memory layout.
            qt, kt = self.liger["rope"].apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return qt.transpose(1, 2), kt.transpose(1, 2)
        if self.partial:
            return rope_partial_torch(q, k, cos, sin)
        return rope_torch(q, k, cos, sin)

    def unrotate(self):
        """RoPE's backward as :class:`~studio.engine.fast.products.KeptQKV` calls it."""
        if self._liger_rope():
            return unrotate_liger(self.liger["rope_backward"])
        return unrotate_torch

    def attention(self, q, k, v, seg: Segments, keep=None, kept: tuple | None = None) -> torch.Tensor:
        """Causal attention inside each example, as :attr:`span` says; returns [B, T, H, D].
        ``keep`` (:meth:`Keep.attention`) and ``kept`` (:attr:`Kept.attention`) as :meth:`forward`
        takes them."""
        return attend(q, k, v, seg, self.varlen, self.span, self.sinks, self.fused_attention, keep, kept)
