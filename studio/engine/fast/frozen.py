"""The frozen base weights of a fused projection, and the one buffer their 4-bit weights are
dequantized into.

A fused projection (q/k/v, gate/up) reads one input through several frozen weights. Each product
runs one projection at a time, writing its own columns of the output: a 4-bit weight is
dequantized (dequant.py's one kernel, or bitsandbytes') into the model's :class:`Workspace` right
before the product that reads it, so the buffer holds one projection's weight (gate, not gate and
up: -86 MiB on a 7B model), and nothing keeps a dequantized weight past its product.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from studio.engine.fast import dequant


class Workspace:
    """One buffer that every 4-bit weight of the model is dequantized into.

    A dequantized weight lives from its dequantization to the end of the one matrix product that
    reads it (the products never save it), and all of them run in order on one stream, so one
    buffer as large as the widest weight serves them all. Without it each product would allocate
    its own: the allocator then keeps holes of the widest size around, and a CUDA graph's private
    pool keeps about two layers of dequantized weights (bench/results, docs/memory.md).
    """

    def __init__(self) -> None:
        self.numel = 0
        self.buffer: torch.Tensor | None = None

    def reserve(self, numel: int) -> None:
        """Make room for a weight of ``numel`` elements (before :meth:`allocate`)."""
        self.numel = max(self.numel, numel)

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the buffer now, before any CUDA graph capture (a capture must not allocate it)."""
        if self.numel and (self.buffer is None or self.buffer.numel() < self.numel):
            self.buffer = torch.empty(self.numel, dtype=dtype, device=device)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        """The buffer's first ``rows x cols`` elements as a matrix (valid until the next take)."""
        assert self.buffer is not None and rows * cols <= self.buffer.numel(), "workspace not allocated"
        return self.buffer[:rows * cols].view(rows, cols)


