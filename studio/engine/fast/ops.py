"""The small kernels of the fast path: RMSNorm and RoPE in plain torch, and where liger-kernel's
Triton versions (and torch's flash-attention varlen entry point) come from when the machine has them."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch


def liger_kernels():
    """liger-kernel's autograd functions, or None when it (or a CUDA device for it) is missing."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction, rope_backward
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except Exception:  # noqa: BLE001 - any import failure (no triton, old version) means "not here"
        return None
    kernels: dict[str, Any] = {
        "rms_norm": LigerRMSNormFunction, "rope": LigerRopeFunction, "rope_backward": rope_backward,
        "swiglu": LigerFusedGateUpSiLUMulFunction, "flce": LigerFusedLinearCrossEntropyFunction}
    # Partial rotary (Phi-4-mini rotates 96 of 128): liger reads the rotated width off cos from the
    # releases whose RoPE takes ``rotary_dim`` (0.8.5); older ones rotate the whole head.
    kernels["partial_rope"] = "rotary_dim" in inspect.signature(rope_backward).parameters
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction  # the Gemma family's tanh-GELU gate

        kernels["geglu"] = LigerGELUMulFunction
    except Exception:  # noqa: BLE001 - a release without it: torch's GELU and product instead
        pass
    return kernels


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm: statistics in fp32, scale in x's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def rms_norm_scaled_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm whose weight (plus ``offset``) scales the fp32 value before the cast: transformers'
    Gemma (``x * (1 + w)``, offset 1) and OLMo 2 (``w * x``, offset 0) RMSNorms; liger's "gemma" mode."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q, k: [B, T, H, D]; cos, sin: [B, T, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_partial_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`rope_torch` on the first ``cos.shape[-1]`` values of each head, the rest passed through
    (transformers' Phi-3 with a ``partial_rotary_factor``)."""
    rd = cos.shape[-1]
    q_rot, k_rot = rope_torch(q[..., :rd], k[..., :rd], cos, sin)
    return torch.cat((q_rot, q[..., rd:]), dim=-1), torch.cat((k_rot, k[..., rd:]), dim=-1)


def _rotate_half_back(g: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_rotate_half` (its inverse too): what its backward does to a gradient."""
    half = g.shape[-1] // 2
    return torch.cat((g[..., half:], -g[..., :half]), dim=-1)


def unrotate_torch(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`rope_torch`'s backward: the gradients of q and k before the rotation, from theirs after."""
    rd = cos.shape[-1]
    if rd < dq.shape[-1]:  # partial rotary: the passed-through values' gradients pass through too
        uq, uk = unrotate_torch(dq[..., :rd], dk[..., :rd], cos, sin)
        return torch.cat((uq, dq[..., rd:]), dim=-1), torch.cat((uk, dk[..., rd:]), dim=-1)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return dq * cos + _rotate_half_back(dq * sin), dk * cos + _rotate_half_back(dk * sin)


def unrotate_liger(rope_backward):
    """liger's RoPE backward on q/k gradients laid out [B, T, H, D] (it takes [B, H, T, D] views of
    that memory, like its forward; the gradients are rotated in place where contiguous)."""
    def unrotate(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        dqt, dkt = rope_backward(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin)
        return dqt.transpose(1, 2), dkt.transpose(1, 2)
    return unrotate


class Varlen(NamedTuple):
    """torch's flash-attention varlen entry point and what this torch's version of it takes."""

    fn: Any
    """``torch.nn.attention.varlen.varlen_attn``."""
    causal: dict
    """The keywords that make it causal (``window_size=(-1, 0)`` or ``is_causal=True``)."""
    gqa: bool
    """It takes ``enable_gqa`` (fewer key/value heads than query heads, without repeating them)."""
    scale: bool
    """It takes ``scale`` (else queries are pre-scaled for an attention scale of its own)."""
    window: bool
    """It takes ``window_size``: sliding-window layers run through it too."""


def varlen_attention() -> Varlen | None:
    """torch's flash-attention varlen entry point and how it spells "causal", or None."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return Varlen(varlen_attn, causal, "enable_gqa" in params, "scale" in params, "window_size" in params)
