"""The cross-entropy over the vocabulary, without a ``tokens x vocab`` logits tensor.

Training uses Studio's fused loss (cross_entropy.py: the output projection and the loss in chunks
of at least 128 rows, so that the head's products are not bound by reading the head, gradients
written in place) where its kernel runs, else liger-kernel's fused linear cross-entropy where it is
installed (the same, in chunks no larger than the hidden states: thin ones at a few thousand tokens
over a large vocabulary). Evaluation needs the argmax too and no gradient: :func:`chunked_scores`
walks the target tokens in chunks whose fp32 logits are no larger than the batch's hidden states in
fp32, so scoring a batch never needs more memory than the training step on it did.

Preference training (DPO, ORPO) needs each answer's log-prob, not one loss: :func:`sequence_logps`
sums the target tokens' log-probs per row of the batch (a segment sum over the flat stream of
tokens), the per-token values coming from liger's kernel with ``reduction="none"`` or, without it,
from :class:`TokenLogps`, which walks the target rows in the same chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from studio.engine.fast import cross_entropy as head_loss

IGNORE_INDEX = head_loss.IGNORE_INDEX


def cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                  liger: dict | None, softcap: float | None = None, kernels: bool = False) -> torch.Tensor:
    """Cross-entropy of ``h @ weight.T`` against ``targets`` (rows of IGNORE_INDEX skipped), fused
    with the product: by Studio's kernel with ``kernels`` (``trainer.fast_path.kernels``) where it
    runs (a frozen head in ``h``'s dtype, a mean or a sum: cross_entropy.py), else by liger's where
    ``liger`` (ops.liger_kernels) has it. ``softcap``: the logits become ``tanh(z / cap) * cap``
    first (Gemma 2's final soft-capping)."""
    if (kernels and reduction in ("mean", "sum") and weight.dtype == h.dtype and not weight.requires_grad
            and head_loss.available(h.device, h.dtype)):
        done, loss = head_loss.KERNELS.attempt(
            lambda: head_loss.HeadCrossEntropy.apply(h, weight, targets, reduction, softcap))
        if done:
            return loss
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
    machine, bench/results/archive/h200_v18_cold_*.json). Two small losses here, with 16 and 17 target rows,
    compile both at the first step (with ``reduction="none"``, whose gradient liger computes in its
    backward, that backward too); each shape, dtype and reduction is warmed once a process. The
    weight goes in detached: a trainable head would otherwise have liger allocate its gradient
    (vocabulary x hidden) for these throwaway losses; the kernels compiled do not depend on it.
    """
    key = (h.shape[-1], tuple(weight.shape), h.dtype, weight.dtype, h.device, reduction, h.requires_grad, softcap)
    if key in _WARM:
        return
    _WARM.add(key)
    for rows in (16, 17):
        x = torch.zeros(rows, h.shape[-1], dtype=h.dtype, device=h.device, requires_grad=h.requires_grad)
        loss = _fused(flce, x, weight.detach(), torch.zeros(rows, dtype=torch.long, device=h.device), reduction,
                      softcap)
        if reduction == "none" and x.requires_grad:
            loss.sum().backward()  # per-token losses: liger computes their gradient in its backward


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


def next_token_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Each position's target: ``labels`` shifted left by one, IGNORE_INDEX at a row's end and where
    the next token starts a new example (its position id is 0), so that no example of a packed row
    is trained to predict the next one."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    targets[:, :-1].masked_fill_(position_ids[:, 1:] == 0, IGNORE_INDEX)
    return targets


def sequence_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, wanted: torch.Tensor,
                   liger: dict | None, hits: bool = False, softcap: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of a batch: the summed log-prob (fp32) of its target tokens under ``h @ weight.T``,
    with its gradient to ``h``, and with ``hits`` (for evaluation: no gradient, no liger) how many of
    them are the argmax (else None). ``softcap``: the logits are soft-capped first (Gemma 2).

    ``h`` ([N, hidden]) and ``targets`` ([N], IGNORE_INDEX where none) are a flat stream of tokens
    (FastModel's); ``wanted`` ([rows, width], bool) marks the batch's target tokens, which the
    stream holds in the same (row-major) order. Only the target tokens go through the vocabulary (a
    DPO prompt's tokens never do). Their log-probs are scattered back into their rows and summed
    there: a segment sum in a fixed order (no atomic additions), so a step's numbers repeat."""
    keep = targets != IGNORE_INDEX
    h, targets = h[keep], targets[keep]
    rows = torch.zeros(wanted.shape, dtype=torch.float32, device=h.device)
    if not h.shape[0]:  # no target token: zeros, still a function of h for autograd
        return rows.sum(1) + h.sum().float() * 0, (rows.sum(1) if hits else None)
    if hits:
        logps, correct = chunked_token_logps(h, weight, targets, softcap)
        return rows.masked_scatter(wanted, logps).sum(1), rows.masked_scatter(wanted, correct.float()).sum(1)
    return rows.masked_scatter(wanted, token_logps(h, weight, targets, liger, softcap)).sum(1), None


def token_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, liger: dict | None,
                softcap: float | None = None) -> torch.Tensor:
    """log p(target) of each row of ``h @ weight.T`` ([N], fp32; every target real), with its
    gradient to ``h``: liger's fused kernel with ``reduction="none"`` where ``liger`` has it (its
    per-token loss is ``-log p``; with a gradient wanted, liger 0.8.5 goes through the vocabulary
    again in its backward, the per-token gradient folded in), else :class:`TokenLogps`."""
    if liger and weight.dtype == h.dtype:
        warm_cases(liger["flce"], h, weight, "none", softcap)
        return -_fused(liger["flce"], h, weight, targets, "none", softcap)
    return TokenLogps.apply(h, weight, targets, softcap)


