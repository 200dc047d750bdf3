"""Grouped products that read 4-bit experts as stored, for layers of many small experts.

A sparse layer's products (engine/fast/moe.py) dequantize every expert of a projection into the
bf16 workspace, then run torch's grouped product over it. Where each expert gets few rows that costs
more than the products: gpt-oss-120b at 2,048 tokens gives each of its 128 experts 64 rows, and
writing then reading 6.4 GB of bf16 weights a layer a pass outweighed the products (bench/NOTES.md
sections 13-14). Here one kernel (stored_experts_kernels.py) decodes each tile of 4-bit values in
registers and multiplies it, never writing the weight; the values it multiplies are dequant.py's
(NF4) and mxfp4_dequant.py's (gpt-oss' MXFP4) to the bit. On an H200 at gpt-oss-120b's shapes (64
rows an expert, NF4) it takes 1.7 ms where the dequantize way takes 2.95 for gate/up, forward or
backward; at 128 rows an expert (Qwen3-30B-A3B's) the two are level, and at 256 (gpt-oss-20b's) it
takes 1.7x as long (bench/results/current/h200_nf4_grouped_probe_5cf4a4f.json). :func:`worth_it`
says which layers take it.

:class:`StoredProducts` holds one projection's stored weight (``[experts, A, B]`` packed along
``B``: engine/quantized_experts.py's ``PackedExperts``, or engine/mxfp4.py's ``Mxfp4Experts``,
``[experts, out, in]``) and computes either product a layer needs of it, over a window of the weight:

- :meth:`StoredProducts.reduce_b`: ``x @ W_e[a, b]^T`` over ``b`` (the forward of ``[experts, out,
  in]`` weights: Qwen3's, Mixtral's, OLMoE's, MXFP4's; the backward of gpt-oss' NF4 ``[experts, in,
  out]``);
- :meth:`StoredProducts.reduce_a`: ``x @ W_e[a, b]`` over ``a`` (the other two).

CUDA with Triton (the code decoded by byte permutes, engine/fast/fourbit_decode.py), or Triton's
interpreter (the CPU tests: a tree of selects). Where the kernels fail, moe.py dequantizes as before.
"""

from __future__ import annotations

import torch

from studio.engine.fast import dequant
from studio.engine.fast.fourbit_decode import FP4, NF4
from studio.engine.fast.kernels import OwnKernels, interpreted

BLOCK_M = 64
"""Rows of one expert a program multiplies (an expert of :data:`MOST_ROWS` rows: one program a
column tile, its weight decoded once)."""
REDUCE_B = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
""":func:`reduce_b`'s output columns a program, warps and pipeline stages: the fastest of the 28th
session's sweeps at gpt-oss-120b's shapes (bench/results/current/h200_nf4_grouped_probe_5cf4a4f.json)."""
REDUCE_A = {"num_warps": 4, "num_stages": 3}
""":func:`reduce_a`'s warps and stages; its step along the reduction is 128 rows of the weight
where a program's columns are 128 values, else 64 (the faster of each at gpt-oss-120b's gate/up and
down, the same file)."""
MOST_ROWS = 64
"""The most rows an expert gets on average where a layer's products run here (:func:`worth_it`)."""

KERNELS = OwnKernels("stored_experts_kernels", ("reduce_b", "reduce_a"), "4-bit grouped-product kernels",
                     "dequantizing the experts into the workspace instead",
                     helpers=("add", "tile_of", "scales", "pair_scales", "decode_bytes", "tree", "weight",
                              "operands"))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels can run on ``device`` for rows in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16) and KERNELS.usable(device)


def supports(state, shape: tuple[int, ...]) -> bool:
    """Whether the kernels read this bitsandbytes ``QuantState`` of an ``[experts, A, B]`` weight:
    bitsandbytes' NF4 table in blocks of 64 along ``B`` (double-quantized scales or not)."""
    if str(state.quant_type) != "nf4" or int(state.blocksize) != 64 or len(shape) != 3 or shape[2] % 64:
        return False
    return dequant.supports(state, torch.bfloat16) and [float(v) for v in state.code.float().cpu()] == list(NF4)


def worth_it(rows: int, experts: int) -> bool:
    """Whether a layer whose products take ``rows`` sorted rows over ``experts`` experts runs them
    here: where each expert gets :data:`MOST_ROWS` rows or fewer on average, and the kernels have
    not failed in this process."""
    return rows <= MOST_ROWS * experts and not KERNELS.broken


def reader(stored, dtype: torch.dtype) -> StoredProducts | None:
    """The products over ``stored`` (a ``PackedExperts`` or ``Mxfp4Experts``) for rows in ``dtype``,
    where the kernels read its weights here; else None."""
    from studio.engine.mxfp4 import Mxfp4Experts
    from studio.engine.quantized_experts import PackedExperts

    if isinstance(stored, Mxfp4Experts):
        device = stored.device
        return StoredProducts.mxfp4(stored.blocks, stored.scales, device) if available(device, dtype) else None
    if not isinstance(stored, PackedExperts) or not supports(stored.quant_state, stored.shape) \
            or not available(stored.packed.device, dtype):
        return None
    return StoredProducts.nf4(stored.packed, stored.quant_state, stored.shape, stored.packed.device)


