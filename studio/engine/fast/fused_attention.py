"""Attention with soft-capped scores (Gemma 2) and attention sinks (gpt-oss) in Triton kernels of
Studio's own (fused_attention_kernels.py), forward and backward, where flash attention has no kernel.

It computes what :class:`~studio.engine.fast.attention.EagerAttention` computes (causal, inside each
example of a flat stream, within a sliding window, fewer key/value heads, the description's scale,
``cap * tanh(s / cap)``, a frozen sink logit per head in every softmax's denominator) the way flash
attention does: a block of queries against the blocks of keys the mask lets through, the scores in
fp32 in registers, never written out. The forward keeps each query's log-sum-exp (fp32 ``[B, heads,
T]``); the backward computes the weights again from it, ``dq`` one block of queries at a time and
``dk``/``dv`` one block of keys at a time (the query heads that share a key/value head summed in
the program, no atomics). Memory is O(tokens): the outputs, the log-sum-exp and ``dout . out``
(fp32 ``[B, heads, T]`` each). The sinks get no gradient (they are frozen).

Where an example starts comes from the boundaries on the device (``cu``: each token's example's
first and past-last token, found by ``searchsorted``), so a step has no host sync and a CUDA graph
can capture it. Each kernel is compiled on its first call for a head width and a set of switches
(soft-cap, sinks, window, several examples): the graphs' eager warm-up makes those calls before
the capture (graphs.py). The token count is not specialised on (no compile per batch length).

Where it runs: CUDA in bf16 or fp16 with Triton (torch's CUDA builds bring it) and
``trainer.fast_path.kernels`` on, head widths up to 256; anywhere under Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU tests), fp32 too. A tile that needs more shared memory than the
card has gives way to the next smaller one (:data:`TILES`); a kernel that fails to build otherwise
is given up on for the process with a warning, and EagerAttention runs instead (the backward of a
forward already made takes EagerAttention's gradients).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from studio.core.memory.attention import FUSED_ATTENTION_WIDTH
from studio.engine.fast.kernels import OwnKernels, interpreted

KERNELS = OwnKernels("fused_attention_kernels", ("attention_forward", "attention_delta", "attention_backward_dq",
                                                 "attention_backward_dkdv", "add", "greatest"),
                     "soft-capped attention kernels",
                     "computing soft-capped scores and sinks in plain torch instead (slower)",
                     per_batch=("n_tokens",),
                     helpers=("block_at", "load_block", "store_block", "scores", "earliest_keys", "keys_seen", "sees"))

Tile = tuple[int, int, int, int]
"""A kernel's launch shape: queries a block, keys a block, warps, pipeline stages."""

TILES: dict[str, dict[int, tuple[Tile, ...]]] = {
    "forward": {64: ((128, 64, 8, 2), (64, 64, 4, 2), (32, 32, 4, 1)),
                128: ((64, 64, 8, 2), (64, 32, 4, 2), (32, 32, 4, 1)),
                256: ((128, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 1), (16, 32, 4, 1))},
    "dq": {64: ((128, 64, 8, 2), (64, 64, 4, 2), (32, 32, 4, 1)),
           128: ((64, 64, 8, 2), (32, 32, 4, 2), (32, 32, 4, 1)),
           256: ((32, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1))},
    "dkdv": {64: ((64, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 1)),
             128: ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 1)),
             256: ((32, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1))},
}
"""Each pass's tiles by head width (rounded up to a power of two, at least 64); the first that fits
the card's shared memory is used (a tile too large fails at its first launch, before it runs, and
the next is tried). At 64 and 128 wide the first of each is, of those Triton 3.9 compiles for an
H100 (sm_90) without registers spilled to memory, the largest: 25-99 KB of shared memory, so they
fit cards of about 100 KB too (not timed yet). At 256 wide (Gemma 2) the first of each is the
fastest of bench/attention_speed.py --sweep on an H200 (Triton 3.6, packed 2,048-token rows, each
pass timed with the others at their earlier tile: forward 0.64 against 0.77 ms, dq 0.66 against
0.75, dkdv 0.62 against 0.72; bench/results/current/h200_attention_sweep_0e07c63.json); the
forward's needs more shared memory than a 100 KB card has, which then takes the next."""

