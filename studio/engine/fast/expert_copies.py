"""Each token's ``top_k`` copies, gathered into expert order before a sparse layer's products and
summed back into the token's row after them (engine/fast/moe.py).

Both directions of the move have a side where copies of one token meet: the combine's forward (a
token's output is its copies' rows summed) and the gather's backward (a token's gradient is its
copies' gradients summed). torch's ``index_add_`` and ``x[rows]``'s backward do that with atomic
additions or with a sort of the indices first (on Qwen3-30B-A3B at 2,048 tokens, 16,384 rows of
2,048: 0.27 ms and 0.16 ms a step on an H200, the 23rd session's profile). Here one Triton kernel
(:func:`copies_sum`) gathers each token's copies by where the sort put them (:func:`positions`) and
sums them in fp32, one rounding, the same on every run; torch's ``index_add_`` where the kernels
are off (``trainer.fast_path.kernels``), cannot run or fail. The other side of each (the gather's
forward, the combine's backward) is one ``index_select``.

:class:`Gather` and :class:`Combine` save the same tensors whichever way they sum: torch's
checkpointing pairs a forward's saved tensors with its recomputation's one by one.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from studio.engine.fast.kernels import OwnKernels

BLOCK_M = 16
BLOCK_N = 256
NUM_WARPS = 4
"""Tokens and columns a program of :func:`copies_sum` takes, and its warps: a guess, not timed."""

KERNELS = OwnKernels("expert_copies_kernels", ("copies_sum",), "experts' combine kernel",
                     "summing each token's copies with torch's index_add_ instead", per_batch=("n_tokens",))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel can run on ``device`` for rows in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and KERNELS.usable(device)


def positions(order: torch.Tensor) -> torch.Tensor:
    """Where each copy sits among the rows sorted by expert (int32): ``order``'s inverse, which
    lists the copy each sorted row is."""
    n = order.shape[0]
    return torch.empty(n, dtype=torch.int32, device=order.device).scatter_(
        0, order, torch.arange(n, dtype=torch.int32, device=order.device))


def copies_sum(src: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """``out[t] = sum_j src[pos[t x k + j]]`` (``src [rows, width]``, row stride; ``out [rows / k,
    width]``), in fp32, rounded once."""
    tokens, width = pos.shape[0] // k, src.shape[1]
    src = src if src.stride(-1) == 1 else src.contiguous()
    out = src.new_empty(tokens, width)
    KERNELS.get()["copies_sum"][(-(-tokens // BLOCK_M), -(-width // BLOCK_N))](
        src, pos, out, tokens, width, src.stride(0), out.stride(0), K=k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS)
    return out


def _summed(src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int, kernel: bool) -> torch.Tensor:
    """Each token's copies' rows of ``src`` summed: :func:`copies_sum` where ``kernel`` says and it
    runs, else ``index_add_`` by ``rows`` (the token each sorted row is a copy of)."""
    if kernel:
        done, out = KERNELS.attempt(lambda: copies_sum(src, pos, k))
        if done:
            return out
    return src.new_zeros(pos.shape[0] // k, src.shape[1]).index_add_(0, rows, src)


class Gather(torch.autograd.Function):
    """``src[rows]``: each token's row (``src [tokens, width]``) copied to its ``k`` copies' places
    among the sorted rows (``rows``: the token each is a copy of; ``pos``: :func:`positions`). The
    backward sums each token's copies' gradients (:func:`copies_sum` with ``kernel``)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int, kernel: bool) -> torch.Tensor:
        ctx.save_for_backward(rows, pos)
        ctx.k, ctx.kernel = k, kernel
        return src.index_select(0, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        rows, pos = ctx.saved_tensors
        return _summed(dout, rows, pos, ctx.k, ctx.kernel), None, None, None, None


class Combine(torch.autograd.Function):
    """Each token's output: the sum of its copies' rows ``y [rows, width]`` (sorted by expert; ``rows``,
    ``pos`` and ``k`` as :class:`Gather` takes them), the routing weights already in them, summed by
    :func:`copies_sum` with ``kernel``. The backward hands each copy its token's gradient. With
    ``value`` False only the backward is real: the output is a zero that owns no memory (a
    recomputation's whose value nothing reads)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int, kernel: bool,
                value: bool = True) -> torch.Tensor:
        ctx.save_for_backward(rows)
        if not value:
            return y.new_zeros(()).expand(pos.shape[0] // k, y.shape[1])
        return _summed(y, rows, pos, k, kernel)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return dout.index_select(0, rows), None, None, None, None, None
