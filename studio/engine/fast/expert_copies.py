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

gpt-oss' experts have a down-projection bias, weighted like their product by the copy's routing
weight: :class:`Combine` adds each copy's ``bias[expert] x weight`` inside the same sum (the kernel
loads the bias row where it loads the copy's), instead of a gather of ``[rows, width]`` bias rows,
a product and an addition before it (three tensors of the sorted rows' size, which the checkpoint's
recomputation, whose value nothing reads, still made). Its backward gives the routing weight its
gradient through a ``[tokens, experts]`` product of the output's gradient and the biases, never a
``[rows, width]`` one.

:class:`Gather` and :class:`Combine` save the same tensors whichever way they sum, and whether they
compute a value or not: torch's checkpointing pairs a forward's saved tensors with its
recomputation's one by one.
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


def copies_sum(src: torch.Tensor, pos: torch.Tensor, k: int, bias: torch.Tensor | None = None,
               expert: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j src[r]``, ``r = pos[t x k + j]`` the sorted row of token ``t``'s copy ``j``
    (``src [rows, width]``, row stride; ``out [rows / k, width]``), in fp32, rounded once. With
    ``bias [experts, width]`` (row stride) each copy adds ``bias[expert[r]] x weight[r]`` to the same
    sum (``expert [rows]``: each sorted row's expert, int32 or int64; ``weight [rows]``: its routing
    weight)."""
    tokens, width = pos.shape[0] // k, src.shape[1]
    src = src if src.stride(-1) == 1 else src.contiguous()
    out = src.new_empty(tokens, width)
    biased = bias is not None
    if biased:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
        expert, weight = expert.contiguous(), weight.contiguous()
    else:  # stand-ins: the unbiased kernel never reads them
        bias = expert = weight = src
    KERNELS.get()["copies_sum"][(-(-tokens // BLOCK_M), -(-width // BLOCK_N))](
        src, pos, out, bias, expert, weight, tokens, width, src.stride(0), out.stride(0), bias.stride(0), K=k,
        BIASED=biased, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
    return out


def _summed(src: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int, kernel: bool,
            bias: torch.Tensor | None = None, expert: torch.Tensor | None = None,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's copies' rows of ``src`` summed, each plus its ``bias[expert] x weight`` where
    ``bias`` is given (:func:`copies_sum`'s arguments): :func:`copies_sum` where ``kernel`` says and
    it runs, else ``index_add_`` by ``rows`` (the token each sorted row is a copy of) of the rows with
    their bias added in torch's operations."""
    if kernel:
        done, out = KERNELS.attempt(lambda: copies_sum(src, pos, k, bias, expert, weight))
        if done:
            return out
    if bias is not None:
        src = src + bias[expert] * weight[:, None]
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
    :func:`copies_sum` with ``kernel``. With ``bias [experts, width]`` (frozen, in ``y``'s dtype) each
    copy also adds its expert's bias row times its routing weight, ``bias[expert] x weight``
    (``expert [rows]``: each sorted row's expert; ``weight [rows]``: its routing weight), in the same
    sum: gpt-oss' down-projection bias, which the routing weight scales as it scales the product.

    The backward hands each copy its token's gradient and, with a bias, the routing weight
    ``weight[r]`` its gradient ``sum_c dout[rows[r], c] x bias[expert[r], c]``: one product of the
    output's gradient with the biases, ``[tokens, experts]``, indexed by each copy's token and expert
    (the bias and the experts get none). With ``value`` False only the backward is real: the output
    is a zero that owns no memory (a recomputation's whose value nothing reads), and neither the sum
    nor the bias's terms are computed. The saved tensors are the same whether ``value`` is True or
    False and whether the kernel runs (the module's docstring says why)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, k: int, kernel: bool,
                value: bool = True, bias: torch.Tensor | None = None, expert: torch.Tensor | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None and (expert is None or weight is None):
            raise ValueError("Combine's bias needs each row's expert and routing weight")
        ctx.save_for_backward(rows, bias, expert)
        ctx.weight_dtype = weight.dtype if weight is not None else None
        if not value:
            return y.new_zeros(()).expand(pos.shape[0] // k, y.shape[1])
        return _summed(y, rows, pos, k, kernel, bias, expert, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        rows, bias, expert = ctx.saved_tensors
        dweight = None
        if bias is not None and ctx.needs_input_grad[8]:
            per_expert = dout @ bias.t().to(dout.dtype)  # [tokens, experts]: each token's gradient . each bias
            dweight = per_expert[rows, expert].to(ctx.weight_dtype)
        return dout.index_select(0, rows), None, None, None, None, None, None, None, dweight
