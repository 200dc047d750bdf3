"""The Triton kernels behind :mod:`studio.engine.fast.update` (jitted on first use: this module
imports Triton, so nothing imports it until a kernel runs).

Each works on a tile of rows x columns of a product's output and adds the LoRA update
``scale * xa @ bt`` to it on the fly: ``xa`` holds the tile's rows of ``x @ A^T``
(``[rows, rank]``), ``bt`` the tile's columns of B^T (``[rank, columns]``), and the rank-sized
inner product runs on the tensor cores from the bf16 or fp16 values with fp32 sums (exact
products). The update is never written out as a tensor of its own.

Gate/up's B^T is block-diagonal (projection.Projection.adapters): gate's columns read only gate's
rows of ``xa`` and ``bt`` (``k_gate``, ``r_gate``), up's only up's, so each inner product is one
adapter's rank long, not both.

Loads are masked (never clamped to the edge): Triton then still sees each row of a tile as
contiguous and loads it in 16-byte vectors (clamped indices made them scalar, 10x slower).
``DOT_F32``: multiply in fp32 (Triton's interpreter, on the CPU, mishandles bf16 products).
``GELU``: the gate's activation is GELU's tanh form (Gemma's ``gelu_pytorch_tanh``), else SiLU.
"""

import triton.language as tl


def gelu_tanh(gate):
    """GELU's tanh form of ``gate`` (fp32), ``0.5 g (1 + tanh(z))`` with ``z = sqrt(2 / pi) (g +
    0.044715 g^3)``, and its derivative, written as ``g sigmoid(2z)`` (the same function: ``(1 +
    tanh z) / 2 = sigmoid(2z)``), which has no ``1 + tanh`` to cancel for negative ``g`` and needs no
    tanh (libdevice's is a jitted helper that the interpreter cannot call when Triton was imported
    before TRITON_INTERPRET was set: the tests). The constants are written out: a kernel reads no
    module global but a ``tl.constexpr``."""
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    sig = 1.0 / (1.0 + tl.exp(-2.0 * inner))
    act = gate * sig
    slope = sig + 2.0 * act * (1.0 - sig) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * gate * gate)
    return act, slope


