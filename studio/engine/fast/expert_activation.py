"""The experts' gated activation times each row's routing weight, in one kernel a pass.

A sparse layer (engine/fast/moe.py) computes, for every sorted row of gate/up's output, the gated
activation (SiLU, or gpt-oss' clamped SwiGLU on gate and up interleaved) times the routing weight
of the token copy the row is. In torch's operations that is three elementwise passes over the rows
forward (the activation, its product with up, the weight) and seven backward, each writing a
``rows x width`` tensor (on Qwen3-30B-A3B at 2,048 tokens, 16,384 rows of 768: about 0.1 ms
forward, twice a step with the recomputation, and 0.19 ms backward on an H200, the 23rd session's
profile). Here
:class:`RoutedActivation` reads gate/up once and writes the output once; its backward reads gate/up
and the output's gradient once, writes the gradients of gate and up over gate/up's output (which
nothing else reads) and each row's weight gradient, the row's sum, from the same pass. gpt-oss'
experts' gate/up bias is added inside both (each row's expert's row of it): in torch's operations
the bias' gather and addition wrote two more ``rows x 2 width`` tensors a pass.

Gate/up's output comes in the parts its 4-bit weights are dequantized in (moe.py's ``PARTS``): the
kernels read each part where its product wrote it (:func:`segments`), so the parts are never
copied into one tensor.

engine/fast/update.py's gated kernels take the same layout (gate's columns first, a row stride) but
not these: they tile the columns across programs, so a row's weight gradient would need atomics,
and the LoRA update they add is one adapter's, where each expert's rows have their own (the
grouped products add it). CUDA with Triton only (or Triton's interpreter, for the CPU tests); with
the kernels off (``trainer.fast_path.kernels``), or where they fail, moe.py keeps torch's operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from studio.core.decoder import MoeSpec
from studio.engine.fast.kernels import OwnKernels, interpreted

BLOCK_M = 32
BLOCK_N = 128
"""The forward's tile of rows x columns (the update kernels' shape)."""
BACKWARD_BLOCK = (16, 256)
"""The backward's rows a program and columns a step of its loop over the row."""
NUM_WARPS = 4

KERNELS = OwnKernels("expert_activation_kernels", ("routed_forward", "routed_backward", "add"),
                     "experts' activation kernels",
                     "running the experts' activation in torch's operations instead", per_batch=("n_rows",),
                     helpers=("load_gate_up", "store_gate_up"))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels can run on ``device`` for gate/up's output in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and KERNELS.usable(device)


def _constants(spec: MoeSpec) -> dict:
    clamped = spec.activation == "clamped_swiglu"
    return {"alpha": float(spec.swiglu_alpha if clamped else 1.0),
            "limit": float(spec.swiglu_limit if clamped else 0.0),
            "INTERLEAVED": bool(spec.interleaved), "CLAMPED": clamped}


class Segment(NamedTuple):
    """Where one kernel launch reads gate and up (``gate``, ``up``: ``[rows, width]`` views of
    gate/up's output, one row stride; for an interleaved layout ``gate`` holds both, alternating,
    ``[rows, 2 x width]``), their biases (``[experts, ...]`` views, or None), and the output's first
    column it writes."""
    gate: torch.Tensor
    up: torch.Tensor
    bias_gate: torch.Tensor | None
    bias_up: torch.Tensor | None
    start: int
    width: int


