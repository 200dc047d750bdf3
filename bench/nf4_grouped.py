"""A probe's grouped products that read NF4 experts where they are stored (bench/nf4_grouped_probe.py).

A sparse layer's products (studio/engine/fast/moe.py) dequantize every expert of a projection into a
bf16 workspace, then run torch's grouped product over it. Where each expert gets few rows that costs
more than the products: gpt-oss-120b at 2,048 tokens gives each of its 128 experts 64 rows, and
writing then reading 6.4 GB of bf16 weights a layer a pass outweighed the products (the 27th
session's measurement, bench/NOTES.md section 13). Here one kernel (nf4_grouped_kernels.py) decodes
each tile of 4-bit values in registers and multiplies it, never writing the weight; the values it
multiplies are dequant.py's to the bit. Measured on an H200 in the 28th session (NOTES section 14):
at best level with the dequantize way, so the engine does not use it.

:class:`Nf4Products` holds one projection's stored weight (engine/quantized_experts.py's
``PackedExperts``: ``[experts, A, B]`` packed along ``B``) and computes either product a layer needs
of it, over a window of the weight (a part of gate/up, moe.py's ``PARTS``):

- :meth:`Nf4Products.reduce_b`: ``x @ W_e[a, b]^T`` over ``b`` (Qwen3's, Mixtral's, OLMoE's forward:
  ``[experts, out, in]``; gpt-oss' backward, ``[experts, in, out]``);
- :meth:`Nf4Products.reduce_a`: ``x @ W_e[a, b]`` over ``a`` (gpt-oss' forward; the others' backward).

CUDA with Triton only, or Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import torch

from bench.nf4_decode_asm import NF4
from studio.engine.fast import dequant
from studio.engine.fast.kernels import OwnKernels, interpreted

REDUCE_B = {"BLOCK_M": 64, "BLOCK_N": 128, "TWO": True, "TREE": True, "LINEAR": False, "ASM": False, "X_SPLIT": True,
            "num_warps": 4, "num_stages": 3}
""":func:`reduce_b`'s tile: rows of one expert and output columns a program, two 4-bit blocks a
step of the reduction (``TWO``), the code decoded by a tree of selects (``TREE``: no load a value);
``LINEAR``, ``ASM`` and ``X_SPLIT`` as nf4_grouped_kernels.py says. The best of the 28th session's
sweeps with the tree (X_SPLIT: 3.17 ms where loading the even and odd columns apart took 7.42)."""
REDUCE_A = {"BLOCK_M": 64, "BLOCK_K": 128, "TWO": True, "TREE": True, "LINEAR": False, "ASM": False,
            "num_warps": 4, "num_stages": 3}
""":func:`reduce_a`'s tile: rows of one expert a program, rows of the weight a step of the
reduction, two 4-bit blocks of output columns a program (``TWO``)."""

KERNELS = OwnKernels("bench.nf4_grouped_kernels", ("reduce_b", "reduce_a"), "NF4 grouped-product kernels",
                     "dequantizing the experts into the workspace instead",
                     helpers=("add", "tile_of", "scales", "pair_scales", "decode", "decode_bytes", "weight"))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels can run on ``device`` for rows in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16) and KERNELS.usable(device)


def supports(state, shape: tuple[int, int, int]) -> bool:
    """Whether the kernels read this bitsandbytes ``QuantState`` of an ``[experts, A, B]`` weight:
    NF4 in blocks of 64 along ``B`` (double-quantized scales or not), each row whole blocks."""
    return (str(state.quant_type) == "nf4" and int(state.blocksize) == 64 and shape[2] % 64 == 0
            and dequant.supports(state, torch.bfloat16))



class Nf4Products:
    """One projection's NF4 experts (``packed``: bitsandbytes' bytes of ``[experts, A, B]``;
    ``state``: its ``QuantState``) and the two grouped products that read them."""

    def __init__(self, packed: torch.Tensor, state, shape: tuple[int, int, int], device: torch.device):
        self.packed = packed
        self.experts, self.A, self.B = shape
        self.nf4 = [float(v) for v in state.code.float().cpu()] == list(NF4)
        """Whether the code is bitsandbytes' NF4 table, which the ``ASM`` decoding holds in its registers."""
        self.args = dequant.NF4Weight(state, device)
        """The scales, tables and offset as the kernels take them (dequant.py's, gathered once)."""

    def _launch(self, name: str, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int],
                out_len: int, tile: dict, across: int) -> torch.Tensor:
        kernel = KERNELS.get()[name]
        a_first, a_len, b_first, b_len = window
        y = torch.empty(x.shape[0], out_len, dtype=x.dtype, device=x.device)
        w = self.args
        grid = (-(-out_len // across), -(-x.shape[0] // tile["BLOCK_M"]) + self.experts)
        assert not tile.get("ASM") or (self.nf4 and not interpreted()), "the ASM decoding: NF4's table, compiled"
        options = {k: v for k, v in tile.items() if not k.startswith("num_")}
        if not interpreted():
            options.update(num_warps=tile["num_warps"], num_stages=tile["num_stages"])
        kernel[grid](x, self.packed, w.scales, w.code2, w.absmax2, w.offset, w.code, offs, y,
                     self.experts, self.A, self.B, a_first, a_len, b_first, b_len, x.stride(0), y.stride(0),
                     EXPERTS=max(16, 1 << (self.experts - 1).bit_length()), BLOCKSIZE=64, NESTED=w.nested,
                     BLOCKSIZE2=w.inner, FP32_DOT=interpreted(),
                     ROUND_BY_HAND=interpreted() and x.dtype == torch.bfloat16, **options)
        return y

    def window(self, a: tuple[int, int] | None = None, b: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """The window of rows ``a`` and columns ``b`` (``(first, length)``; all of them by default)."""
        a = a or (0, self.A)
        b = b or (0, self.B)
        return a[0], a[1], b[0], b[1]

    def reduce_b(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int],
                 tile: dict | None = None) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]^T``: ``x [rows, b_len]`` (rows sorted by expert,
        ``offs`` where each expert's end) -> ``[rows, a_len]``. ``tile``: :data:`REDUCE_B`'s keys."""
        a_first, a_len, b_first, b_len = window
        assert x.shape[1] == b_len and x.stride(1) == 1 and b_len % 64 == 0 and b_first % 64 == 0
        tile = dict(tile or REDUCE_B)
        tile["TWO"] = tile["TWO"] and b_len % 128 == 0
        return self._launch("reduce_b", x, offs, window, a_len, tile, tile["BLOCK_N"])

    def reduce_a(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int],
                 tile: dict | None = None) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]``: ``x [rows, a_len]`` -> ``[rows, b_len]``.
        ``tile``: :data:`REDUCE_A`'s keys."""
        a_first, a_len, b_first, b_len = window
        assert x.shape[1] == a_len and x.stride(1) == 1 and b_len % 64 == 0 and b_first % 64 == 0
        tile = dict(tile or REDUCE_A)
        tile["TWO"] = tile["TWO"] and b_len % 128 == 0
        return self._launch("reduce_a", x, offs, window, b_len, tile, 128 if tile["TWO"] else 64)
