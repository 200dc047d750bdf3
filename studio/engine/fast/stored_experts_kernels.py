"""The Triton kernels behind :mod:`studio.engine.fast.stored_experts` (jitted on first use: this
module imports Triton, so nothing imports it until a kernel runs).

Both multiply the experts' sorted rows by their expert's 4-bit weight without writing the weight in
16 bits: each tile of packed bytes is decoded in registers (the 4-bit code, times its block's scale
in fp32, rounded to the rows' dtype: engine/fast/dequant.py's and mxfp4_dequant.py's values to the
bit) and goes straight into ``tl.dot``. The stored weight of expert ``e`` is ``W_e [A, B]``, the
flattened ``[experts, A, B]`` tensor two values a byte along ``B``, one scale per ``BLOCKSIZE``
values along ``B``: bitsandbytes' NF4 (high nibble first, blocks of 64, fp32 or double-quantized
scales) or, with ``MX``, gpt-oss' MXFP4 (low nibble first, blocks of 32, a power of two a block as
its exponent byte). The kernels read the window ``a_first ...``, ``b_first ...`` of it. A byte's
two values are never interleaved back into one tile: its first values form one operand (the even
columns of ``B``), its second values another (the odd ones).

- :func:`reduce_b`: ``y[r, a] = sum_b x[r, b] W_e[a, b]`` (``B`` is the reduction): each step loads
  the rows' values as one tile and splits it into the even and odd columns, which meet the bytes'
  first and second values in two products (loading them apart, every other value, took 2.3x as long: bench/NOTES.md
  section 14).
- :func:`reduce_a`: ``y[r, b] = sum_a x[r, a] W_e[a, b]`` (``B`` is the output): the first and
  second values accumulate the even and odd output columns apart; they are put back together once, at
  the store.

A program computes ``BLOCK_M`` rows of one expert. Its expert and rows come from the rows' offsets
(``offs``: where each expert's rows end, as torch's grouped product takes them): program ``t`` along
the second grid axis is the ``t``-th tile of ``BLOCK_M`` rows when every expert's rows are cut into
tiles of their own. The grid has room for every way the rows may fall (``rows / BLOCK_M`` tiles plus
one an expert), and a program past the last tile does nothing: the launch's shape depends on the
row count alone, so a CUDA graph captures it.

``ASM``: the code decoded by byte permutes in PTX (engine/fast/fourbit_decode.py: about six
instructions a value); else by a tree of selects over the code's 16 values at ``code_ptr`` (about
twenty; Triton's interpreter, which cannot run PTX, the CPU tests). ``BLOCKS``: 4-bit blocks a step
(or a program's columns), 1, 2 or 4.
``FP32_DOT``: Triton's interpreter, whose bf16 dot reads the raw bits: the operands go to fp32
(after rounding to the rows' dtype). ``ROUND_BY_HAND``: the interpreter truncates fp32 to bf16
where the compiled kernel rounds to nearest even; the weight's values are rounded by hand there, so
the CPU tests see the GPU's values. In the interpreter sums and scans go through ``tl.reduce`` /
``tl.associative_scan`` with :func:`add` (Triton's own ``tl.sum`` is a jitted helper it cannot call
there).
"""

import triton.language as tl

from studio.engine.fast.fourbit_decode import FP4, NF4, asm

NF4_ASM = tl.constexpr(asm(NF4))
"""The byte-permute decoding of four packed NF4 bytes (engine/fast/fourbit_decode.py)."""
FP4_ASM = tl.constexpr(asm(FP4))
"""The same for MXFP4's FP4 (E2M1) code."""


def add(a, b):
    return a + b