def segments(parts: Sequence[torch.Tensor], spec: MoeSpec, bias: torch.Tensor | None = None) -> list[Segment]:
    """How gate/up's output, in ``parts`` of its output features (engine/fast/moe.py's ``PARTS``:
    each ``[rows, columns / parts]``, contiguous rows), meets the kernels: interleaved, each part is
    whole pairs of gate and up, a launch of its own writing its share of the output's columns; gate's
    columns first, part ``j`` of the first half holds gate's values whose up is part ``j`` of the
    second, a launch for each such pair. ``bias``: each expert's ``[experts, columns]`` (gpt-oss)."""
    total = sum(p.shape[1] for p in parts)
    out, at = [], 0
    if spec.interleaved:
        for part in parts:
            n = part.shape[1]
            b = bias[:, at:at + n] if bias is not None else None
            out.append(Segment(part, part, b, b, at // 2, n // 2))
            at += n
        return out
    if len(parts) == 1:
        gu, width = parts[0], total // 2
        return [Segment(gu[:, :width], gu[:, width:], bias[:, :width] if bias is not None else None,
                        bias[:, width:] if bias is not None else None, 0, width)]
    half = len(parts) // 2
    widths = {p.shape[1] for p in parts}
    assert len(parts) % 2 == 0 and len(widths) == 1, "gate's columns first: parts of equal width, gate's and up's"
    n = widths.pop()
    for j in range(half):
        bg = bias[:, j * n:(j + 1) * n] if bias is not None else None
        bu = bias[:, total // 2 + j * n:total // 2 + (j + 1) * n] if bias is not None else None
        out.append(Segment(parts[j], parts[half + j], bg, bu, j * n, n))
    return out


def _reads(seg: Segment, expert: torch.Tensor | None, weight: torch.Tensor) -> tuple[dict, dict]:
    """What both kernels read of a segment, as their leading pointer arguments and their ``BIASED``
    and strides: gate, up, the biases and each row's expert (stand-ins where there is no bias: the
    unbiased kernels never read them), then the routing weight."""
    g, u = seg.gate, seg.up
    assert g.stride(-1) == 1 and u.stride(-1) == 1 and g.stride(0) == u.stride(0), "gate and up: rows alike"
    biased = seg.bias_gate is not None
    pointers = dict(g_ptr=g, u_ptr=u, bg_ptr=seg.bias_gate if biased else g, bu_ptr=seg.bias_up if biased else g,
                    e_ptr=expert if biased else weight, w_ptr=weight)
    return pointers, dict(stride_gu=g.stride(0), stride_bias=seg.bias_gate.stride(0) if biased else 0,
                          BIASED=biased)


def routed_activation(parts: Sequence[torch.Tensor], weight: torch.Tensor, spec: MoeSpec,
                      bias: torch.Tensor | None = None, expert: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate, up) x weight`` of gate/up's output in ``parts`` (:func:`segments`; the layout
    and activation :class:`MoeSpec` says), each row's expert's ``bias`` (``[experts, columns]``,
    the row's expert in ``expert [rows]``) added first, and each row's routing weight
    ``weight [rows]``."""
    rows = parts[0].shape[0]
    width = sum(p.shape[1] for p in parts) // 2
    out = parts[0].new_empty(rows, width)
    kernel = KERNELS.get()["routed_forward"]
    for seg in segments(parts, spec, bias):
        pointers, given = _reads(seg, expert, weight)
        kernel[(-(-rows // BLOCK_M), -(-seg.width // BLOCK_N))](
            **pointers, out_ptr=out[:, seg.start:], n_rows=rows, width=seg.width, stride_out=out.stride(0), **given,
            **_constants(spec), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return out


def routed_activation_backward_(parts: Sequence[torch.Tensor], weight: torch.Tensor, dout: torch.Tensor,
                                spec: MoeSpec, bias: torch.Tensor | None = None,
                                expert: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The gradients of :func:`routed_activation`'s ``parts`` (written over them) and ``weight``
    from its output's, ``dout [rows, width]``."""
    rows = parts[0].shape[0]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    chunks = segments(parts, spec, bias)
    # a row's weight gradient sums over every launch: in fp32 across several, rounded once
    dweight = torch.empty_like(weight) if len(chunks) == 1 else torch.empty(rows, dtype=torch.float32,
                                                                            device=weight.device)
    block_m, block_n = BACKWARD_BLOCK
    kernels, here = KERNELS.get(), interpreted()
    for i, seg in enumerate(chunks):
        pointers, given = _reads(seg, expert, weight)
        kernels["routed_backward"][(-(-rows // block_m),)](
            **pointers, dout_ptr=dout[:, seg.start:], dw_ptr=dweight, n_rows=rows, width=seg.width,
            stride_dout=dout.stride(0), **given, **_constants(spec), ACCUMULATE=i > 0, BLOCK_M=block_m,
            BLOCK_N=block_n, INTERPRETED=here, ADD=kernels["add"] if here else None, num_warps=NUM_WARPS)
    return list(parts), dweight.to(weight.dtype)


class RoutedActivation(torch.autograd.Function):
    """:func:`routed_activation` with its backward: ``RoutedActivation.apply(weight, expert, bias,
    spec, *parts)``; the parts' gradients are written over them, which must be read by nothing else
    (gate/up's products keep no output of their own)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, expert: torch.Tensor | None, bias: torch.Tensor | None, spec: MoeSpec,
                *parts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, expert, bias, *parts)
        ctx.spec = spec
        return routed_activation(parts, weight, spec, bias, expert)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        weight, expert, bias, *parts = ctx.saved_tensors
        dparts, dweight = routed_activation_backward_(parts, weight, dout, ctx.spec, bias, expert)
        return dweight, None, None, None, *dparts