def gated_forward(gu_ptr, xa_ptr, bt_ptr, out_ptr, n_rows, ffn, k_gate, r_gate, k_up, r_up, scale, stride_gu,
                  stride_xa, stride_bt, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  RANK: tl.constexpr, GATE: tl.constexpr, UP: tl.constexpr, DOT_F32: tl.constexpr,
                  GELU: tl.constexpr):
    """``out = act(gate) * up`` where ``gate | up`` is the gate/up product's output plus its update
    (``gu``: ``[rows, 2 * ffn]``, gate in the first ``ffn`` columns; ``GATE``/``UP``: whether that
    half has an adapter; ``act``: SiLU, or with ``GELU`` :func:`gelu_tanh`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < n_rows
    col_in = cols < ffn
    keep = row_in[:, None] & col_in[None, :]
    rows64 = rows.to(tl.int64)
    at = rows64[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + ffn, mask=keep, other=0.0).to(tl.float32)
    k = tl.arange(0, RANK)
    if GATE:
        xa = tl.load(xa_ptr + rows64[:, None] * stride_xa + (k_gate + k)[None, :],
                     mask=row_in[:, None] & (k < r_gate)[None, :], other=0.0)
        bt = tl.load(bt_ptr + (k_gate + k)[:, None] * stride_bt + cols[None, :],
                     mask=(k < r_gate)[:, None] & col_in[None, :], other=0.0)
        if DOT_F32:
            xa, bt = xa.to(tl.float32), bt.to(tl.float32)
        gate += tl.dot(xa, bt) * scale
    if UP:
        xa = tl.load(xa_ptr + rows64[:, None] * stride_xa + (k_up + k)[None, :],
                     mask=row_in[:, None] & (k < r_up)[None, :], other=0.0)
        bt = tl.load(bt_ptr + (k_up + k)[:, None] * stride_bt + ffn + cols[None, :],
                     mask=(k < r_up)[:, None] & col_in[None, :], other=0.0)
        if DOT_F32:
            xa, bt = xa.to(tl.float32), bt.to(tl.float32)
        up += tl.dot(xa, bt) * scale
    if GELU:
        act, _ = gelu_tanh(gate)
        out = act * up
    else:  # silu by hand: tl.sigmoid is a jitted helper that the interpreter cannot call either
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)


def gated_backward(gu_ptr, xa_ptr, bt_ptr, dout_ptr, dgu_ptr, dyb_ptr, a_ptr, n_rows, ffn, k_gate, r_gate,
                   k_up, r_up, r_extra, scale, stride_gu, stride_xa, stride_bt, stride_dout, stride_dyb, stride_a,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr, GATE: tl.constexpr,
                   UP: tl.constexpr, EXTRA: tl.constexpr, RANK_EXTRA: tl.constexpr, DOT_F32: tl.constexpr,
                   GELU: tl.constexpr):
    """The gradients of gate and up (with their updates) from the output's, written into ``dgu``
    (``[rows, 2 * ffn]``, the stride of ``gu``; it may be ``gu`` itself: each program reads its
    tiles before it writes them, and no other program's). ``EXTRA``: the output's gradient is
    ``dout + dyb @ a``, the rest of it handed over by the next product's backward (its LoRA term:
    ``dyb`` ``[rows, r_extra]``, already scaled, and A ``[r_extra, ffn]``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < n_rows
    col_in = cols < ffn
    keep = row_in[:, None] & col_in[None, :]
    rows64 = rows.to(tl.int64)
    at = rows64[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + ffn, mask=keep, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + rows64[:, None] * stride_dout + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    if EXTRA:
        ke = tl.arange(0, RANK_EXTRA)
        dyb = tl.load(dyb_ptr + rows64[:, None] * stride_dyb + ke[None, :],
                      mask=row_in[:, None] & (ke < r_extra)[None, :], other=0.0)
        a = tl.load(a_ptr + ke[:, None] * stride_a + cols[None, :], mask=(ke < r_extra)[:, None] & col_in[None, :],
                    other=0.0)
        if DOT_F32:
            dyb, a = dyb.to(tl.float32), a.to(tl.float32)
        dout += tl.dot(dyb, a)
    k = tl.arange(0, RANK)
    if GATE:
        xa = tl.load(xa_ptr + rows64[:, None] * stride_xa + (k_gate + k)[None, :],
                     mask=row_in[:, None] & (k < r_gate)[None, :], other=0.0)
        bt = tl.load(bt_ptr + (k_gate + k)[:, None] * stride_bt + cols[None, :],
                     mask=(k < r_gate)[:, None] & col_in[None, :], other=0.0)
        if DOT_F32:
            xa, bt = xa.to(tl.float32), bt.to(tl.float32)
        gate += tl.dot(xa, bt) * scale
    if UP:
        xa = tl.load(xa_ptr + rows64[:, None] * stride_xa + (k_up + k)[None, :],
                     mask=row_in[:, None] & (k < r_up)[None, :], other=0.0)
        bt = tl.load(bt_ptr + (k_up + k)[:, None] * stride_bt + ffn + cols[None, :],
                     mask=(k < r_up)[:, None] & col_in[None, :], other=0.0)
        if DOT_F32:
            xa, bt = xa.to(tl.float32), bt.to(tl.float32)
        up += tl.dot(xa, bt) * scale
    if GELU:
        act, slope = gelu_tanh(gate)
    else:
        sig = 1.0 / (1.0 + tl.exp(-gate))
        act = gate * sig
        slope = sig + act * (1.0 - sig)
    dgate = dout * up * slope
    dup = dout * act
    tl.store(dgu_ptr + at, dgate.to(dgu_ptr.dtype.element_ty), mask=keep)
    tl.store(dgu_ptr + at + ffn, dup.to(dgu_ptr.dtype.element_ty), mask=keep)


def residual_update(y_ptr, xa_ptr, bt_ptr, res_ptr, n_rows, n_cols, rank, scale, stride_y, stride_xa,
                    stride_bt, stride_res, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    RANK: tl.constexpr, DOT_F32: tl.constexpr):
    """``y = res + round(y + update)`` in place: the base product's output meets its update first,
    rounded to the output's dtype as a product's output would be, and the residual stream last."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < n_rows
    col_in = cols < n_cols
    keep = row_in[:, None] & col_in[None, :]
    rows64 = rows.to(tl.int64)
    at = rows64[:, None] * stride_y + cols[None, :]
    y = tl.load(y_ptr + at, mask=keep, other=0.0).to(tl.float32)
    k = tl.arange(0, RANK)
    xa = tl.load(xa_ptr + rows64[:, None] * stride_xa + k[None, :], mask=row_in[:, None] & (k < rank)[None, :],
                 other=0.0)
    bt = tl.load(bt_ptr + k[:, None] * stride_bt + cols[None, :], mask=(k < rank)[:, None] & col_in[None, :],
                 other=0.0)
    if DOT_F32:
        xa, bt = xa.to(tl.float32), bt.to(tl.float32)
    y += tl.dot(xa, bt) * scale
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    res = tl.load(res_ptr + rows64[:, None] * stride_res + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, (y + res).to(y_ptr.dtype.element_ty), mask=keep)
