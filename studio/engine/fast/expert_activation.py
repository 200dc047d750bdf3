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
nothing else reads) and each row's weight gradient, the row's sum, from the same pass.

engine/fast/update.py's gated kernels take the same layout (gate's columns first, a row stride) but
not these: they tile the columns across programs, so a row's weight gradient would need atomics,
and the LoRA update they add is one adapter's, where each expert's rows have their own (the
grouped products add it). CUDA with Triton only (or Triton's interpreter, for the CPU tests); with
the kernels off (``trainer.fast_path.kernels``), or where they fail, moe.py keeps torch's operations.
"""

from __future__ import annotations

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
                     helpers=("gate_up_at",))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels can run on ``device`` for gate/up's output in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and KERNELS.usable(device)


def _constants(spec: MoeSpec) -> dict:
    clamped = spec.activation == "clamped_swiglu"
    return {"alpha": float(spec.swiglu_alpha if clamped else 1.0),
            "limit": float(spec.swiglu_limit if clamped else 0.0),
            "INTERLEAVED": bool(spec.interleaved), "CLAMPED": clamped}


def routed_activation(gu: torch.Tensor, weight: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """``act(gate, up) x weight`` of gate/up's output ``gu [rows, 2 x width]`` (row stride; the
    layout and activation :class:`MoeSpec` says) and each row's routing weight ``weight [rows]``."""
    rows, width = gu.shape[0], gu.shape[1] // 2
    out = gu.new_empty(rows, width)
    KERNELS.get()["routed_forward"][(-(-rows // BLOCK_M), -(-width // BLOCK_N))](
        gu, weight, out, rows, width, gu.stride(0), out.stride(0), **_constants(spec), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return out


def routed_activation_backward_(gu: torch.Tensor, weight: torch.Tensor, dout: torch.Tensor, spec: MoeSpec
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`routed_activation`'s ``gu`` (written over ``gu``) and ``weight``
    from its output's, ``dout [rows, width]``."""
    rows, width = gu.shape[0], gu.shape[1] // 2
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    dweight = torch.empty_like(weight)
    block_m, block_n = BACKWARD_BLOCK
    kernels, here = KERNELS.get(), interpreted()
    kernels["routed_backward"][(-(-rows // block_m),)](
        gu, weight, dout, gu, dweight, rows, width, gu.stride(0), dout.stride(0), **_constants(spec),
        BLOCK_M=block_m, BLOCK_N=block_n, INTERPRETED=here, ADD=kernels["add"] if here else None,
        num_warps=NUM_WARPS)
    return gu, dweight


class RoutedActivation(torch.autograd.Function):
    """:func:`routed_activation` with its backward: ``gu``'s gradient is written over ``gu``, which
    must be read by nothing else (gate/up's product keeps no output of its own, nor does its bias'
    addition)."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor, weight: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
        ctx.save_for_backward(gu, weight)
        ctx.spec = spec
        return routed_activation(gu, weight, spec)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        gu, weight = ctx.saved_tensors
        dgu, dweight = routed_activation_backward_(gu, weight, dout, ctx.spec)
        return dgu, dweight, None
