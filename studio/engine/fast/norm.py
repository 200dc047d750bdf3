"""A decoder layer's RMSNorm and the residual stream's gradient in one backward kernel.

A layer reads its input ``h`` twice: through the norm (into q/k/v, or into gate/up) and as the
residual stream that the next product adds to. In the backward autograd sums the two gradients of
``h`` in a pass of its own: liger's RMSNorm backward writes its share (and a weight gradient the
frozen norm never uses), then an add reads both shares and writes the sum, three full-width passes
twice a layer. :class:`NormBranch` owns both reads of ``h``: its forward returns the normed ``x``
and ``h`` itself, and its backward receives both gradients and writes their sum in the same pass
that computes the norm's, with no weight gradient.

Numerics: the norm's forward is transformers' LlamaRMSNorm's; the two gradients are summed in fp32
and rounded once (autograd rounded the norm's share first). CUDA with Triton only (or Triton's
interpreter, for the CPU tests); elsewhere the layer keeps liger's norm and autograd's sum.
"""

from __future__ import annotations

import torch

from studio.engine.fast.kernels import OwnKernels, interpreted

KERNELS = OwnKernels("norm_kernels", ("rms_norm_forward", "rms_norm_backward", "add", "round_bf16"),
                     "RMSNorm kernels", "using liger's norm and autograd's sum instead")


def _kernels():
    return KERNELS.get()


def broken() -> str:
    """Why the kernels failed on this machine ('' while they work)."""
    return KERNELS.broken


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`NormBranch` can run on ``device`` for activations in ``dtype``."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and KERNELS.usable(device)


def _settings(width: int) -> tuple[int, int]:
    block = 1 << max(0, width - 1).bit_length()
    return block, min(32, max(4, block // 512))


def _helpers() -> dict:
    """The interpreter's reduction (norm_kernels' docstring); compiled, the kernels use ``tl.sum``."""
    here = interpreted()
    return {"INTERPRETED": here, "ADD": _kernels()["add"] if here else None}


def rms_norm(x2: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w * x2 / rms(x2), 1 / rms)`` of the rows of ``x2`` (``[rows, width]``, last dim contiguous)."""
    rows, width = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    block, warps = _settings(width)
    _kernels()["rms_norm_forward"][(rows,)](
        x2, w, y, rstd, width, float(eps), x2.stride(0), y.stride(0), BLOCK=block,
        **_helpers(), ROUND=_kernels()["round_bf16"] if interpreted() else None, num_warps=warps)
    return y, rstd


def rms_norm_backward_(dy2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                       dres2: torch.Tensor | None) -> torch.Tensor:
    """The gradient of :func:`rms_norm`'s input from its output's (``dy2``), plus ``dres2`` (another
    gradient of the same input) when given, written over ``dy2`` (nothing else reads it)."""
    rows, width = x2.shape
    block, warps = _settings(width)
    dres = dres2 if dres2 is not None else dy2
    _kernels()["rms_norm_backward"][(rows,)](
        dy2, x2, w, rstd, dres, dy2, width, dy2.stride(0), x2.stride(0), dres.stride(0), dy2.stride(0),
        BLOCK=block, RESIDUAL=dres2 is not None, **_helpers(), num_warps=warps)
    return dy2


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class NormBranch(torch.autograd.Function):
    """``(rms_norm(h) * w, h)``: the layer's normed input and the stream itself, so that the
    backward gets both of ``h``'s gradients and writes their sum in one pass (module docstring).
    The returned ``h`` is the same values, to be read only (the products add it, never into it)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, eps: float):
        h2 = _rows(h)
        y, rstd = rms_norm(h2, w, eps)
        ctx.save_for_backward(h2, w, rstd)
        ctx.set_materialize_grads(False)
        ctx.shape = h.shape
        return y.view(h.shape), h.view_as(h)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, dh: torch.Tensor | None):
        if dy is None:
            return dh, None, None
        h2, w, rstd = ctx.saved_tensors
        dres = _rows(dh) if dh is not None else None
        dy2 = _rows(dy).contiguous()
        # a kernel that cannot build here: the same sum in torch
        done, dx = KERNELS.attempt(lambda: rms_norm_backward_(dy2, h2, w, rstd, dres))
        if not done:
            dx = _backward_torch(dy2, h2, w, rstd, dres)
        return dx.view(ctx.shape), None, None


def _backward_torch(dy2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                    dres2: torch.Tensor | None) -> torch.Tensor:
    """:func:`rms_norm_backward_`'s values computed by torch (when the kernel cannot run)."""
    g = dy2.float() * w.float()
    xhat = x2.float() * rstd[:, None]
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dres2 is not None:
        dx += dres2.float()
    return dx.to(dy2.dtype)
