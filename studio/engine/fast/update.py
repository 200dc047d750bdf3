"""The LoRA update added where a product's output is read, instead of written out on its own.

A fused LoRA product (products.LoraProduct) writes its output twice: the update's product
``scale * (x A^T) B^T`` (inner size the rank) writes all of it, and the base product then adds
itself in its epilogue. On a 7B step at micro-batch 16 the update's writes are about 20 ms
(bench/results/archive/h100_v16_profile.json), most of them gate/up's two 11008-wide outputs. Here the
base product writes the output alone, and the kernel that reads it next adds the update tile by
tile from ``x A^T`` (``[tokens, rank]``) and ``B^T`` (``[rank, columns]``):

- :class:`LoraGated`: the gated activation (SwiGLU, or Gemma's GeGLU: GELU's tanh form) over
  gate/up's base output plus the update; its backward computes the update again the same way and
  writes the gradients of gate and up (with their updates) in place of the base output. Those
  gradients are the product's output gradient, so the product's backward (the adapters' gradients,
  the input's) is unchanged. Gate and up are read where the product wrote them: no copies of either
  half (liger's GELU-and-multiply kernel takes them contiguous, so it copies both, and its backward
  gives two gradients that autograd concatenates again).
- :func:`add_update_and_residual_`: o's and down's ``residual + (base + update)``, the update
  meeting the base output first and the residual stream last, as in products.LoraProduct.
- :class:`Handoff`: the backward's counterpart for down. Its input gradient is
  ``dy W + (s dy B) A``; the second term (inner size the rank) is handed to the activation's
  backward, which adds it to the gradient it reads, instead of being written out first.

Numerics: gate and up keep their update in fp32 through the activation and the product (one
rounding fewer than the output written in bf16 and read back, and than transformers' activation
rounded before its product); o's and down's sum is rounded to bf16 before the stream as before.
CUDA with Triton only (or Triton's interpreter, for the CPU tests); elsewhere the fused products
keep their own order.
"""

from __future__ import annotations

import torch

from studio.engine.fast.kernels import OwnKernels, interpreted

