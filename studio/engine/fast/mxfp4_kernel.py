"""The Triton kernel behind :mod:`studio.engine.fast.mxfp4_dequant` (which jits it on first use: this
module imports Triton, so nothing imports it until MXFP4 experts are dequantized)."""

import triton.language as tl


def mxfp4_dequantize(blocks_ptr, scales_ptr, out_ptr, rows, groups, rows_per_expert, stride_e, stride_r,
                     stride_c, part_rows, source_rows, first_row, ROWS: tl.constexpr, GROUPS: tl.constexpr,
                     BF16: tl.constexpr):
    # A tile of ROWS rows x GROUPS blocks of 32 values: 16 code bytes and one scale byte each. The
    # output's rows are ``part_rows`` of each expert's ``source_rows`` stored ones, from ``first_row``
    # (every row: part_rows = source_rows, first_row = 0).
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    inside = (row < rows)[:, None] & (group < groups)[None, :]
    source = (row // part_rows) * source_rows + first_row + row % part_rows
    block = source[:, None] * groups + group[None, :]
    exponent = tl.load(scales_ptr + block, mask=inside, other=0).to(tl.int32)
    # 2 ** (exponent - 127) built from its fp32 bits, as mxfp4.scale_values builds it (an exp2 would
    # be ex2.approx on the GPU, 2^-127 one subnormal step off): 0 is 2^-127 (subnormal), 255 NaN.
    scale = tl.where(exponent == 0, 1 << 22, exponent << 23)
    scale = tl.where(exponent == 255, 0x7FC00000, scale).to(tl.float32, bitcast=True)
    byte_at = block[:, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    byte = tl.load(blocks_ptr + byte_at, mask=inside[:, :, None], other=0).to(tl.int32)
    # Each byte holds two values, its lower nibble first.
    low = _fp4(byte & 15) * scale[:, :, None]
    high = _fp4(byte >> 4) * scale[:, :, None]
    values = tl.reshape(tl.join(low, high), (ROWS, GROUPS, 32))
    # Both factors are exact in fp32 and so is their product (fp32 keeps 2^-128), or it is past
    # fp32's range and infinite, as in any dtype here; the one rounding is to the output dtype, as
    # the torch way's (fp16's from fp32 too).
    place = (row // rows_per_expert) * stride_e + (row % rows_per_expert) * stride_r
    column = group[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    out_at = place[:, None, None] + column.to(tl.int64) * stride_c
    if BF16:
        # Every product is a bf16 number (bf16 has fp32's exponents, down to 2^-133, and these need
        # 2 significant bits): its upper 16 bits are it, a NaN's too (its quiet bit is among them).
        # Triton's interpreter would flush the subnormal ones to 0 in a cast.
        values = (values.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + out_at, values.to(out_ptr.dtype.element_ty), mask=inside[:, :, None])


def _fp4(code):
    """The FP4 E2M1 number of each 4-bit ``code`` (mxfp4.FP4_VALUES), as fp32: bit 3 the sign, bits
    2-1 the exponent (bias 1), bit 0 the mantissa; exponent 0 is 0 or 0.5."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    magnitude = tl.where(exponent == 0, mantissa * (126 << 23), ((126 + exponent) << 23) | (mantissa << 22))
    return (magnitude | ((code >> 3) << 31)).to(tl.float32, bitcast=True)