INTERPRETED_TILES = {"forward": (32, 16, 4, 1), "dq": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1)}
"""Under the interpreter: small blocks, so the CPU tests' short examples span several, of two
sizes (a block of keys that a block of queries starts inside, and the other way round)."""

_chosen: dict[tuple[str, int], int] = {}
"""The tile each pass and head width settled on in this process (an index into :data:`TILES`)."""


def _kernels() -> dict:
    return KERNELS.get()


def broken() -> str:
    """Why the kernels failed on this machine ('' while they work)."""
    return KERNELS.broken


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fused attention can run on ``device`` for q, k and v in ``dtype`` with heads
    ``head_dim`` wide (at most core/memory/attention.py's ``FUSED_ATTENTION_WIDTH``, which the estimate
    reads too): CUDA in half precision (an fp32 model keeps EagerAttention's exact order), or any
    float dtype under Triton's interpreter."""
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if interpreted() else ())
    return dtype in dtypes and head_dim <= FUSED_ATTENTION_WIDTH and KERNELS.usable(device)


def _block_d(head_dim: int) -> int:
    return max(64 if not interpreted() else 16, 1 << max(0, head_dim - 1).bit_length())


def _helpers() -> dict:
    """The interpreter's reductions (fused_attention_kernels' docstring); compiled, ``tl.sum``/``tl.max``."""
    here = interpreted()
    kernels = _kernels()
    return {"INTERPRETED": here, "ADD": kernels["add"] if here else None}


def _launch(step: str, block_d: int, run: Callable[[Tile], None]) -> None:
    """``run(tile)`` with the first of ``step``'s tiles for ``block_d`` that fits this card (kept for
    the next calls); under the interpreter, its small tile."""
    if interpreted():
        run(INTERPRETED_TILES[step])
        return
    from triton.runtime.errors import OutOfResources

    tiles = TILES[step][block_d]
    index = _chosen.get((step, block_d), 0)
    while True:
        try:
            run(tiles[index])
            break
        except OutOfResources:  # raised when the kernel loads, before it runs: nothing is half written
            if index + 1 == len(tiles):
                raise
            index += 1
    _chosen[(step, block_d)] = index