def tile_of(offs_ptr, t, n_experts, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``t``'s expert, its first row and the expert's past-last row (the expert is
    ``n_experts`` or more past the last tile)."""
    e_at = tl.arange(0, EXPERTS)
    ends = tl.load(offs_ptr + e_at, mask=e_at < n_experts, other=0)
    starts = tl.load(offs_ptr + e_at - 1, mask=(e_at > 0) & (e_at < n_experts), other=0)
    tiles = tl.where(e_at < n_experts, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    through = tl.associative_scan(tiles, 0, add)
    e = tl.reduce((through <= t).to(tl.int32), 0, add)
    mine = e_at == e
    first_tile = tl.reduce(tl.where(mine, through - tiles, 0), 0, add)
    start = tl.reduce(tl.where(mine, starts, 0), 0, add)
    end = tl.reduce(tl.where(mine, ends, 0), 0, add)
    return e, start + (t - first_tile) * BLOCK_M, end


def scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
           MX: tl.constexpr):
    """The fp32 scales of the 4-bit blocks ``block`` (int64): double-quantized ones expanded as
    bitsandbytes does (``code2[q] * absmax2`` rounded, then ``+ offset``); MXFP4's exponent bytes
    as mxfp4.scale_values builds them (0: 2^-127, a subnormal; 255: NaN). (One return a function:
    Triton's compiler types every return, a constexpr branch's too.)"""
    if MX:
        q = tl.load(absmax_ptr + block).to(tl.int32)
        bits = tl.where(q == 0, 1 << 22, q << 23)
        s = tl.where(q == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)
    elif NESTED:
        q = tl.load(absmax_ptr + block).to(tl.int32)
        s = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // BLOCKSIZE2)
        s = s + tl.load(offset_ptr)
    else:
        s = tl.load(absmax_ptr + block)
    return s


def pair_scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block, pair, NESTED: tl.constexpr,
                BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCKS: tl.constexpr, MX: tl.constexpr):
    """The scale of each byte ``pair`` (``[C]``, counted from the first of a run of ``BLOCKS``
    blocks) of the rows whose run begins at block ``block`` (``[R]``): ``[R, C]`` (``[R, 1]``, one
    block)."""
    HALF: tl.constexpr = BLOCKSIZE // 2
    out = scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block, NESTED, BLOCKSIZE2, MX)[:, None]
    if BLOCKS > 1:
        s1 = scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block + 1, NESTED, BLOCKSIZE2, MX)
        out = tl.where((pair >= HALF)[None, :], s1[:, None], out)
    if BLOCKS > 2:
        s2 = scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block + 2, NESTED, BLOCKSIZE2, MX)
        s3 = scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, block + 3, NESTED, BLOCKSIZE2, MX)
        out = tl.where((pair >= 2 * HALF)[None, :], s2[:, None], out)
        out = tl.where((pair >= 3 * HALF)[None, :], s3[:, None], out)
    return out


def decode_bytes(byte, code_ptr, ASM: tl.constexpr, MX: tl.constexpr):
    """The fp32 code values of each byte's first and second value (``byte``: uint8): NF4's high
    nibble first, MXFP4's low one."""
    if ASM:
        if MX:
            high, low = tl.inline_asm_elementwise(FP4_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                                  dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            high, low = tl.inline_asm_elementwise(NF4_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                                  dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        high = tree(byte.to(tl.int32) >> 4, code_ptr)
        low = tree(byte.to(tl.int32) & 15, code_ptr)
    if MX:
        first, second = low, high
    else:
        first, second = high, low
    return first, second


def tree(nibble, code_ptr):
    """The code's fp32 value of each ``nibble`` (int32, 0-15) by a tree of selects over its 16 values."""
    c0 = tl.load(code_ptr + 0)
    c1 = tl.load(code_ptr + 1)
    c2 = tl.load(code_ptr + 2)
    c3 = tl.load(code_ptr + 3)
    c4 = tl.load(code_ptr + 4)
    c5 = tl.load(code_ptr + 5)
    c6 = tl.load(code_ptr + 6)
    c7 = tl.load(code_ptr + 7)
    c8 = tl.load(code_ptr + 8)
    c9 = tl.load(code_ptr + 9)
    c10 = tl.load(code_ptr + 10)
    c11 = tl.load(code_ptr + 11)
    c12 = tl.load(code_ptr + 12)
    c13 = tl.load(code_ptr + 13)
    c14 = tl.load(code_ptr + 14)
    c15 = tl.load(code_ptr + 15)
    b0 = (nibble & 1) != 0
    b1 = (nibble & 2) != 0
    b2 = (nibble & 4) != 0
    lo = tl.where(b2, tl.where(b1, tl.where(b0, c7, c6), tl.where(b0, c5, c4)),
                  tl.where(b1, tl.where(b0, c3, c2), tl.where(b0, c1, c0)))
    hi = tl.where(b2, tl.where(b1, tl.where(b0, c15, c14), tl.where(b0, c13, c12)),
                  tl.where(b1, tl.where(b0, c11, c10), tl.where(b0, c9, c8)))
    return tl.where(nibble >= 8, hi, lo)


def weight(values, dtype: tl.constexpr, ROUND_BY_HAND: tl.constexpr, FP32_DOT: tl.constexpr):
    """fp32 weight values rounded to ``dtype`` (as a dot's operand: fp32 holding them in the interpreter)."""
    if ROUND_BY_HAND:
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        w = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        w = values.to(dtype)
    if FP32_DOT:
        w = w.to(tl.float32)
    return w


def operands(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, at, pair, dtype: tl.constexpr,
             NESTED: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, BLOCKS: tl.constexpr,
             ASM: tl.constexpr, MX: tl.constexpr, FP32_DOT: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """The weight tile whose rows begin at value ``at`` (int64, ``[R]``), byte ``pair`` (``[C]``) of
    each: the bytes' first and second values, scaled, in ``dtype`` (two ``[R, C]`` dot operands)."""
    byte = tl.load(packed_ptr + at[:, None] // 2 + pair[None, :])
    s = pair_scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, at // BLOCKSIZE, pair, NESTED, BLOCKSIZE,
                    BLOCKSIZE2, BLOCKS, MX)
    first, second = decode_bytes(byte, code_ptr, ASM, MX)
    return weight(first * s, dtype, ROUND_BY_HAND, FP32_DOT), weight(second * s, dtype, ROUND_BY_HAND, FP32_DOT)


def reduce_b(x_ptr, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, offs_ptr, y_ptr,
             n_experts, A, B, a_first, a_len, b_first, b_len, stride_x, stride_y,
             EXPERTS: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr,
             MX: tl.constexpr, FP32_DOT: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    # y[r, a] = sum_b x[r, b] W_e[a_first + a, b_first + b]: a step of the reduction is BLOCKS 4-bit
    # blocks of each weight row; b_len is a multiple of the step
    STEP: tl.constexpr = BLOCKSIZE * BLOCKS
    e, row0, end = tile_of(offs_ptr, tl.program_id(1), n_experts, EXPERTS, BLOCK_M)
    if e < n_experts:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_in = rows < end
        a = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        a_in = a < a_len
        a_row = (e.to(tl.int64) * A + a_first + tl.where(a_in, a, 0)) * B + b_first  # each weight row's first value
        pair = tl.arange(0, STEP // 2)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for b0 in range(0, b_len, STEP):
            at = a_row + b0
            high, low = operands(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, at, pair,
                                 x_ptr.dtype.element_ty, NESTED, BLOCKSIZE, BLOCKSIZE2, BLOCKS, ASM, MX, FP32_DOT,
                                 ROUND_BY_HAND)
            both = tl.load(x_rows + (b0 + tl.arange(0, STEP))[None, :], mask=row_in[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(both, (BLOCK_M, STEP // 2, 2)))
            if FP32_DOT:
                x_even = x_even.to(tl.float32)
                x_odd = x_odd.to(tl.float32)
            acc = tl.dot(x_even, tl.trans(high), acc)
            acc = tl.dot(x_odd, tl.trans(low), acc)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + a[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_in[:, None] & a_in[None, :])


def reduce_a(x_ptr, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, offs_ptr, y_ptr,
             n_experts, A, B, a_first, a_len, b_first, b_len, stride_x, stride_y,
             EXPERTS: tl.constexpr, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCKSIZE2: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr,
             MX: tl.constexpr, FP32_DOT: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    # y[r, b] = sum_a x[r, a] W_e[a_first + a, b_first + b]: a program's output columns are BLOCKS
    # 4-bit blocks of each weight row; b_len is a multiple of them
    BLOCK_N: tl.constexpr = BLOCKSIZE * BLOCKS
    e, row0, end = tile_of(offs_ptr, tl.program_id(1), n_experts, EXPERTS, BLOCK_M)
    if e < n_experts:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_in = rows < end
        b0 = tl.program_id(0) * BLOCK_N
        pair = tl.arange(0, BLOCK_N // 2)
        k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        first = (e.to(tl.int64) * A + a_first) * B + b_first + b0  # W_e[a_first, b_first + b0]
        even = tl.full((BLOCK_M, BLOCK_N // 2), 0.0, tl.float32)
        odd = tl.full((BLOCK_M, BLOCK_N // 2), 0.0, tl.float32)
        for k0 in range(0, a_len, BLOCK_K):
            k_in = k0 + k < a_len
            at = first + (k0 + tl.where(k_in, k, 0)).to(tl.int64) * B
            high, low = operands(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, at, pair,
                                 x_ptr.dtype.element_ty, NESTED, BLOCKSIZE, BLOCKSIZE2, BLOCKS, ASM, MX, FP32_DOT,
                                 ROUND_BY_HAND)
            xt = tl.load(x_rows + (k0 + k)[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
            if FP32_DOT:
                xt = xt.to(tl.float32)
            even = tl.dot(xt, high, even)
            odd = tl.dot(xt, low, odd)
        both = tl.reshape(tl.join(even, odd), (BLOCK_M, BLOCK_N))
        cols = b0 + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], both.to(y_ptr.dtype.element_ty),
                 mask=row_in[:, None] & (cols < b_len)[None, :])