class StoredProducts:
    """One projection's 4-bit experts as stored (``packed``: the bytes of ``[experts, A, B]``, two
    values each along ``B``) and the two grouped products that read them. Made by :meth:`nf4` or
    :meth:`mxfp4`."""

    def __init__(self, packed: torch.Tensor, shape: tuple[int, int, int], blocksize: int, mx: bool,
                 scales: torch.Tensor, code: torch.Tensor, nested=None):
        self.packed = packed
        self.experts, self.A, self.B = (int(n) for n in shape)
        self.blocksize = blocksize
        """Values along ``B`` sharing one scale (NF4's 64, MXFP4's 32)."""
        self.mx = mx
        """MXFP4: the low nibble first, a scale an exponent byte."""
        self.scales, self.code = scales, code
        self.nested = nested
        """dequant.py's ``NF4Weight`` where NF4's scales are double-quantized (its tables), else None."""

    @classmethod
    def nf4(cls, packed: torch.Tensor, state, shape: tuple[int, int, int], device: torch.device) -> StoredProducts:
        """bitsandbytes' NF4 bytes and ``QuantState`` (dequant.py's arguments, gathered once)."""
        args = dequant.NF4Weight(state, device)
        return cls(packed, shape, 64, False, args.scales, args.code, args if args.nested else None)

    @classmethod
    def mxfp4(cls, blocks: torch.Tensor, scales: torch.Tensor, device: torch.device) -> StoredProducts:
        """gpt-oss' MXFP4 ``blocks [experts, out, in / 32, 16]`` and ``scales [experts, out, in / 32]``."""
        experts, rows, groups, _ = blocks.shape
        code = torch.tensor(FP4, dtype=torch.float32, device=device)
        return cls(blocks, (experts, rows, groups * 32), 32, True, scales, code)

    def _launch(self, name: str, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int],
                out_len: int, across: int, constants: dict, options: dict) -> torch.Tensor:
        kernel = KERNELS.get()[name]
        a_first, a_len, b_first, b_len = window
        y = torch.empty(x.shape[0], out_len, dtype=x.dtype, device=x.device)
        n = self.nested
        code2, absmax2, offset = (n.code2, n.absmax2, n.offset) if n is not None else (self.code,) * 3
        grid = (-(-out_len // across), -(-x.shape[0] // BLOCK_M) + self.experts)
        run = interpreted()
        kernel[grid](x, self.packed, self.scales, code2, absmax2, offset, self.code, offs, y,
                     self.experts, self.A, self.B, a_first, a_len, b_first, b_len, x.stride(0), y.stride(0),
                     EXPERTS=max(16, 1 << (self.experts - 1).bit_length()), BLOCKSIZE=self.blocksize,
                     NESTED=n is not None, BLOCKSIZE2=n.inner if n is not None else 1, BLOCK_M=BLOCK_M,
                     ASM=not run, MX=self.mx, FP32_DOT=run, ROUND_BY_HAND=run and x.dtype == torch.bfloat16,
                     **constants, **({} if run else options))
        return y

    def _blocks(self, b_len: int) -> int:
        """4-bit blocks a step (a program's columns): as many as make up to 128 values and divide ``b_len``."""
        blocks = 128 // self.blocksize
        while b_len % (blocks * self.blocksize):
            blocks //= 2
        return blocks

    def window(self, a: tuple[int, int] | None = None, b: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """The window of rows ``a`` and columns ``b`` (``(first, length)``; all of them by default)."""
        a = a or (0, self.A)
        b = b or (0, self.B)
        return a[0], a[1], b[0], b[1]

    def _check(self, x: torch.Tensor, width: int, window: tuple[int, int, int, int]) -> None:
        _, _, b_first, b_len = window
        assert x.shape[1] == width and x.stride(1) == 1, "rows of the window's width, contiguous"
        assert b_len % self.blocksize == 0 and b_first % self.blocksize == 0, "a window of whole blocks"

    def reduce_b(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int]) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]^T``: ``x [rows, b_len]`` (rows sorted by expert,
        ``offs`` where each expert's end) -> ``[rows, a_len]``."""
        self._check(x, window[3], window)
        options = {k: v for k, v in REDUCE_B.items() if k.startswith("num_")}
        constants = {"BLOCK_N": REDUCE_B["BLOCK_N"], "BLOCKS": self._blocks(window[3])}
        return self._launch("reduce_b", x, offs, window, window[1], REDUCE_B["BLOCK_N"], constants, options)

    def reduce_a(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int]) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]``: ``x [rows, a_len]`` -> ``[rows, b_len]``."""
        self._check(x, window[1], window)
        blocks = self._blocks(window[3])
        columns = blocks * self.blocksize
        constants = {"BLOCK_K": 128 if columns == 128 else 64, "BLOCKS": blocks}
        return self._launch("reduce_a", x, offs, window, window[3], columns, constants, dict(REDUCE_A))
