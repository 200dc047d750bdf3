"""The Triton kernels behind :mod:`studio.engine.fast.expert_activation` (jitted on first use: this
module imports Triton, so nothing imports it until a kernel runs).

Both read gate's and up's values of the experts' sorted rows (``g``, ``u``: row stride
``stride_gu``), optionally each row's expert's bias over them (``bg``, ``bu``: one row an expert,
row stride ``stride_bias``, the row's expert from ``e``), and each row's routing weight (``w``), and
compute in fp32. ``INTERLEAVED``: gate and up alternate column by column (gpt-oss) from ``g`` (``u``
is not read): a tile of ``BLOCK_N`` columns loads its ``2 x BLOCK_N`` values as one contiguous
block and splits them, so the loads and stores run in vectors as the other layout's do (loading
gate and up apart, every other value, ran at a fifth of the card's bandwidth: the 27th session's
profile of gpt-oss-20b). Else gate's columns are at ``g``, up's at ``u`` (the same tensor
``width`` columns on, or another one: gate/up's output in two parts). ``CLAMPED``: gpt-oss'
SwiGLU, ``min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)``; else SiLU's,
``g sigmoid(g) u``. A clamped value passes no gradient, as torch's clamp: its gradient flows where
the value lies within the bounds, bounds included. ``BIASED``: the bias is added (in fp32) before
the activation; it gets no gradient (the experts' biases are frozen).

Loads are masked (never clamped to the edge: Triton then loads each row in vectors). The sigmoid is
written out, and in Triton's interpreter (``INTERPRETED``: the CPU tests) a row's sum goes through
``tl.reduce`` with :func:`add` (jitted by the caller): ``tl.sigmoid``, ``tl.sum`` and ``tl.zeros``
are jitted helpers of Triton's own, which the interpreter cannot call when Triton was imported
before ``TRITON_INTERPRET`` was set (cross_entropy_kernels.py does the same).
"""

import triton.language as tl


def add(a, b):
    return a + b


