"""The Triton kernel behind :mod:`studio.engine.fast.expert_copies` (jitted on first use: this module
imports Triton, so nothing imports it until the kernel runs).

:func:`copies_sum` sums each token's ``K`` copies, rows of a tensor sorted by expert, back into the
token's row: a program takes a tile of tokens x columns and, for each of the ``K`` copies, gathers
the copy's row (``pos``: where copy ``token x K + j`` sits among the sorted rows) and adds it in
fp32; the sum is rounded once to the output's dtype. No atomics: each output element is one
program's, so the sum is the same on every run. Loads are masked (never clamped to the edge).

``BIASED`` (gpt-oss' down-projection bias): each copy also adds its expert's bias row times its
routing weight (``bias[expert[r]] x weight[r]`` for sorted row ``r``), loaded where the copy is
summed, into the same fp32 sum: the ``[rows, width]`` gather, product and addition torch would make
of them never exist. Unbiased, the flag compiles the loads away (the bias, expert and weight
pointers are then stand-ins the kernel never reads).
"""

import triton.language as tl


def copies_sum(src_ptr, pos_ptr, out_ptr, bias_ptr, expert_ptr, weight_ptr, n_tokens, width, stride_src,
               stride_out, stride_bias, K: tl.constexpr, BIASED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``out[t] = sum_j src[r]`` (``+ bias[expert[r]] x weight[r]`` where ``BIASED``), ``r = pos[t x K
    + j]``, for a tile of tokens x columns."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_in = tokens < n_tokens
    keep = token_in[:, None] & (cols < width)[None, :]
    tokens64 = tokens.to(tl.int64)
    total = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for j in range(K):
        row = tl.load(pos_ptr + tokens64 * K + j, mask=token_in, other=0).to(tl.int64)
        total += tl.load(src_ptr + row[:, None] * stride_src + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        if BIASED:
            expert = tl.load(expert_ptr + row, mask=token_in, other=0).to(tl.int64)
            weight = tl.load(weight_ptr + row, mask=token_in, other=0.0).to(tl.float32)
            bias = tl.load(bias_ptr + expert[:, None] * stride_bias + cols[None, :], mask=keep, other=0.0)
            total += bias.to(tl.float32) * weight[:, None]
    tl.store(out_ptr + tokens64[:, None] * stride_out + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=keep)
