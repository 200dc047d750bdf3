"""The small kernels of the fast path: RMSNorm and RoPE in plain torch, and where liger-kernel's
Triton versions (and torch's flash-attention varlen entry point) come from when the machine has them."""

from __future__ import annotations

import inspect

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
    return {"rms_norm": LigerRMSNormFunction, "rope": LigerRopeFunction, "rope_backward": rope_backward,
            "swiglu": LigerFusedGateUpSiLUMulFunction, "flce": LigerFusedLinearCrossEntropyFunction}


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm: statistics in fp32, scale in x's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q, k: [B, T, H, D]; cos, sin: [B, T, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half_back(g: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_rotate_half` (its inverse too): what its backward does to a gradient."""
    half = g.shape[-1] // 2
    return torch.cat((g[..., half:], -g[..., :half]), dim=-1)


def unrotate_torch(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """:func:`rope_torch`'s backward: the gradients of q and k before the rotation, from theirs after."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return dq * cos + _rotate_half_back(dq * sin), dk * cos + _rotate_half_back(dk * sin)


def unrotate_liger(rope_backward):
    """liger's RoPE backward on q/k gradients laid out [B, T, H, D] (it takes [B, H, T, D] views of
    that memory, like its forward; the gradients are rotated in place where contiguous)."""
    def unrotate(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        dqt, dkt = rope_backward(dq.transpose(1, 2), dk.transpose(1, 2), cos, sin)
        return dqt.transpose(1, 2), dkt.transpose(1, 2)
    return unrotate


def varlen_attention():
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
    return varlen_attn, causal, "enable_gqa" in params
