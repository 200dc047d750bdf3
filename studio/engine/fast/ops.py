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
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except Exception:  # noqa: BLE001 - any import failure (no triton, old version) means "not here"
        return None
    return {"rms_norm": LigerRMSNormFunction, "rope": LigerRopeFunction,
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