def example_bounds(cu: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``t`` tokens' example's first and past-last token (int32 ``[t]`` each), from the
    cumulative example lengths ``cu`` (repeated values, empty examples, allowed): on the device."""
    pos = torch.arange(t, device=cu.device, dtype=cu.dtype)
    example = torch.searchsorted(cu[1:], pos, right=True)
    cu = cu.to(torch.int32)
    return cu[example], cu[example + 1]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None,
            scale: float, cap: float | None, sinks: torch.Tensor | None,
            window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's output ``[B, T, heads, head_dim]`` and each query's log-sum-exp (fp32
    ``[B, heads, T]``) of contiguous ``q``, ``k``, ``v``; ``bounds``: :func:`example_bounds` of a
    stream of several examples (``B`` 1), or None."""
    b, t, heads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, heads, t, dtype=torch.float32, device=q.device)
    start = bounds[0] if bounds is not None else lse
    block_d = _block_d(head_dim)
    kernel = _kernels()["attention_forward"]

    def run(tile: Tile) -> None:
        block_m, block_n, warps, stages = tile
        kernel[(-(-t // block_m), b * heads)](
            q, k, v, out, lse, start, sinks if sinks is not None else lse, t, heads, k.shape[2],
            float(scale), float(cap or 1.0), int(window or 1), HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, CAP=cap is not None, WINDOW=window is not None, SEGMENTS=bounds is not None,
            SINKS=sinks is not None, **_helpers(), GREATEST=_kernels()["greatest"] if interpreted() else None,
            num_warps=warps, num_stages=stages)

    _launch("forward", block_d, run)
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
             cap: float | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v from the output's (``dout``, contiguous), by :func:`forward`'s
    saved ``out`` and ``lse``."""
    b, t, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block_d = _block_d(head_dim)
    kernels = _kernels()
    delta = torch.empty_like(lse)
    delta_rows = 16 if interpreted() else max(16, 4096 // block_d)
    kernels["attention_delta"][(-(-t // delta_rows), b * heads)](
        out, dout, delta, t, heads, HEAD_DIM=head_dim, BLOCK_M=delta_rows, BLOCK_D=block_d, **_helpers(), num_warps=4)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    start, end = bounds if bounds is not None else (lse, lse)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAP=cap is not None, WINDOW=window is not None,
                  SEGMENTS=bounds is not None, INTERPRETED=interpreted())
    numbers = (t, heads, kv_heads, float(scale), float(cap or 1.0), int(window or 1))

    def run_dq(tile: Tile) -> None:
        block_m, block_n, warps, stages = tile
        kernels["attention_backward_dq"][(-(-t // block_m), b * heads)](
            q, k, v, dout, lse, delta, start, dq, *numbers, BLOCK_M=block_m, BLOCK_N=block_n, **common,
            num_warps=warps, num_stages=stages)

    def run_dkdv(tile: Tile) -> None:
        block_m, block_n, warps, stages = tile
        kernels["attention_backward_dkdv"][(-(-t // block_n), b * kv_heads)](
            q, k, v, dout, lse, delta, start, end, dk, dv, *numbers, BLOCK_M=block_m, BLOCK_N=block_n, **common,
            num_warps=warps, num_stages=stages)

    _launch("dq", block_d, run_dq)
    _launch("dkdv", block_d, run_dkdv)
    return dq, dk, dv


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


Gradients = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""The same attention's gradients of q, k and v from the output's, computed another way: what the
backward takes when its kernels fail to build after the forward's did."""


Keep = Callable[[torch.Tensor, torch.Tensor], None]
"""Takes a forward's output and log-sum-exp, for the recomputation of a checkpointed layer
(engine/fast/offload.py keeps them in host memory beside the layer's input)."""


class FusedAttention(torch.autograd.Function):
    """The attention of ``q`` ``[B, T, heads, head_dim]``, ``k`` and ``v`` ``[B, T, kv_heads,
    head_dim]`` by the fused kernels (module docstring): ``cu`` the int32 boundaries of the
    examples of a one-row stream, or None (each row one example); ``scale``, ``cap`` (None: not
    capped), ``sinks`` (fp32 ``[heads]`` or None; no gradient) and ``window`` (None: every earlier
    key) as EagerAttention takes them; ``fallback``: :data:`Gradients`.

    ``keep``: called with the output and the log-sum-exp the forward kernel made (:data:`Keep`).
    ``kept``: that pair from an earlier forward of the same q, k and v (a checkpointed layer's
    recomputation): no kernel runs, the output is the kept one and the backward reads the kept
    log-sum-exp, which is all the backward kernels take beyond q, k, v and the output's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, cu: torch.Tensor | None, scale: float, cap: float | None,
                sinks: torch.Tensor | None, window: int | None, fallback: Gradients, keep: Keep | None = None,
                kept: tuple[torch.Tensor, torch.Tensor] | None = None):
        q, k, v = _dense(q), _dense(k), _dense(v)
        bounds = example_bounds(cu, q.shape[1]) if cu is not None else None
        if kept is not None:
            out, lse = kept
        else:
            out, lse = forward(q, k, v, bounds, scale, cap, sinks, window)
            if keep is not None:
                keep(out, lse)
        ctx.save_for_backward(q, k, v, out, lse, *(bounds or (None, None)))
        ctx.scale, ctx.cap, ctx.window, ctx.fallback = scale, cap, window, fallback
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, start, end = ctx.saved_tensors
        bounds = (start, end) if start is not None else None
        dout = _dense(dout)
        done, grads = KERNELS.attempt(lambda: backward(dout, q, k, v, out, lse, bounds, ctx.scale, ctx.cap,
                                                       ctx.window))
        if not done:
            grads = ctx.fallback(q, k, v, dout)
        return (*grads, None, None, None, None, None, None, None, None)