BLOCK_M = 32
BLOCK_N = 128
NUM_WARPS = 4
"""Rows, columns and warps of a tile: the forward's and the residual's fastest of eight shapes on an
H100 (bench/update_kernels.py --sweep, bench/results/archive/h100_v16_update_kernels_c.json)."""
BACKWARD_BLOCK = (16, 256)
"""The SwiGLU backward's tile (rows, columns): its fastest there (4% ahead of 32 x 128)."""

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gated activations the kernels compute, as transformers names them (core/decoder's
``DecoderSpec.activation``): SiLU (SwiGLU) and GELU's tanh form (Gemma's GeGLU)."""


KERNELS = OwnKernels("update_kernels", ("gated_forward", "gated_backward", "residual_update"),
                     "LoRA update kernels", "adding the updates in their own products instead",
                     per_batch=("n_rows",), helpers=("gelu_tanh",))


def _kernels():
    return KERNELS.get()


def broken() -> str:
    """Why the kernels failed on this machine ('' while they work): the products then keep their
    own order (products.LoraProduct)."""
    return KERNELS.broken


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels can run on ``device`` for outputs in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16) and KERNELS.usable(device)


def _rank_block(rank: int) -> int:
    """The rank rounded up to a power of two of at least 16 (the tensor cores' smallest inner size)."""
    return max(16, 1 << max(0, rank - 1).bit_length())


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return (-(-rows // BLOCK_M), -(-cols // BLOCK_N))


def _rows_major(t: torch.Tensor) -> torch.Tensor:
    # B^T is often a view of B (a single adapter's): its columns one rank apart, read by every tile
    # of rows. A row-major copy (rank x columns, a few hundred KB) lets them load as vectors.
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_f32() -> bool:
    return interpreted()


def _split(xa: torch.Tensor | None, split: tuple[int, int, int, int] | None) -> tuple[int, int, int, int]:
    """Gate's and up's rows of ``xa`` and ``bt``: (first, count) each; all of them for both when the
    caller does not say (right for any ``bt``, block-diagonal or not)."""
    if xa is None:
        return 0, 0, 0, 0
    if split is None:
        rank = int(xa.shape[1])
        return 0, rank, 0, rank
    return split


def gated(gu: torch.Tensor, xa: torch.Tensor | None, bt: torch.Tensor | None, scale: float,
          split: tuple[int, int, int, int] | None = None, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` of ``gu + scale * xa @ bt`` (``gu``: ``[rows, 2 * ffn]``, gate first;
    ``split``: see :func:`_split`; ``activation``: one of :data:`ACTIVATIONS`)."""
    rows, width = gu.shape
    ffn = width // 2
    out = gu.new_empty(rows, ffn)
    k_gate, r_gate, k_up, r_up = _split(xa, split)
    xa_, bt_ = (_rows_major(xa), _rows_major(bt)) if xa is not None else (gu, gu)
    _kernels()["gated_forward"][_grid(rows, ffn)](
        gu, xa_, bt_, out, rows, ffn, k_gate, r_gate, k_up, r_up, float(scale), gu.stride(0), xa_.stride(0),
        bt_.stride(0), out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, RANK=_rank_block(max(r_gate, r_up)),
        GATE=r_gate > 0, UP=r_up > 0, DOT_F32=_dot_f32(), GELU=_gelu(activation), num_warps=NUM_WARPS)
    return out


def _gelu(activation: str) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"the update kernels compute {' and '.join(ACTIVATIONS)}, not {activation}")
    return activation == "gelu_pytorch_tanh"


def gated_backward_(gu: torch.Tensor, xa: torch.Tensor | None, bt: torch.Tensor | None, scale: float,
                    dout: torch.Tensor, split: tuple[int, int, int, int] | None = None,
                    extra: tuple[torch.Tensor, torch.Tensor] | None = None, activation: str = "silu") -> torch.Tensor:
    """The gradient of :func:`gated`'s ``gu + update`` from its output's, written over ``gu``;
    ``extra`` ``(dyb, a)``: the output's gradient is ``dout + dyb @ a`` (:class:`Handoff`)."""
    rows, width = gu.shape
    ffn = width // 2
    k_gate, r_gate, k_up, r_up = _split(xa, split)
    xa_, bt_ = (_rows_major(xa), _rows_major(bt)) if xa is not None else (gu, gu)
    dout = _rows_major(dout)
    dyb, a = (_rows_major(extra[0]), _rows_major(extra[1])) if extra is not None else (gu, gu)
    r_extra = int(dyb.shape[1]) if extra is not None else 0
    block_m, block_n = BACKWARD_BLOCK
    _kernels()["gated_backward"][(-(-rows // block_m), -(-ffn // block_n))](
        gu, xa_, bt_, dout, gu, dyb, a, rows, ffn, k_gate, r_gate, k_up, r_up, r_extra, float(scale),
        gu.stride(0), xa_.stride(0), bt_.stride(0), dout.stride(0), dyb.stride(0), a.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, RANK=_rank_block(max(r_gate, r_up)), GATE=r_gate > 0, UP=r_up > 0,
        EXTRA=extra is not None, RANK_EXTRA=_rank_block(r_extra), DOT_F32=_dot_f32(), GELU=_gelu(activation),
        num_warps=NUM_WARPS)
    return gu


class Handoff:
    """The down product's LoRA input-gradient term ``dyb @ A``, handed to the gated activation's
    backward instead of written: that backward adds it tile by tile to the gradient it reads (the
    down product's backward writes only its base product's share). One per layer pass: the down
    product's backward puts the term here (:meth:`give`), and the activation's, which autograd runs
    right after it (the activation's output is the down product's input), takes it (:meth:`take`)."""

    def __init__(self) -> None:
        self._term: tuple[torch.Tensor, torch.Tensor] | None = None

    def give(self, dyb: torch.Tensor, a: torch.Tensor) -> None:
        self._term = (dyb, a)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        term, self._term = self._term, None
        return term


def add_update_and_residual_(y: torch.Tensor, xa: torch.Tensor, bt: torch.Tensor, scale: float,
                             residual: torch.Tensor) -> torch.Tensor:
    """``y = residual + round(y + scale * xa @ bt)``, in place (``y``: the base product's output)."""
    rows, cols = y.shape
    assert y.stride(1) == 1 and residual.stride(1) == 1
    xa, bt = _rows_major(xa), _rows_major(bt)
    rank = int(xa.shape[1])
    _kernels()["residual_update"][_grid(rows, cols)](
        y, xa, bt, residual, rows, cols, rank, float(scale), y.stride(0), xa.stride(0), bt.stride(0),
        residual.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, RANK=_rank_block(rank), DOT_F32=_dot_f32(),
        num_warps=NUM_WARPS)
    return y


class LoraGated(torch.autograd.Function):
    """The gated activation (``activation``, one of :data:`ACTIVATIONS`) of gate/up's base output
    ``gu`` plus its LoRA update ``scale * xa @ bt``, where ``gu`` stands for the whole output
    (products.DeferredLoraProduct returns it so): the gradient returned for ``gu`` is the whole
    output's, written over ``gu`` (nothing else reads it), and ``xa`` and ``bt`` get none here (the
    product's backward gives the adapters theirs)."""

    @staticmethod
    def forward(ctx, gu, xa, bt, scale: float, split: tuple[int, int, int, int] | None = None,
                handoff: Handoff | None = None, activation: str = "silu"):
        gu2 = gu.reshape(-1, gu.shape[-1])
        out = gated(gu2, xa, bt, scale, split, activation)
        ctx.save_for_backward(gu2, xa, bt)
        ctx.scale, ctx.shape, ctx.split, ctx.handoff, ctx.activation = scale, gu.shape, split, handoff, activation
        return out.view(*gu.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dout):
        gu2, xa, bt = ctx.saved_tensors
        extra = ctx.handoff.take() if ctx.handoff is not None else None
        dgu = gated_backward_(gu2, xa, bt, ctx.scale, dout.reshape(-1, dout.shape[-1]), ctx.split, extra,
                              ctx.activation)
        return dgu.view(ctx.shape), None, None, None, None, None, None
