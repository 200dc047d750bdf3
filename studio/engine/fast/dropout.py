"""Adapter dropout whose masks are a function of (step seed, site, element): nothing to save, nothing
to replay, and the same mask wherever it is asked for again.

PEFT draws each adapter's dropout mask from the global RNG. Two things on the fast path cannot
live with that: a CUDA graph would replay the mask it captured on every step, and a recomputed
layer (checkpointing, host-held inputs) must draw the same mask as its forward did, which needs the
RNG state saved and restored around every layer. Here a mask element is kept when a
counter-based random number of (seed, site, index) is at least ``p``:

- the **seed** is one int64 on the device (:class:`DropoutSeed`), set before each micro-batch from
  the CPU generator (so a resumed run draws the same seeds: the trainer checkpoints that generator);
  a graph reads it from its fixed address, so each replay gets that step's masks;
- the **site** numbers one adapter in the model (layer, projection, adapter), so masks differ
  between adapters as PEFT's do;
- the forward, the recomputation and the backward regenerate the mask instead of keeping it (the
  backward needs it twice: for the input's gradient and for the adapter's own).

On CUDA the mask is made inside one Triton kernel (Philox, ``tl.rand``), reading ``x`` once and
writing the masked, rescaled copy; elsewhere (CPU, or no Triton) a torch hash of the same inputs does
it. The two give different masks; each is deterministic on its own.
"""

from __future__ import annotations

import torch

_TRITON = None  # the kernel once loaded; False when Triton is unavailable

BLOCK = 1024
"""Elements one program of the Triton kernel masks."""


class DropoutSeed:
    """The current micro-batch's mask seed, one int64 tensor on the training device."""

    def __init__(self, device: torch.device):
        self.tensor = torch.zeros(1, dtype=torch.int64, device=device)

    def advance(self) -> None:
        """A fresh seed for the next micro-batch, drawn from torch's CPU generator."""
        self.tensor.fill_(int(torch.randint(0, 2**62, (1,)).item()))


def dropout(x: torch.Tensor, p: float, seed: torch.Tensor, site: int, out: torch.Tensor | None = None,
            accumulate: bool = False) -> torch.Tensor:
    """``x`` with elements dropped at rate ``p`` and the rest scaled by ``1 / (1 - p)``, under the mask
    that (``seed``, ``site``) give; with ``accumulate``, the result is added into ``out`` instead."""
    if p <= 0:
        if out is None:
            return x
        return out.add_(x) if accumulate else out.copy_(x)
    x = x.contiguous()
    kernel = _triton_kernel() if x.is_cuda else False
    if kernel:
        if out is None:
            out = torch.empty_like(x)
            accumulate = False
        n = x.numel()
        kernel[(triton_cdiv(n, BLOCK),)](x, out, seed, n, float(p), 1.0 / (1.0 - p), site_key(site),
                                         ACCUMULATE=accumulate, BLOCK=BLOCK)
        return out
    if out is None and x.requires_grad:  # differentiable as written (tests use it in PEFT's place)
        return x * keep_mask(x.numel(), p, seed, site).view(x.shape).to(x.dtype) * (1.0 / (1.0 - p))
    # In chunks: the hash's int64 temporaries are 8 bytes an element (a 7B model's down_proj input
    # at 8192 tokens has 90M elements).
    if out is None:
        out, accumulate = torch.empty_like(x), False
    flat_x, flat_out = x.view(-1), out.view(-1)
    for start in range(0, flat_x.numel(), _CHUNK):
        piece = flat_x[start:start + _CHUNK]
        keep = keep_mask(piece.numel(), p, seed, site, offset=start)
        masked = piece * keep.to(piece.dtype) * (1.0 / (1.0 - p))
        target = flat_out[start:start + _CHUNK]
        target.add_(masked) if accumulate else target.copy_(masked)
    return out


_CHUNK = 1 << 22


# splitmix64's constants, as signed int64 (torch's integer arithmetic wraps around)
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64
_SITE = 0x2545F4914F6CDD1D


def _shift(h: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (h >> bits) & ((1 << (64 - bits)) - 1)


def _wrap(value: int) -> int:
    """``value`` as the signed int64 that two's-complement arithmetic would leave."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def keep_mask(n: int, p: float, seed: torch.Tensor, site: int, offset: int = 0) -> torch.Tensor:
    """The torch version's mask for elements ``offset .. offset + n``: bool, True where kept
    (splitmix64 of the element's counter)."""
    h = torch.arange(offset, offset + n, dtype=torch.int64, device=seed.device) * _GAMMA
    h = h + (seed * _MIX2 + _wrap(site * _SITE))
    h = (h ^ _shift(h, 30)) * _MIX1
    h = (h ^ _shift(h, 27)) * _MIX2
    h = h ^ _shift(h, 31)
    uniform = _shift(h, 40).to(torch.float32) * (1.0 / (1 << 24))  # 24 high bits -> [0, 1)
    return uniform >= p


def site_key(site: int) -> int:
    """What the Triton kernel mixes into the seed for ``site``, computed here: Triton passes a small
    int argument as a constant (1) or an int32, so the kernel must not do int64 arithmetic on it."""
    return _wrap(site * _SITE)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_kernel():
    """The fused Triton kernel, or False where Triton is not installed or fails its self-check."""
    global _TRITON
    if _TRITON is None:
        try:
            kernel = _build_kernel()
            _TRITON = kernel if _self_check(kernel) else False
        except Exception:  # noqa: BLE001 - no Triton (or no GPU compiler): the torch version works
            _TRITON = False
    return _TRITON


def _self_check(kernel) -> bool:
    """Run both variants once (compiling them before any CUDA graph capture) and check what the
    backward relies on: a mask that depends on the seed and site only, the same in the plain and the
    accumulating variant, at the asked rate, with the kept elements rescaled."""
    device = torch.device("cuda", torch.cuda.current_device())
    n, p = 1 << 16, 0.25
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    seed = torch.tensor([1234567], device=device, dtype=torch.int64)
    expected = (x.float() * (1.0 / (1.0 - p))).to(torch.bfloat16).float()
    masks = []
    for site in (0, 1, 3):  # (0 and 1 are the values Triton specializes)
        outs = []
        for accumulate in (False, False, True):
            out = torch.zeros_like(x) if accumulate else torch.empty_like(x)  # 0 + y is y exactly
            kernel[(triton_cdiv(n, BLOCK),)](x, out, seed, n, p, 1.0 / (1.0 - p), site_key(site),
                                             ACCUMULATE=accumulate, BLOCK=BLOCK)
            outs.append(out.float())
        kept = outs[0] != 0
        rate = kept.float().mean().item()
        if not (torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
                and abs(rate - (1 - p)) < 0.02 and torch.equal(outs[0][kept], expected[kept])):
            return False
        masks.append(kept)
    return not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["site_key"])
    def _dropout_kernel(x_ptr, out_ptr, seed_ptr, n, p, scale, site_key, ACCUMULATE: tl.constexpr,
                        BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        seed = tl.load(seed_ptr) ^ site_key
        uniform = tl.rand(seed, offsets)
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = tl.where(uniform >= p, x * scale, 0.0)
        if ACCUMULATE:
            y += tl.load(out_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=inside)

    return _dropout_kernel
