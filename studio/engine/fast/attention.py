"""Causal attention that hands back what its backward needs, so a recomputation can skip it.

A checkpointed layer's recomputation runs the attention's forward again only for the backward's
sake: the flash-style backward reads q, k, v, the output and the softmax's log-sum-exp. When the
first forward keeps the output and the log-sum-exp (engine/fast/offload.py takes them to the host
with the layer's input and its q, k and v), the recomputation runs no attention at all: :class:`KeptAttention`
returns the kept output and its backward is the kernel's own backward on the kept tensors.

Off by default (core/plan.py's ``KEEP_ATTENTION_FROM``): on an H100 over PCIe 5 the host link is
already full with the inputs and q, k and v, and interleaved runs measured no gain at sequence 4096
(bench/results/h100_v15_ab_interleaved.json, docs/speed.md). It is for hosts with a faster link.

The kernel is the one ``scaled_dot_product_attention`` (rows of one example each) or torch's
varlen entry point (a flat stream of examples) would run: cuDNN's or flash-attention's on CUDA, the
flash kernel for the CPU elsewhere, called through their aten operators, which return the
log-sum-exp. A layout none of them covers (an explicit mask on CUDA, the math fallback) keeps
nothing and the layer recomputes its attention as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CUDNN, FLASH, CPU_FLASH, VARLEN = "cudnn", "flash", "cpu_flash", "varlen"


@dataclass
class Saved:
    """One attention call's output and log-sum-exp in the kernel's layout, and the small
    values its backward takes beside them (``extra``: sequence offsets, lengths, RNG state)."""

    kind: str
    out: torch.Tensor
    lse: torch.Tensor
    extra: tuple = field(default=())


def _sdpa_kind(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Which kernel ``scaled_dot_product_attention`` picks for these inputs, if this module can run
    it with its log-sum-exp."""
    from torch.nn.attention import SDPBackend

    try:
        choice = SDPBackend(torch._fused_sdp_choice(qt, kt, vt, mask, 0.0, mask is None))
    except Exception:  # noqa: BLE001 - an older torch without the query: keep nothing
        return None
    if qt.device.type == "cpu":
        return CPU_FLASH if choice == SDPBackend.FLASH_ATTENTION else None
    if mask is not None:
        return None
    if choice == SDPBackend.CUDNN_ATTENTION:
        return CUDNN
    if choice == SDPBackend.FLASH_ATTENTION:
        return FLASH
    return None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as the additive one SDPA turns it into."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sdpa_with_stats(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor,
                    mask: torch.Tensor | None = None) -> Saved | None:
    """Causal attention of ``[B, H, T, D]`` inputs (``mask``: a boolean ``[1, 1, T, T]`` mask that
    replaces the causal one) by the kernel SDPA would choose, with its log-sum-exp; None where that
    kernel is not one this module runs."""
    kind = _sdpa_kind(qt, kt, vt, mask)
    if kind == CUDNN:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = \
            torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, True, False)
        return Saved(kind, out, lse, (cum_q, cum_k, max_q, max_k, seed, offset))
    if kind == FLASH:
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = \
            torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False)
        return Saved(kind, out, lse, (cum_q, cum_k, max_q, max_k, rng, unused))
    if kind == CPU_FLASH:
        bias = None if mask is None else _additive(mask, qt.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, kt, vt, 0.0, mask is None, attn_mask=bias)
        return Saved(kind, out, lse, (bias,))
    return None


def varlen_with_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                      max_len: int) -> Saved | None:
    """Causal attention inside each example of a flat ``[T, H, D]`` stream (``cu``: the examples'
    offsets) by flash-attention's varlen kernel, as torch's ``varlen_attn`` runs it, with its
    log-sum-exp."""
    if not q.is_cuda or not hasattr(torch.ops.aten, "_flash_attention_backward"):
        return None
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, window_size_left=-1, window_size_right=0)
    return Saved(VARLEN, out, lse, (cu, max_len, rng, unused))


_BROKEN: list[str] = []
"""Why keeping the attention failed on this machine (an operator whose signature or support differs
in this torch): from then on every layer recomputes its attention as before."""


def broken() -> str:
    return _BROKEN[0] if _BROKEN else ""


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def with_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None, max_len: int,
               mask: torch.Tensor | None, varlen: bool) -> Saved | None:
    """The attention with what its backward needs (:func:`varlen_with_stats` for a flat stream,
    :func:`sdpa_with_stats` for rows), or None: not a kernel this module runs, or keeping failed
    here before (the caller then runs the attention as usual)."""
    if _BROKEN:
        return None
    try:
        return varlen_with_stats(q, k, v, cu, max_len) if varlen else sdpa_with_stats(q, k, v, mask)
    except Exception as exc:  # noqa: BLE001 - an operator this torch lacks: recompute as before
        if _capturing():
            raise  # a CUDA graph's capture fails and the step runs eagerly, where this lands again
        _BROKEN.append(f"{type(exc).__name__}: {exc}")
        return None


def backward(saved: Saved, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``(dq, dk, dv)`` of the call that produced ``saved`` from its output's gradient."""
    if saved.kind == CUDNN:
        cum_q, cum_k, max_q, max_k, seed, offset = saved.extra
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, saved.out, saved.lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True)
    if saved.kind == FLASH:
        cum_q, cum_k, max_q, max_k, rng, unused = saved.extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, saved.out, saved.lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused)
    if saved.kind == CPU_FLASH:
        (bias,) = saved.extra
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, saved.out, saved.lse, 0.0, bias is None, attn_mask=bias)
    if saved.kind == VARLEN:
        cu, max_len, rng, unused = saved.extra
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, saved.out, saved.lse, cu, cu, max_len, max_len, 0.0, True, rng, unused,
            window_size_left=-1, window_size_right=0)
    raise ValueError(f"unknown attention kernel {saved.kind!r}")


class KeptAttention(torch.autograd.Function):
    """The attention of a recomputed layer whose output and log-sum-exp were kept from its forward:
    the value is the kept output (no kernel runs), the backward is the kernel's backward on the
    kept tensors. ``q``, ``k`` and ``v`` are the kernel's inputs, laid out as that call had them.
    ``run(q, k, v)`` is the attention as the layer runs it without keeping anything: should the
    kernel's backward fail here (an operator of another torch), the backward recomputes through it
    and :func:`with_stats` keeps nothing from then on."""

    @staticmethod
    def forward(ctx, q, k, v, saved: Saved, run):
        ctx.save_for_backward(q, k, v)
        ctx.saved, ctx.run = saved, run
        return saved.out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        saved, run = ctx.saved, ctx.run
        ctx.saved = ctx.run = None
        try:
            dq, dk, dv = backward(saved, dout, q, k, v)
        except Exception as exc:  # noqa: BLE001 - see the class's note
            if _capturing():
                raise
            _BROKEN.append(f"{type(exc).__name__}: {exc}")
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            with torch.enable_grad():
                out = run(*leaves)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        return dq, dk, dv, None, None