class TokenLogps(torch.autograd.Function):
    """log p(target) of each row of ``h @ weight.T``, the target rows walked in chunks of
    :func:`chunk_rows` (one chunk's fp32 logits alive at a time). A row's log-prob depends on its
    own row of ``h`` only, so the forward computes each row's gradient too (``(onehot - softmax) @
    weight``: the vocabulary gone through once) and the backward scales it by that row's incoming
    gradient. The logits are in ``h``'s dtype and the softmax in fp32, as the plain path's."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                softcap: float | None = None) -> torch.Tensor:
        logps, grad, _ = _walk(h, weight, targets, grad=ctx.needs_input_grad[0], hits=False, softcap=softcap)
        ctx.save_for_backward(grad)
        return logps

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * g[:, None].to(grad.dtype), None, None, None


@torch.no_grad()
def chunked_token_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) of each row of ``h @ weight.T`` and whether the target is the argmax, for
    evaluation: no gradient, one chunk's logits at a time (as :func:`chunked_scores`)."""
    logps, _, hits = _walk(h, weight, targets, grad=False, hits=True, softcap=softcap)
    return logps, hits


def _walk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: bool, hits: bool,
          softcap: float | None = None):
    """The chunked pass of :class:`TokenLogps` and :func:`chunked_token_logps`: per target row its
    log-prob, its gradient to ``h`` (``grad``) and whether it is the argmax (``hits``), the logits
    soft-capped first with ``softcap``."""
    w = weight.to(h.dtype)
    step = chunk_rows(h.shape[0], h.shape[-1], w.shape[0])
    logps = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if grad else None
    hit = torch.empty(h.shape[0], dtype=torch.bool, device=h.device) if hits else None
    for start in range(0, h.shape[0], step):
        part = slice(start, start + step)
        logits = (h[part] @ w.t()).float()
        if softcap is not None:
            logits = capped(logits, softcap)
        target = targets[part, None]
        if hit is not None:
            hit[part] = logits.argmax(-1) == target[:, 0]
        logp = logits.log_softmax(-1)
        if softcap is None or dh is None:
            del logits
        logps[part] = logp.gather(-1, target)[:, 0]
        if dh is not None:
            d = logp.exp_().neg_()  # d log p(y) / d logits = onehot(y) - softmax, in place of logp
            d.scatter_add_(-1, target, torch.ones_like(target, dtype=d.dtype))
            if softcap is not None:  # through the cap: d tanh(z / c) * c / dz = 1 - (capped / c)^2
                d.mul_(1 - (logits / softcap).square_())
                del logits
            dh[part] = d.to(h.dtype) @ w
        del logp
    return logps, dh, hit
