"""A 4-bit code decoded by byte permutes (PTX ``prmt``), for engine/fast/stored_experts_kernels.py:
bitsandbytes' NF4 and MXFP4's FP4 (E2M1), any table of 16 fp32 values.

Triton's select tree spends some 20 instructions a value on the 16-value code, and decoding then
took more of a grouped product's time than its products (bench/NOTES.md section 14). Here the
code's fp32 values sit in 16 registers as four byte planes (plane ``k``: byte ``k`` of each value,
four values a register), and four packed bytes (eight values) are decoded at once:

- each value's nibble, bit 3 cleared, is a ``prmt`` selector: one ``prmt`` of a plane's first two
  registers reads byte ``k`` of four values among entries 0-7, one of its last two among 8-15;
- a ``prmt`` in sign-replicating mode turns each nibble's bit 3 into a byte mask, and ``lop3``
  keeps the 0-7 or 8-15 byte by it;
- eight more ``prmt`` a half put the four planes' bytes back together as fp32 values.

About 50 instructions for eight values, where the tree takes some 160. The values are the table's
to the bit: the kernel multiplies them by their scale and rounds as dequant.py does.

:func:`program` is the instruction list; :func:`asm` writes it as the PTX Triton's
``inline_asm_elementwise`` takes (``pack=4``: one 32-bit register of four bytes in, byte 0 the
first element; the four values of each byte's high nibble out in ``$0-$3``, the low nibbles' in
``$4-$7``). tests/engine/test_stored_experts.py runs the list on integers, by the PTX ISA's
definitions of ``prmt`` (default mode) and ``lop3``: the GPU is the only place the PTX itself runs.
"""

from __future__ import annotations

import struct

NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
"""bitsandbytes' NF4 code (``get_4bit_type("nf4")``), as fp32 values."""
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""MXFP4's FP4 (E2M1) code (engine/mxfp4.py's ``FP4_VALUES``)."""

KEEP_HIGH_BY_MASK = 0xD8
"""``lop3``'s table for ``(a & ~c) | (b & c)`` (a = 0xF0, b = 0xCC, c = 0xAA)."""


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def planes(code) -> list[list[int]]:
    """``planes[k][g]``: byte ``k`` of code values ``4g ... 4g + 3``, as one 32-bit word."""
    bits = [_bits(v) for v in code]
    return [[sum(((bits[4 * g + j] >> (8 * k)) & 0xFF) << (8 * j) for j in range(4)) for g in range(4)]
            for k in range(4)]


def program(code) -> list[tuple]:
    """The instructions: ``(op, destination, sources...)``; ``x`` is the input register, ``out0``
    ... ``out7`` the outputs (high nibbles' values of bytes 0-3, then the low nibbles')."""
    ops: list[tuple] = []
    for k, row in enumerate(planes(code)):
        for g, word in enumerate(row):
            ops.append(("mov", f"p{k}{g}", word))
    ops += [("and", "sl", "x", 0x7777), ("shr", "sh", "x", 16), ("and", "sh", "sh", 0x7777),
            ("shl", "x4", "x", 4),
            # sign-replicating selectors: byte i of the mask is bit 3 of nibble i (bytes 0-1, then 2-3)
            ("prmt", "ml", "x4", "x", 0xD9C8), ("prmt", "mh", "x4", "x", 0xFBEA)]
    for half, sel, mask in (("L", "sl", "ml"), ("H", "sh", "mh")):
        for k in range(4):
            ops += [("prmt", "a", f"p{k}0", f"p{k}1", sel), ("prmt", "b", f"p{k}2", f"p{k}3", sel),
                    ("lop3", f"v{k}{half}", "a", "b", mask, KEEP_HIGH_BY_MASK)]
        # each plane holds byte k of the half's values [low0, high0, low1, high1]: transpose
        ops += [("prmt", "ta", f"v0{half}", f"v1{half}", 0x5140), ("prmt", "tb", f"v2{half}", f"v3{half}", 0x5140),
                ("prmt", f"w0{half}", "ta", "tb", 0x5410), ("prmt", f"w1{half}", "ta", "tb", 0x7632),
                ("prmt", "ta", f"v0{half}", f"v1{half}", 0x7362), ("prmt", "tb", f"v2{half}", f"v3{half}", 0x7362),
                ("prmt", f"w2{half}", "ta", "tb", 0x5410), ("prmt", f"w3{half}", "ta", "tb", 0x7632)]
    # out0-3: byte 0-3's high nibble (value 1 and 3 of each half); out4-7: the low nibbles'
    for i, src in enumerate(("w1L", "w3L", "w1H", "w3H", "w0L", "w2L", "w0H", "w2H")):
        ops.append(("mov", f"out{i}", src))
    return ops


def asm(code) -> str:
    """:func:`program` as PTX for ``tl.inline_asm_elementwise`` (constraints: eight ``=r``, one ``r``)."""
    names = {"x": "$8", **{f"out{i}": f"${i}" for i in range(8)}}
    lines = []
    declared = []
    for op, dst, *src in program(code):
        for r in (dst, *[s for s in src if isinstance(s, str)]):
            if r not in names:
                names[r] = f"%nf4_{r}"
                declared.append(names[r])

        def o(s):
            return names[s] if isinstance(s, str) else f"0x{s:08X}"

        if op == "mov":
            lines.append(f"mov.b32 {o(dst)}, {o(src[0])};")
        elif op in ("and", "shl", "shr"):
            lines.append(f"{op}.b32 {o(dst)}, {o(src[0])}, {int(src[1]) if op != 'and' else o(src[1])};")
        elif op == "prmt":
            lines.append(f"prmt.b32 {o(dst)}, {o(src[0])}, {o(src[1])}, {o(src[2])};")
        elif op == "lop3":
            lines.append(f"lop3.b32 {o(dst)}, {o(src[0])}, {o(src[1])}, {o(src[2])}, 0x{src[3]:02X};")
    return "{\n.reg .b32 " + ", ".join(declared) + ";\n" + "\n".join(lines) + "\n}"