def load_gate_up(g_ptr, u_ptr, at_rows, start, row_in, width, INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Gate's and up's values (fp32, ``[BLOCK_M, BLOCK_N]``) of columns ``start ...`` of the rows
    that begin at element ``at_rows`` (int64); zero outside ``row_in`` and ``width``."""
    if INTERLEAVED:
        pairs = 2 * start + tl.arange(0, 2 * BLOCK_N)
        keep = row_in[:, None] & (pairs < 2 * width)[None, :]
        both = tl.load(g_ptr + at_rows[:, None] + pairs[None, :], mask=keep, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(both, [BLOCK_M, BLOCK_N, 2]))
    else:
        cols = start + tl.arange(0, BLOCK_N)
        keep = row_in[:, None] & (cols < width)[None, :]
        gate = tl.load(g_ptr + at_rows[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        up = tl.load(u_ptr + at_rows[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    return gate, up


def store_gate_up(g_ptr, u_ptr, at_rows, start, row_in, width, gate, up, INTERLEAVED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write ``gate`` and ``up`` (fp32 tiles) where :func:`load_gate_up` read them, rounded to the
    tensor's dtype."""
    if INTERLEAVED:
        pairs = 2 * start + tl.arange(0, 2 * BLOCK_N)
        keep = row_in[:, None] & (pairs < 2 * width)[None, :]
        both = tl.reshape(tl.join(gate, up), [BLOCK_M, 2 * BLOCK_N])
        tl.store(g_ptr + at_rows[:, None] + pairs[None, :], both.to(g_ptr.dtype.element_ty), mask=keep)
    else:
        cols = start + tl.arange(0, BLOCK_N)
        keep = row_in[:, None] & (cols < width)[None, :]
        tl.store(g_ptr + at_rows[:, None] + cols[None, :], gate.to(g_ptr.dtype.element_ty), mask=keep)
        tl.store(u_ptr + at_rows[:, None] + cols[None, :], up.to(u_ptr.dtype.element_ty), mask=keep)


def routed_forward(g_ptr, u_ptr, bg_ptr, bu_ptr, e_ptr, w_ptr, out_ptr, n_rows, width, stride_gu, stride_bias,
                   stride_out, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   INTERLEAVED: tl.constexpr, CLAMPED: tl.constexpr, BIASED: tl.constexpr):
    """``out = act(gate + bias, up + bias) x w`` for a tile of rows x columns (``out``: ``width``
    columns, row stride ``stride_out``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * BLOCK_N
    row_in = rows < n_rows
    rows64 = rows.to(tl.int64)
    gate, up = load_gate_up(g_ptr, u_ptr, rows64 * stride_gu, start, row_in, width, INTERLEAVED, BLOCK_M, BLOCK_N)
    if BIASED:
        expert = tl.load(e_ptr + rows64, mask=row_in, other=0).to(tl.int64)
        bias_gate, bias_up = load_gate_up(bg_ptr, bu_ptr, expert * stride_bias, start, row_in, width, INTERLEAVED,
                                          BLOCK_M, BLOCK_N)
        gate += bias_gate
        up += bias_up
    w = tl.load(w_ptr + rows64, mask=row_in, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    out = act * w[:, None]
    cols = start + tl.arange(0, BLOCK_N)
    keep = row_in[:, None] & (cols < width)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)


def routed_backward(g_ptr, u_ptr, bg_ptr, bu_ptr, e_ptr, w_ptr, dout_ptr, dw_ptr, n_rows, width, stride_gu,
                    stride_bias, stride_dout, alpha, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    INTERLEAVED: tl.constexpr, CLAMPED: tl.constexpr, BIASED: tl.constexpr,
                    ACCUMULATE: tl.constexpr, INTERPRETED: tl.constexpr, ADD: tl.constexpr):
    """From the output's gradient ``dout``: gate's and up's gradients written over their values in
    ``g`` and ``u`` (a program reads each tile before it writes it, and no other program's), and
    each row's weight gradient ``dw = sum(dout x act)`` over the row's columns (added to what ``dw``
    holds with ``ACCUMULATE``: gate/up in parts, a launch a part). A program takes whole rows, the
    columns a tile at a time, so the row's sum needs no atomics."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < n_rows
    rows64 = rows.to(tl.int64)
    at_rows = rows64 * stride_gu
    w = tl.load(w_ptr + rows64, mask=row_in, other=0.0).to(tl.float32)
    at_bias = at_rows  # (defined either way for the compiler; read only where BIASED)
    if BIASED:
        at_bias = tl.load(e_ptr + rows64, mask=row_in, other=0).to(tl.int64) * stride_bias
    dw = tl.full([BLOCK_M], 0.0, tl.float32)
    for start in range(0, width, BLOCK_N):
        gate, up = load_gate_up(g_ptr, u_ptr, at_rows, start, row_in, width, INTERLEAVED, BLOCK_M, BLOCK_N)
        if BIASED:
            bias_gate, bias_up = load_gate_up(bg_ptr, bu_ptr, at_bias, start, row_in, width, INTERLEAVED,
                                              BLOCK_M, BLOCK_N)
            gate += bias_gate
            up += bias_up
        cols = start + tl.arange(0, BLOCK_N)
        keep = row_in[:, None] & (cols < width)[None, :]
        dout = tl.load(dout_ptr + rows64[:, None] * stride_dout + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        if CLAMPED:
            gate_in = gate <= limit
            up_in = (up >= -limit) & (up <= limit)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
            sig = 1.0 / (1.0 + tl.exp(-alpha * gate))
            glu = gate * sig
            slope = tl.where(gate_in, sig + alpha * glu * (1.0 - sig), 0.0)
            d_up = tl.where(up_in, glu, 0.0)
        else:
            sig = 1.0 / (1.0 + tl.exp(-gate))
            glu = gate * sig
            slope = sig + glu * (1.0 - sig)
            d_up = glu
        if INTERPRETED:
            dw += tl.reduce(dout * glu * up, 1, ADD)
        else:
            dw += tl.sum(dout * glu * up, axis=1)
        dact = dout * w[:, None]
        store_gate_up(g_ptr, u_ptr, at_rows, start, row_in, width, dact * up * slope, dact * d_up, INTERLEAVED,
                      BLOCK_M, BLOCK_N)
    if ACCUMULATE:
        dw += tl.load(dw_ptr + rows64, mask=row_in, other=0.0).to(tl.float32)
    tl.store(dw_ptr + rows64, dw.to(dw_ptr.dtype.element_ty), mask=row_in)
