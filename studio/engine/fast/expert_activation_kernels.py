"""The Triton kernels behind :mod:`studio.engine.fast.expert_activation` (jitted on first use: this
module imports Triton, so nothing imports it until a kernel runs).

Both read gate/up's output of the experts' sorted rows (``gu``: ``[rows, 2 x width]``) and each
row's routing weight (``w``: ``[rows]``), and compute in fp32. ``INTERLEAVED``: gate and up alternate
column by column (gpt-oss), else gate's ``width`` columns come first. ``CLAMPED``: gpt-oss' SwiGLU,
``min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)``; else SiLU's,
``g sigmoid(g) u``. A clamped value passes no gradient, as torch's clamp: its gradient flows where
the value lies within the bounds, bounds included.

Loads are masked (never clamped to the edge: Triton then loads each row in vectors). The sigmoid is
written out, and in Triton's interpreter (``INTERPRETED``: the CPU tests) a row's sum goes through
``tl.reduce`` with :func:`add` (jitted by the caller): ``tl.sigmoid``, ``tl.sum`` and ``tl.zeros``
are jitted helpers of Triton's own, which the interpreter cannot call when Triton was imported
before ``TRITON_INTERPRET`` was set (cross_entropy_kernels.py does the same).
"""

import triton.language as tl


def add(a, b):
    return a + b


def gate_up_at(rows64, cols, stride, width, INTERLEAVED: tl.constexpr):
    """Where gate's and up's values of a tile (``rows64`` x ``cols``) lie in a ``[rows, 2 x width]``
    tensor of row stride ``stride``, laid out as ``INTERLEAVED`` says."""
    if INTERLEAVED:
        at_gate = rows64[:, None] * stride + 2 * cols[None, :]
        at_up = at_gate + 1
    else:
        at_gate = rows64[:, None] * stride + cols[None, :]
        at_up = at_gate + width
    return at_gate, at_up


def routed_forward(gu_ptr, w_ptr, out_ptr, n_rows, width, stride_gu, stride_out, alpha, limit,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr,
                   CLAMPED: tl.constexpr):
    """``out = act(gate, up) x w`` for a tile of rows x columns (``out``: ``[rows, width]``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < n_rows
    keep = row_in[:, None] & (cols < width)[None, :]
    rows64 = rows.to(tl.int64)
    at_gate, at_up = gate_up_at(rows64, cols, stride_gu, width, INTERLEAVED)
    gate = tl.load(gu_ptr + at_gate, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at_up, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows64, mask=row_in, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    out = act * w[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)


def routed_backward(gu_ptr, w_ptr, dout_ptr, dgu_ptr, dw_ptr, n_rows, width, stride_gu, stride_dout, alpha,
                    limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr,
                    CLAMPED: tl.constexpr, INTERPRETED: tl.constexpr, ADD: tl.constexpr):
    """From the output's gradient ``dout``: gate's and up's gradients into ``dgu`` (``gu``'s layout
    and stride; it may be ``gu`` itself: a program reads each tile before it writes it, and no other
    program's), and each row's weight gradient ``dw = sum(dout x act)`` over the row's columns. A
    program takes whole rows, the columns a tile at a time, so the row's sum needs no atomics."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < n_rows
    rows64 = rows.to(tl.int64)
    w = tl.load(w_ptr + rows64, mask=row_in, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK_M], 0.0, tl.float32)
    for start in range(0, width, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        keep = row_in[:, None] & (cols < width)[None, :]
        at_gate, at_up = gate_up_at(rows64, cols, stride_gu, width, INTERLEAVED)
        gate = tl.load(gu_ptr + at_gate, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + at_up, mask=keep, other=0.0).to(tl.float32)
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
        tl.store(dgu_ptr + at_gate, (dact * up * slope).to(dgu_ptr.dtype.element_ty), mask=keep)
        tl.store(dgu_ptr + at_up, (dact * d_up).to(dgu_ptr.dtype.element_ty), mask=keep)
    tl.store(dw_ptr + rows64, dw.to(dw_ptr.dtype.element_ty), mask=row_in)
