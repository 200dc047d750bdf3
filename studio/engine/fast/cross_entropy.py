"""The training loss's cross-entropy fused with the output head, in chunks of rows wide enough for
the head's products to run at the card's rate.

liger-kernel's fused linear cross-entropy sizes its chunks so that a chunk's logits are no larger
than the hidden states: ``tokens / (vocab / hidden)`` rows, rounded up to a power of two. At 2,048
tokens over Gemma 2's 256,000-word vocabulary that is 32 rows: 64 chunks, each reading the whole
head (1.8 GB in bf16) twice, for its logits and for the hidden states' gradient, in products too
thin to be anything but bound by that read (235 GB a step, ~50 ms on an H200, against ~8 ms for the
same products at the card's rate). Here a chunk has at least
:data:`~studio.core.memory.fast.LOSS_CHUNK_ROWS` rows (128: 59 GB, ~12 ms; core/memory/fast.py's
``loss_chunk_rows``, which the estimate counts): its logits (the head's
product, in the compute dtype) go through one Triton kernel (cross_entropy_kernels.py) that writes
each row's loss and, over the logits, their gradient, and one more product turns that into the
hidden states' gradient. The forward computes the gradient (as liger's does); the backward scales it
by the loss's incoming gradient. The head is frozen (its weight gets no gradient).

Numerics are liger's: logits in the compute dtype, the softmax in fp32, the gradient scaled (a
mean's 1 / target count, from the device: no host sync) and rounded once to the compute dtype
before its product. CUDA with Triton in half precision, or Triton's interpreter (the CPU tests);
elsewhere, or once the kernel fails to build, loss.py's other ways.
"""

from __future__ import annotations

import torch

from studio.core.memory.fast import loss_chunk_rows
from studio.engine.fast.kernels import OwnKernels, interpreted

IGNORE_INDEX = -100
"""A target that takes no loss (the kernel's literal; loss.py's IGNORE_INDEX)."""

BLOCK = 4096
NUM_WARPS = 8
"""The kernel's columns a step and warps, compiled: liger's kernel walks 32,768 columns a step on 32
warps; these are a guess, not timed on a GPU yet."""
INTERPRETED_BLOCK = 64
"""Under the interpreter: small, so the CPU tests' small vocabularies take several steps and a last
partial one."""

KERNELS = OwnKernels("cross_entropy_kernels", ("cross_entropy_rows", "add", "greatest"), "cross-entropy kernel",
                     "using liger's fused cross-entropy instead", helpers=("tanh",))


def broken() -> str:
    """Why the kernel failed on this machine ('' while it works)."""
    return KERNELS.broken


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`HeadCrossEntropy` can run on ``device`` for hidden states in ``dtype``: half
    precision on CUDA (liger's path keeps fp32 models), any float under the interpreter."""
    dtypes = (torch.bfloat16, torch.float16) + ((torch.float32,) if interpreted() else ())
    return dtype in dtypes and KERNELS.usable(device)


def _rows(logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor,
          softcap: float | None, grad: bool) -> None:
    """Each row's loss into ``losses`` and, with ``grad``, its scaled gradient over ``logits``."""
    kernels = KERNELS.get()
    here = interpreted()
    kernels["cross_entropy_rows"][(logits.shape[0],)](
        logits, targets, losses, scale, logits.shape[1], logits.stride(0), float(softcap or 1.0),
        BLOCK=INTERPRETED_BLOCK if here else BLOCK, CAP=softcap is not None, GRAD=grad, INTERPRETED=here,
        ADD=kernels["add"] if here else None, GREATEST=kernels["greatest"] if here else None,
        num_warps=NUM_WARPS)


class HeadCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``h @ weight.T`` (``h`` ``[N, hidden]``, the frozen head ``weight``
    ``[vocab, hidden]`` in ``h``'s dtype) against ``targets`` ``[N]`` (IGNORE_INDEX: no loss),
    ``reduction`` ``mean`` (over the targets) or ``sum``, the logits soft-capped first with
    ``softcap`` (None: not capped); chunks of ``loss_chunk_rows`` rows (module docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                softcap: float | None = None) -> torch.Tensor:
        n, hidden = h.shape
        h, targets = h.contiguous(), targets.contiguous()
        count = (targets != IGNORE_INDEX).sum()
        scale = (1.0 / count.clamp(min=1).float()) if reduction == "mean" else torch.ones((), device=h.device)
        grad = ctx.needs_input_grad[0]
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if grad else None
        rows = loss_chunk_rows(n, hidden, weight.shape[0])
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            logits = h[part] @ weight.t()
            _rows(logits, targets[part], losses[part], scale, softcap, grad)
            if grad:
                torch.mm(logits, weight, out=dh[part])
            del logits  # one chunk's logits alive at a time
        ctx.save_for_backward(dh)
        return losses.sum() * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (dh,) = ctx.saved_tensors
        return dh * g.to(dh.dtype), None, None, None, None
