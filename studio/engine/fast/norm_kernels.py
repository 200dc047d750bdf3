"""The Triton kernels behind :mod:`studio.engine.fast.norm` (jitted on first use: this module imports
Triton, so nothing imports it until a kernel runs). One program a row; the row (the hidden size) fits
one block.

Numerics are transformers' LlamaRMSNorm's (and liger's "llama" mode): the statistics in fp32, the
normalized row rounded to the input's dtype, then multiplied by the weight in that dtype.

In Triton's interpreter (``INTERPRETED``) sums go through ``tl.reduce`` with ``ADD`` (:func:`add`, jitted
by the caller) and bf16 roundings through ``ROUND`` (:func:`round_bf16`): ``tl.sum`` is a jitted helper
of Triton's own, which the interpreter cannot call when Triton was imported before ``TRITON_INTERPRET``
was set (the CPU tests), and it truncates to bf16 where the compiled kernel rounds. Compiled, the
kernels use ``tl.sum`` and round when they convert.
"""

import triton.language as tl


def add(a, b):
    return a + b


def round_bf16(x):
    """fp32 ``x`` rounded to bf16's nearest even, kept in fp32: Triton's interpreter truncates where
    the compiled kernel (and torch) rounds, so the CPU tests round by hand."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


def rms_norm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, stride_x, stride_y, BLOCK: tl.constexpr,
                     INTERPRETED: tl.constexpr, ADD: tl.constexpr, ROUND: tl.constexpr):
    """``y = w * (x / rms(x))`` for one row, and the row's ``1 / rms`` (fp32) for the backward. The
    product is taken in fp32 and rounded once: for a half-precision weight it is exact there (the
    half-precision product's rounding), for an fp32 one it is liger's and transformers' order."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0).to(tl.float32)
    if INTERPRETED:
        squares = tl.reduce(x * x, 0, ADD)
    else:
        squares = tl.sum(x * x, axis=0)
    rstd = 1.0 / tl.sqrt(squares / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    # The weight as it is (half precision, or fp32 where the engine kept it so: build.py), in fp32
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    if INTERPRETED and y_ptr.dtype.element_ty == tl.bfloat16:
        y = ROUND(ROUND(x * rstd) * w)
    else:
        y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=keep)


def rms_norm_backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dres_ptr, dx_ptr, n_cols, stride_dy, stride_x,
                      stride_dres, stride_dx, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
                      INTERPRETED: tl.constexpr, ADD: tl.constexpr):
    """The input's gradient for one row: ``rstd * (g - xhat * mean(g * xhat))`` with ``g = dy * w``
    and ``xhat = x * rstd``, plus (``RESIDUAL``) the gradient the residual stream brings to the same
    input, summed in fp32 and rounded once. No weight gradient: the norms' weights are frozen."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=keep, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + cols, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    g = dy * w
    xhat = x * rstd
    if INTERPRETED:
        dot = tl.reduce(g * xhat, 0, ADD)
    else:
        dot = tl.sum(g * xhat, axis=0)
    dx = rstd * (g - xhat * (dot / n_cols))
    if RESIDUAL:
        dx += tl.load(dres_ptr + row * stride_dres + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=keep)