class FrozenWeights:
    """The frozen base weights of one or more projections that share an input, multiplied as one
    matrix ``W = [W_0; W_1; ...]`` one projection at a time.

    4-bit weights are dequantized on every call, into ``workspace``; with ``kernel`` (the
    ``trainer.fast_path.kernels`` setting) an NF4 weight goes through dequant.py's one kernel where
    it covers the weight and the device, else through bitsandbytes.
    """

    def __init__(self, bases: Sequence[nn.Module], dtype: torch.dtype, workspace: Workspace, kernel: bool = True,
                 split: Sequence[int] | None = None):
        self.bases = list(bases)
        self.dtype = dtype
        self.out_features = [int(b.out_features) for b in self.bases]
        self.in_features = int(self.bases[0].in_features)
        self.split = list(split) if split is not None else None
        """The output's widths, in order, where one weight holds several projections' rows (Phi-3's
        qkv_proj: q, k, v): :meth:`groups` gives each its rows; None: a group per weight."""
        assert self.split is None or (len(self.bases) == 1 and sum(self.split) == self.out_features[0])
        biases = [getattr(b, "bias", None) for b in self.bases]
        self.bias: torch.Tensor | None = None
        """The frozen biases of the whole output (zeros for a weight without one) in the compute
        dtype, added by the products (:meth:`biased_product`); None where no weight has one."""
        if any(b is not None for b in biases):
            with torch.no_grad():
                self.bias = torch.cat([b.detach().to(dtype) if b is not None else
                                       torch.zeros(n, dtype=dtype, device=self.bases[0].weight.device)
                                       for b, n in zip(biases, self.out_features, strict=True)])
        self.quantized = [is_4bit(b) for b in self.bases]
        self.workspace = workspace if any(self.quantized) else None
        if self.workspace is not None:
            self.workspace.reserve(max(self.out_features) * self.in_features)
        self.kernels: list[dequant.NF4Weight | None] = []
        """Each 4-bit weight's one-kernel dequantization (dequant.py), where it covers the weight."""
        for base, q in zip(self.bases, self.quantized, strict=True):
            device = base.weight.device
            covered = q and kernel and dequant.supports(base.weight.quant_state, dtype) and dequant.available(device)
            self.kernels.append(dequant.NF4Weight(base.weight.quant_state, device) if covered else None)

    def piece(self, index: int) -> torch.Tensor:
        """Projection ``index``'s weight ``[out_features[index], in_features]`` in the compute dtype
        (a 4-bit one dequantized into the workspace: valid until the next piece)."""
        base = self.bases[index]
        if not self.quantized[index]:
            return base.weight.to(self.dtype)
        out = self.workspace.take(self.out_features[index], self.in_features)
        dequantize_into(base, out, self.kernels[index])
        return out

    def columns(self) -> Iterator[tuple[int, slice]]:
        """Each projection's index and its columns of the fused output."""
        row = 0
        for index, n in enumerate(self.out_features):
            yield index, slice(row, row + n)
            row += n

    def groups(self) -> Iterator[tuple[int, slice | None, slice]]:
        """Each output read apart (q, k and v): the weight's index, its rows of that weight (None:
        all of them) and its columns of the fused output. A group per weight (:meth:`columns`), or
        per width of :attr:`split`."""
        if self.split is None:
            for index, cols in self.columns():
                yield index, None, cols
            return
        row = 0
        for n in self.split:
            yield 0, slice(row, row + n), slice(row, row + n)
            row += n

    def biased_product(self, x2: torch.Tensor) -> torch.Tensor:
        """``bias + x2 @ W^T`` (a new tensor), each weight's bias the base of its product."""
        if len(self.bases) == 1:
            return torch.addmm(self.bias, x2, self.piece(0).t())
        y = x2.new_empty(x2.shape[0], sum(self.out_features))
        for index, cols in self.columns():
            torch.addmm(self.bias[cols], x2, self.piece(index).t(), out=y[:, cols])
        return y

    def forward_product(self, x2: torch.Tensor, into: torch.Tensor | None = None,
                        base: torch.Tensor | None = None) -> torch.Tensor:
        """``x2 @ W^T``: ``[tokens, sum(out_features)]``; added to ``into`` in place when given
        (the product's epilogue reads it: no pass of its own), or written beside ``base`` (the
        result is ``base + x2 @ W^T``, a new tensor)."""
        if len(self.bases) == 1:
            w = self.piece(0).t()
            if into is not None:
                return into.addmm_(x2, w)
            return x2 @ w if base is None else torch.addmm(base, x2, w)
        y = into if into is not None else x2.new_empty(x2.shape[0], sum(self.out_features))
        for index, cols in self.columns():
            # A column block of a row-major output is a strided matrix cuBLAS writes in place.
            w = self.piece(index).t()
            if into is not None:
                y[:, cols].addmm_(x2, w)
            elif base is not None:
                torch.addmm(base[:, cols], x2, w, out=y[:, cols])
            else:
                torch.mm(x2, w, out=y[:, cols])
        return y

    def backward_product(self, dy2: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``dy2 @ W``: ``[tokens, in_features]``, summed over the projections; added to ``into``
        in place when given (in the products' epilogues)."""
        if len(self.bases) == 1:
            w = self.piece(0)
            return dy2 @ w if into is None else into.addmm_(dy2, w)
        return self.backward_blocks([dy2[:, cols] for _, _, cols in self.groups()], into)

    def backward_blocks(self, blocks: Sequence[torch.Tensor], into: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_j blocks[j] @ W_j``: the input gradient from each output group's gradient
        (:meth:`groups`; added to ``into`` in place when given)."""
        dx = into
        held = None
        for (index, rows, _), block in zip(self.groups(), blocks, strict=True):
            if index != held:  # a weight split in groups is dequantized once for all of them
                whole, held = self.piece(index), index
            w = whole if rows is None else whole[rows]
            if dx is None:
                dx = block @ w
            else:
                dx.addmm_(block, w)
        return dx


def is_4bit(module: nn.Module) -> bool:
    """Whether ``module``'s weight is a bitsandbytes 4-bit parameter (NF4 or FP4)."""
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def expanded_absmax(state) -> torch.Tensor:
    """A 4-bit weight's block scales in fp32 (double-quantized ones expanded, as bitsandbytes does)."""
    import bitsandbytes.functional as bnbf

    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        return absmax.float()
    return state.absmax.float()


def dequantize_into(base: nn.Module, out: torch.Tensor, kernel: dequant.NF4Weight | None = None) -> None:
    """Write ``base``'s 4-bit weight into ``out`` in ``out``'s dtype (:func:`dequantize_packed`)."""
    dequantize_packed(base.weight.data, base.weight.quant_state, out, kernel)


def dequantize_packed(packed: torch.Tensor, state, out: torch.Tensor, kernel: dequant.NF4Weight | None = None) -> None:
    """Write the 4-bit values ``packed`` (bitsandbytes' uint8 storage) with their ``QuantState``
    into ``out`` in ``out``'s dtype: through ``kernel`` (the scales included, dequant.py) where
    given and working, else bitsandbytes' kernels."""
    if kernel is not None:
        done, _ = dequant.KERNELS.attempt(lambda: kernel(packed, out))
        if done:
            return
    args = (packed, expanded_absmax(state), state.blocksize, state.quant_type, out.shape, out.dtype)
    if out.device.type == "cuda":
        torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=out)
    else:  # bitsandbytes' CPU backend has no out= variant
        # and its kernel starts a block at every row, where the values were quantized in one run of
        # blocks: rows whose length is not a multiple of the block (a tiny model's 32-wide experts)
        # would take the wrong scales, so the weight goes in as one row
        flat = (*args[:4], (out.numel(),), out.dtype)
        out.copy_(torch.ops.bitsandbytes.dequantize_4bit.default(*flat).view(out.shape))
