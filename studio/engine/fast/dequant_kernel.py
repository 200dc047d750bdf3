"""The Triton kernel behind :mod:`studio.engine.fast.dequant` (which jits it on first use: this
module imports Triton, so nothing imports it until a 4-bit weight is dequantized on the GPU)."""

import triton.language as tl


def nf4_dequantize(packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, out_ptr, numel,
                   blocks, window, row_blocks, first, source_numel, NESTED: tl.constexpr, HALF: tl.constexpr,
                   BLOCKSIZE2: tl.constexpr, ROWS: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    # One row per 4-bit block of the output: HALF packed bytes, 2 * HALF values, one scale. The
    # output's blocks are a window of the stored ones: ``window`` blocks from block ``first`` of each
    # run of ``row_blocks`` (the whole weight: one run, window = row_blocks = blocks, first = 0).
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = row < blocks
    source = (row // window) * row_blocks + first + row % window
    if NESTED:
        q = tl.load(absmax_ptr + source, mask=in_range, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + source // BLOCKSIZE2, mask=in_range, other=0.0)
        scale = scale + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax_ptr + source, mask=in_range, other=0.0)
    byte_at = source[:, None] * HALF + tl.arange(0, HALF)[None, :]
    byte = tl.load(packed_ptr + byte_at, mask=in_range[:, None] & (byte_at * 2 < source_numel), other=0).to(tl.int32)
    # The first value of each byte is its high nibble (bitsandbytes' packing).
    high = tl.load(code_ptr + (byte >> 4)) * scale[:, None]
    low = tl.load(code_ptr + (byte & 15)) * scale[:, None]
    values = tl.reshape(tl.join(high, low), (ROWS, 2 * HALF))  # high, low, high, low, ...
    out_at = row[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    if ROUND_BY_HAND:
        # Triton's interpreter truncates fp32 to bf16 where the compiled kernel (and bitsandbytes)
        # rounds to nearest even: round the bits here, for the CPU tests.
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + out_at, values.to(out_ptr.dtype.element_ty), mask=out_at < numel)
