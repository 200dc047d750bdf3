"""The Triton kernels behind :mod:`studio.engine.fast.update` (jitted on first use: this module
imports Triton, so nothing imports it until a kernel runs).

Each works on a tile of rows x columns of a product's output and adds the LoRA update
``scale * xa @ bt`` to it on the fly: ``xa`` is the tile's rows of ``x @ A^T`` (``[rows, rank]``),
``bt`` the tile's columns of B^T (``[rank, columns]``), and the rank-sized inner product runs on
the tensor cores in tf32, from bf16 or fp16 values (which tf32 holds exactly, so the products are
exact and the sums fp32). The update is never written out as a tensor of its own.
"""

import triton.language as tl


def swiglu_forward(gu_ptr, xa_ptr, bt_ptr, out_ptr, n_rows, ffn, rank, scale, stride_gu, stride_xa,
                   stride_xa_k, stride_bt, stride_bt_n, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RANK: tl.constexpr, UPDATE: tl.constexpr):
    """``out = silu(gate) * up`` where ``gate | up`` is the gate/up product's output plus its update
    (``gu``: ``[rows, 2 * ffn]``, gate in the first ``ffn`` columns)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows < n_rows)[:, None] & (cols < ffn)[None, :]
    at = rows[:, None].to(tl.int64) * stride_gu + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + ffn, mask=keep, other=0.0).to(tl.float32)
    if UPDATE:
        k = tl.arange(0, RANK)
        xa = tl.load(xa_ptr + rows[:, None].to(tl.int64) * stride_xa + k[None, :] * stride_xa_k,
                     mask=k[None, :] < rank, other=0.0).to(tl.float32)
        bt_at = bt_ptr + k[:, None] * stride_bt + cols[None, :] * stride_bt_n
        bt_gate = tl.load(bt_at, mask=k[:, None] < rank, other=0.0).to(tl.float32)
        bt_up = tl.load(bt_at + ffn * stride_bt_n, mask=k[:, None] < rank, other=0.0).to(tl.float32)
        gate += tl.dot(xa, bt_gate) * scale
        up += tl.dot(xa, bt_up) * scale
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu; not tl.sigmoid (a jitted helper the interpreter
    # cannot call when Triton was imported before TRITON_INTERPRET was set, as in the tests)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=keep)


def swiglu_backward(gu_ptr, xa_ptr, bt_ptr, dout_ptr, dgu_ptr, n_rows, ffn, rank, scale, stride_gu,
                    stride_xa, stride_xa_k, stride_bt, stride_bt_n, stride_dout, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, RANK: tl.constexpr, UPDATE: tl.constexpr):
    """The gradients of gate and up (with their updates) from the output's, written into ``dgu``
    (``[rows, 2 * ffn]``, the stride of ``gu``; it may be ``gu`` itself: each program reads its
    tiles before it writes them, and no other program's)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows < n_rows)[:, None] & (cols < ffn)[None, :]
    at = rows[:, None].to(tl.int64) * stride_gu + cols[None, :]
    gate = tl.load(gu_ptr + at, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + at + ffn, mask=keep, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + rows[:, None].to(tl.int64) * stride_dout + cols[None, :], mask=keep,
                   other=0.0).to(tl.float32)
    if UPDATE:
        k = tl.arange(0, RANK)
        xa = tl.load(xa_ptr + rows[:, None].to(tl.int64) * stride_xa + k[None, :] * stride_xa_k,
                     mask=k[None, :] < rank, other=0.0).to(tl.float32)
        bt_at = bt_ptr + k[:, None] * stride_bt + cols[None, :] * stride_bt_n
        bt_gate = tl.load(bt_at, mask=k[:, None] < rank, other=0.0).to(tl.float32)
        bt_up = tl.load(bt_at + ffn * stride_bt_n, mask=k[:, None] < rank, other=0.0).to(tl.float32)
        gate += tl.dot(xa, bt_gate) * scale
        up += tl.dot(xa, bt_up) * scale
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    dgate = dout * up * (sig + silu * (1.0 - sig))
    dup = dout * silu
    tl.store(dgu_ptr + at, dgate.to(dgu_ptr.dtype.element_ty), mask=keep)
    tl.store(dgu_ptr + at + ffn, dup.to(dgu_ptr.dtype.element_ty), mask=keep)


def residual_update(y_ptr, xa_ptr, bt_ptr, res_ptr, n_rows, n_cols, rank, scale, stride_y, stride_xa,
                    stride_xa_k, stride_bt, stride_bt_n, stride_res, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, RANK: tl.constexpr):
    """``y = res + round(y + update)`` in place: the base product's output meets its update first,
    rounded to the output's dtype as a product's output would be, and the residual stream last."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    at = rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    y = tl.load(y_ptr + at, mask=keep, other=0.0).to(tl.float32)
    k = tl.arange(0, RANK)
    xa = tl.load(xa_ptr + rows[:, None].to(tl.int64) * stride_xa + k[None, :] * stride_xa_k,
                 mask=k[None, :] < rank, other=0.0).to(tl.float32)
    bt = tl.load(bt_ptr + k[:, None] * stride_bt + cols[None, :] * stride_bt_n, mask=k[:, None] < rank,
                 other=0.0)
    y += tl.dot(xa, bt.to(tl.float32)) * scale
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    res = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_res + cols[None, :], mask=keep,
                  other=0.0).to(tl.float32)
    out = y + res
    tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=keep)
