"""Grouped products that read NF4 experts where they are stored, for layers of many small experts.

A sparse layer's products (engine/fast/moe.py) dequantize every expert of a projection into the
bf16 workspace, then run torch's grouped product over it. Where each expert gets few rows that costs
more than the products: gpt-oss-120b at 2,048 tokens gives each of its 128 experts 64 rows, and
writing then reading 6.4 GB of bf16 weights a layer a pass outweighed the products (bench/NOTES.md
sections 13-14). Here one kernel (nf4_experts_kernels.py) decodes each tile of 4-bit values in
registers and multiplies it, never writing the weight; the values it multiplies are dequant.py's
to the bit. On an H200 at gpt-oss-120b's shapes (64 rows an expert) it takes 1.7 ms where the
dequantize way takes 2.95 for gate/up, forward or backward; at 128 rows an expert (Qwen3-30B-A3B's)
the two are level, and at 256 (gpt-oss-20b's) it takes 1.7x as long
(bench/results/current/h200_nf4_grouped_probe_5cf4a4f.json). :func:`worth_it` says which layers
take it.

:class:`Nf4Products` holds one projection's stored weight (engine/quantized_experts.py's
``PackedExperts``: ``[experts, A, B]`` packed along ``B``) and computes either product a layer needs
of it, over a window of the weight:

- :meth:`Nf4Products.reduce_b`: ``x @ W_e[a, b]^T`` over ``b`` (Qwen3's, Mixtral's, OLMoE's forward:
  ``[experts, out, in]``; gpt-oss' backward, ``[experts, in, out]``);
- :meth:`Nf4Products.reduce_a`: ``x @ W_e[a, b]`` over ``a`` (gpt-oss' forward; the others' backward).

CUDA with Triton (the code decoded by byte permutes, engine/fast/nf4_decode.py), or Triton's
interpreter (the CPU tests: a tree of selects). Where the kernels fail, moe.py dequantizes as before.
"""

from __future__ import annotations

import torch

from studio.engine.fast import dequant
from studio.engine.fast.kernels import OwnKernels, interpreted
from studio.engine.fast.nf4_decode import NF4

BLOCK_M = 64
"""Rows of one expert a program multiplies (an expert of :data:`MOST_ROWS` rows: one program a
column tile, its weight decoded once)."""
REDUCE_B = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
""":func:`reduce_b`'s output columns a program, warps and pipeline stages: the fastest of the 28th
session's sweeps at gpt-oss-120b's shapes (bench/results/current/h200_nf4_grouped_probe_5cf4a4f.json)."""
REDUCE_A = {"num_warps": 4, "num_stages": 3}
""":func:`reduce_a`'s warps and stages; its step along the reduction is 128 rows of the weight
where a program's columns are two 4-bit blocks, else 64 (the faster of each at gpt-oss-120b's
gate/up and down, the same file)."""
MOST_ROWS = 64
"""The most rows an expert gets on average where a layer's products run here (:func:`worth_it`)."""

KERNELS = OwnKernels("nf4_experts_kernels", ("reduce_b", "reduce_a"), "NF4 grouped-product kernels",
                     "dequantizing the experts into the workspace instead",
                     helpers=("add", "tile_of", "scales", "pair_scales", "decode_bytes", "tree", "weight"))


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


def reader(packed, dtype: torch.dtype) -> Nf4Products | None:
    """The products over ``packed`` (engine/quantized_experts.py's ``PackedExperts``) for rows in
    ``dtype``, where the kernels read its weights here; else None."""
    if not supports(packed.quant_state, packed.shape) or not available(packed.packed.device, dtype):
        return None
    return Nf4Products(packed.packed, packed.quant_state, packed.shape, packed.packed.device)


class Nf4Products:
    """One projection's NF4 experts (``packed``: bitsandbytes' bytes of ``[experts, A, B]``;
    ``state``: its ``QuantState``) and the two grouped products that read them."""

    def __init__(self, packed: torch.Tensor, state, shape: tuple[int, int, int], device: torch.device):
        self.packed = packed
        self.experts, self.A, self.B = (int(n) for n in shape)
        self.args = dequant.NF4Weight(state, device)
        """The scales, tables and offset as the kernels take them (dequant.py's, gathered once)."""

    def _launch(self, name: str, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int],
                out_len: int, across: int, constants: dict, options: dict) -> torch.Tensor:
        kernel = KERNELS.get()[name]
        a_first, a_len, b_first, b_len = window
        y = torch.empty(x.shape[0], out_len, dtype=x.dtype, device=x.device)
        w = self.args
        grid = (-(-out_len // across), -(-x.shape[0] // BLOCK_M) + self.experts)
        run = interpreted()
        kernel[grid](x, self.packed, w.scales, w.code2, w.absmax2, w.offset, w.code, offs, y,
                     self.experts, self.A, self.B, a_first, a_len, b_first, b_len, x.stride(0), y.stride(0),
                     EXPERTS=max(16, 1 << (self.experts - 1).bit_length()), BLOCKSIZE=64, NESTED=w.nested,
                     BLOCKSIZE2=w.inner, BLOCK_M=BLOCK_M, ASM=not run, FP32_DOT=run,
                     ROUND_BY_HAND=run and x.dtype == torch.bfloat16, **constants, **({} if run else options))
        return y

    def window(self, a: tuple[int, int] | None = None, b: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """The window of rows ``a`` and columns ``b`` (``(first, length)``; all of them by default)."""
        a = a or (0, self.A)
        b = b or (0, self.B)
        return a[0], a[1], b[0], b[1]

    def reduce_b(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int]) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]^T``: ``x [rows, b_len]`` (rows sorted by expert,
        ``offs`` where each expert's end) -> ``[rows, a_len]``."""
        a_first, a_len, b_first, b_len = window
        assert x.shape[1] == b_len and x.stride(1) == 1 and b_len % 64 == 0 and b_first % 64 == 0
        options = {k: v for k, v in REDUCE_B.items() if k.startswith("num_")}
        constants = {"BLOCK_N": REDUCE_B["BLOCK_N"], "TWO": b_len % 128 == 0}
        return self._launch("reduce_b", x, offs, window, a_len, REDUCE_B["BLOCK_N"], constants, options)

    def reduce_a(self, x: torch.Tensor, offs: torch.Tensor, window: tuple[int, int, int, int]) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] @ W_e[window]``: ``x [rows, a_len]`` -> ``[rows, b_len]``."""
        a_first, a_len, b_first, b_len = window
        assert x.shape[1] == a_len and x.stride(1) == 1 and b_len % 64 == 0 and b_first % 64 == 0
        two = b_len % 128 == 0
        constants = {"BLOCK_K": 128 if two else 64, "TWO": two}
        return self._launch("reduce_a", x, offs, window, b_len, 128 if two else 64, constants, dict(REDUCE_A))
