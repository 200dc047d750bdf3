"""The cross-entropy over the vocabulary, without a ``tokens x vocab`` logits tensor.

Training uses liger-kernel's fused linear cross-entropy where it is installed (the output
projection and the loss in chunks, gradients written in place). Evaluation needs the argmax too and
no gradient: :func:`chunked_scores` walks the target tokens in chunks whose fp32 logits are no
larger than the batch's hidden states in fp32, so scoring a batch never needs more memory than the
training step on it did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                  liger: dict | None, softcap: float | None = None) -> torch.Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``targets`` (rows of IGNORE_INDEX skipped), fused
    with the product by liger's kernel where ``liger`` (ops.liger_kernels) has it. ``softcap``: the
    logits become ``tanh(z / cap) * cap`` first (Gemma 2's final soft-capping)."""
    if liger and weight.dtype == h.dtype:
        warm_cases(liger["flce"], h, weight, reduction, softcap)
        return _fused(liger["flce"], h, weight, targets, reduction, softcap)
    keep = targets != IGNORE_INDEX  # only target rows go through the fp32 softmax
    logits = (h[keep] @ weight.to(h.dtype).t()).float()
    if softcap is not None:
        logits = capped(logits, softcap)
    return F.cross_entropy(logits, targets[keep], reduction=reduction)


def capped(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(logits / cap) * cap`` (transformers' final logit soft-capping)."""
    return torch.tanh(logits / cap) * cap


def _fused(flce, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
           softcap: float | None = None) -> torch.Tensor:
    # Positional arguments: liger's autograd function takes no keywords.
    if softcap is None:
        loss = flce.apply(h, weight, targets, None, None, IGNORE_INDEX, 0.0, 0.0, reduction)
    else:
        loss = flce.apply(h, weight, targets, None, None, IGNORE_INDEX, 0.0, 0.0, reduction, softcap)
    return loss[0] if isinstance(loss, tuple) else loss


_WARM: set[tuple] = set()


def warm_cases(flce, h: torch.Tensor, weight: torch.Tensor, reduction: str, softcap: float | None = None) -> None:
    """Compile both of liger's cross-entropy kernels that a run will need, at its first loss.

    liger hands its kernel the count of target rows as an integer, and Triton compiles a kernel
    apart for an integer that is a multiple of 16 and for one that is not. The count changes with
    every batch, so a run meets the second case at some later step, which then waits for a compile
    (0.3 s on an H200 with Triton's cache empty: one step of a benchmark's timed window on a fresh
    machine, bench/results/h200_v18_cold_*.json). Two small losses here, with 16 and 17 target rows,
    compile both at the first step; each shape, dtype and reduction is warmed once a process. The
    weight goes in detached: a trainable head would otherwise have liger allocate its gradient
    (vocabulary x hidden) for these throwaway losses; the kernels compiled do not depend on it.
    """
    key = (h.shape[-1], tuple(weight.shape), h.dtype, weight.dtype, h.device, reduction, h.requires_grad, softcap)
    if key in _WARM:
        return
    _WARM.add(key)
    for rows in (16, 17):
        x = torch.zeros(rows, h.shape[-1], dtype=h.dtype, device=h.device, requires_grad=h.requires_grad)
        _fused(flce, x, weight.detach(), torch.zeros(rows, dtype=torch.long, device=h.device), reduction, softcap)


def chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Target rows per chunk: fp32 logits of ``rows x vocab`` no larger than ``tokens x hidden``
    fp32 values (the batch's hidden states), and at least 16 rows."""
    return max(16, tokens * hidden // max(vocab, 1))


@torch.no_grad()
def chunked_scores(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and the count of argmax hits over the target rows of ``h`` ([N, hidden]),
    the logits soft-capped first with ``softcap``.

    The same numbers as a full fp32 softmax (logits in the compute dtype, softmax in fp32), with at
    most one chunk's logits alive.
    """
    keep = targets != IGNORE_INDEX
    rows, wanted = h[keep], targets[keep]
    w = weight.to(h.dtype)
    step = chunk_rows(h.shape[0], h.shape[-1], w.shape[0])
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    hits = torch.zeros((), dtype=torch.long, device=h.device)
    for start in range(0, rows.shape[0], step):
        logits = (rows[start:start + step] @ w.t()).float()
        if softcap is not None:
            logits = capped(logits, softcap)
        target = wanted[start:start + step]
        loss += F.cross_entropy(logits, target, reduction="sum")
        hits += (logits.argmax(-1) == target).sum()
        del logits
    return loss, hits
