"""MXFP4 dequantization in one Triton kernel: gpt-oss' expert weights from their blocks and scales.

engine/mxfp4.py's torch way looks each code byte up in a table of value pairs, multiplies by the
block's power of two and copies the result into place, in chunks: about 14 bytes move per value,
where reading the 17 bytes of a 32-value block and writing its values (2 bytes each in bf16) is
about 2.5. This kernel does that one pass: each program reads a tile of rows x blocks, 16 code
bytes and one scale byte a block, and writes their 32 values each, contiguous or through the
strides of a transposed ``[experts, rows, in]`` view (the parameter's layout, for transformers' own
forward).

The values are the torch way's to the bit, every scale byte included (engine/mxfp4.py,
tests/engine/test_mxfp4_kernel.py): each scale's power of two is built from its fp32 bits, as the
torch way builds it, and each value is rounded once, from its exact product, to the output dtype.
Used by :func:`studio.engine.mxfp4.dequantize_mxfp4` on CUDA when Triton is there (and
``trainer.fast_path.kernels`` is on), and under Triton's interpreter on the CPU tests; anything
else, or a kernel that fails here, goes the torch way.
"""

from __future__ import annotations

import torch

from studio.engine.fast.kernels import OwnKernels

# The tile of 24 that bench/dequant_speed.py --mxfp4 --sweep timed fastest on an H200 for both of
# gpt-oss-20b's projections (bench/results/current/h200_mxfp4_dequant_511983e.json: down 279.5 us,
# gate/up 561.9 us; 16 x 8 x 4 took 329.0 and 653.5).
ROWS = 16
"""Rows of the weight one program dequantizes."""
GROUPS = 4
"""32-value blocks of each row one program dequantizes: with :data:`ROWS`, 2,048 values."""
NUM_WARPS = 4
"""Warps a program runs on."""

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Output dtypes the kernel writes."""

KERNELS = OwnKernels("mxfp4_kernel", ("mxfp4_dequantize",), "MXFP4 dequantization kernel",
                     "dequantizing gpt-oss' experts with torch operations instead", helpers=("_fp4",))
"""The kernel, jitted on first use for the interpreter or the compiler as the environment says at
the call (engine/fast/kernels.py), and whether it works here: once it fails to build or run, every
projection is dequantized the torch way (engine/mxfp4.py)."""


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: CUDA with Triton, or anywhere under Triton's
    interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return KERNELS.usable(device)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               window: tuple[int, int] | None = None) -> None:
    """Write the weights ``blocks [..., rows, in / 32, 16]`` and ``scales [..., rows, in / 32]`` (uint8,
    checked to pair up by the caller) stand for into ``out``, in ``out``'s dtype: ``[..., rows, in]``
    contiguous, or a 3-D ``[experts, rows, in]`` of any strides. ``window`` ``(first, count)``: only
    those rows of each expert (``out`` has ``count`` rows an expert)."""
    kernel = KERNELS.get()
    assert kernel is not None, "Triton is not installed"
    groups = int(blocks.shape[-2])
    source_rows = int(blocks.shape[-3])
    first, part = window or (0, source_rows)
    rows = blocks.numel() // (groups * 16) // source_rows * part
    if out.is_contiguous():  # every expert's rows as one run
        per_expert, strides = rows, (0, groups * 32, 1)
    else:
        assert out.dim() == 3, "a strided output is one [experts, rows, in] tensor"
        per_expert, strides = int(out.shape[1]), tuple(out.stride())
    grid = (-(-rows // ROWS), -(-groups // GROUPS))
    kernel["mxfp4_dequantize"][grid](blocks.contiguous(), scales.contiguous(), out, rows, groups, per_expert,
                                     *strides, part, source_rows, first, ROWS=ROWS, GROUPS=GROUPS,
                                     BF16=out.dtype == torch.bfloat16,
                                     num_warps=NUM_WARPS)
