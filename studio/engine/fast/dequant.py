"""NF4 dequantization in one Triton kernel, double-quantized scales included.

bitsandbytes dequantizes a double-quantized NF4 weight in three kernels: the 8-bit scales to fp32
(``dequantize_blockwise``), the offset added to them, and the 4-bit values times their block's
scale. The last one ran at about 58% of an H100's memory bandwidth in the fast path's profiles
(bench/results/archive/h100_v8_profile_c.json: 23-26 ms of a step's dequantizations, every step, whatever
the batch). This kernel does all three in one pass: each program reads a run of 4-bit blocks and
their 8-bit scales, and writes the compute-dtype weight.

The values are bitsandbytes' to the bit: the same fp32 table lookups, the same products, the same
order (a scale is ``code2[q] * absmax2`` then ``+ offset``, with no fused multiply-add that would
round once instead of twice), one rounding to bf16/fp16 at the end. tests/engine/test_dequant.py checks
this against bitsandbytes itself, in Triton's interpreter on the CPU and compiled on the GPU.

Used by :func:`studio.engine.fast.frozen.dequantize_into` for NF4 weights on CUDA when Triton is
there (and ``trainer.fast_path.kernels`` is on); anything else (FP4, odd block sizes, the CPU) goes
through bitsandbytes.
"""

from __future__ import annotations

import torch

from studio.engine.fast.kernels import OwnKernels, interpreted

BLOCKS_PER_PROGRAM = 64
"""4-bit blocks (of ``blocksize`` values each) one program dequantizes: 4,096 values at the usual
block size of 64."""
NUM_WARPS = 2
"""Warps a program runs on. With the blocks above, the fastest of 20 choices over a 7B layer's seven
weights on an H100 (bench/dequant_speed.py --sweep, bench/results/archive/h100_v11_dequant_sweep.json)."""


KERNELS = OwnKernels("dequant_kernel", ("nf4_dequantize",), "NF4 dequantization kernel",
                     "using bitsandbytes' instead")
"""The kernel, jitted on first use for the interpreter or the compiler as the environment says at
the call (engine/fast/kernels.py), and whether it works here: once it fails to build or run, every
weight goes through bitsandbytes (frozen.dequantize_into)."""


def _kernel():
    """The jitted kernel, or None without Triton. Triton is imported only here, on first use: a CPU
    worker never pays for it."""
    kernels = KERNELS.get()
    return kernels["nf4_dequantize"] if kernels else None


def broken() -> str:
    """Why the kernel failed on this machine ('' while it works)."""
    return KERNELS.broken


def available(device: torch.device) -> bool:
    """Whether :class:`NF4Weight` can run on ``device``: CUDA with Triton, or anywhere under
    Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return KERNELS.usable(device)


def supports(state, dtype: torch.dtype) -> bool:
    """Whether the kernel covers this bitsandbytes ``QuantState`` dequantized to ``dtype``."""
    if str(state.quant_type) != "nf4" or dtype not in (torch.bfloat16, torch.float16):
        return False
    blocksize = int(state.blocksize)
    if blocksize < 2 or blocksize & (blocksize - 1):
        return False
    if state.nested:
        inner = int(state.state2.blocksize)
        if inner < 1 or state.absmax.dtype != torch.uint8:
            return False
    return True


class NF4Weight:
    """One NF4 weight's kernel arguments, on its device, gathered once (a CUDA graph's capture must
    not copy them there, and a product should not pay for it every call). Double-quantized block
    scales are expanded by the kernel itself."""

    def __init__(self, state, device: torch.device):
        self.blocksize = int(state.blocksize)
        self.nested = bool(state.nested)
        self.code = state.code.to(device=device, dtype=torch.float32)
        if self.nested:
            self.scales = state.absmax.to(device)
            self.code2 = state.state2.code.to(device=device, dtype=torch.float32)
            self.absmax2 = state.state2.absmax.to(device=device, dtype=torch.float32)
            offset = state.offset if torch.is_tensor(state.offset) else torch.tensor(float(state.offset))
            self.offset = offset.to(device=device, dtype=torch.float32).reshape(1)
            self.inner = int(state.state2.blocksize)
        else:
            self.scales = state.absmax.to(device=device, dtype=torch.float32)
            # Unread when not nested (the kernel's NESTED is False): any pointer will do.
            self.code2 = self.absmax2 = self.offset = self.scales
            self.inner = 1

    def __call__(self, packed: torch.Tensor, out: torch.Tensor, window: tuple[int, int, int] | None = None) -> None:
        """Write the weight (``packed``: bitsandbytes' uint8 storage, two values a byte) into
        ``out``, in ``out``'s dtype. ``window`` ``(row_values, first_value, values)``: only part
        of it, the stored values seen as rows of ``row_values`` and ``values`` of each row from
        ``first_value`` on (all three multiples of the block size), written one row after another."""
        kernel = _kernel()
        assert kernel is not None, "Triton is not installed"
        assert out.is_contiguous(), "the kernel writes a contiguous weight"
        numel = out.numel()
        blocks = -(-numel // self.blocksize)
        source_numel = packed.numel() * 2
        if window is None:
            row_blocks, first, width = blocks, 0, blocks
        else:
            row_values, first_value, values = window
            assert not (row_values % self.blocksize or first_value % self.blocksize or values % self.blocksize), \
                "a window of whole blocks"
            row_blocks, first, width = (v // self.blocksize for v in (row_values, first_value, values))
            assert numel == source_numel // row_values * values, "the window's values fill the output"
        grid = (-(-blocks // BLOCKS_PER_PROGRAM),)
        # enable_fp_fusion=False: bitsandbytes rounds code2[q] * absmax2 before adding the offset;
        # a fused multiply-add would round once and differ in the last bit.
        kernel[grid](packed, self.scales, self.code2, self.absmax2, self.offset, self.code, out, numel,
                     blocks, width, row_blocks, first, source_numel,
                     NESTED=self.nested, HALF=self.blocksize // 2, BLOCKSIZE2=self.inner,
                     ROWS=BLOCKS_PER_PROGRAM, num_warps=NUM_WARPS, enable_fp_fusion=False,
                     ROUND_BY_HAND=out.dtype == torch.bfloat16 and interpreted())
