"""engine/fast/norm.py: the layer's RMSNorm whose backward also adds the residual stream's gradient of
the same input, in one pass (NormBranch).

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU compiled. The
norm is checked against transformers' order of operations, its backward against autograd's through
the plain formula, and the fast path with it against the fast path without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from test_fast_path import ALL, _examples, _grads, _peft_model  # noqa: E402

from studio.core.config import FastPathConfig  # noqa: E402
from studio.engine import fast  # noqa: E402
from studio.engine.batching import collate  # noqa: E402
from studio.engine.fast import norm  # noqa: E402
from studio.engine.fast.ops import rms_norm_torch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [64, 200])
def test_the_norm_is_transformers_llama_rmsnorm(kernel_device, dtype, width) -> None:
    """Statistics in fp32, the normed row rounded to the input's dtype, then times the weight: the
    same values as transformers' order (to the last bit but for the square root's rounding), on a
    width that is not a power of two too."""
    gen = torch.Generator().manual_seed(width)
    h = (3 * torch.randn(2, 9, width, generator=gen)).to(kernel_device, dtype)
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(kernel_device, dtype)
    y, rstd = norm.rms_norm(h.reshape(-1, width), w, 1e-5)
    want = rms_norm_torch(h, w, 1e-5).reshape(-1, width)
    assert y.dtype == dtype
    one_digit = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    assert (y.float() - want.float()).abs().max().item() <= 2 * one_digit * want.abs().max().item()
    torch.testing.assert_close(rstd, torch.rsqrt(h.float().pow(2).mean(-1) + 1e-5).reshape(-1))


def test_an_fp32_weight_multiplies_in_fp32_and_rounds_once(kernel_device) -> None:
    """A norm weight the engine kept in fp32 (not exact in bf16: build.py) meets the rounded normed
    row in fp32, and the product is rounded to bf16 once (liger's order, and transformers' but for
    its fp32 output), not the weight rounded to bf16 first."""
    gen = torch.Generator().manual_seed(3)
    width = 128
    h = torch.randn(6, width, generator=gen).to(kernel_device, torch.bfloat16)
    w = (1 + 0.01 * torch.randn(width, generator=gen)).to(kernel_device)  # fp32, most not exact in bf16
    y, _ = norm.rms_norm(h, w, 1e-5)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    want = (w * normed.float()).to(torch.bfloat16)
    twice = (w.to(torch.bfloat16) * normed).float()
    assert (y.float() != twice).any()  # the two orders differ on this weight
    assert (y.float() - want.float()).abs().max().item() <= 2 ** -8 * want.float().abs().max().item()
    assert (y.float() == want.float()).float().mean().item() > 0.95


@pytest.mark.parametrize("used", ["both", "norm", "stream"])
@pytest.mark.parametrize("kernel", [True, False])
def test_the_backward_writes_both_gradients_of_the_input_summed(kernel_device, used, kernel, monkeypatch) -> None:
    """``x, h2 = NormBranch(h)``: ``h``'s gradient is the norm's backward of ``x``'s plus ``h2``'s,
    as autograd computes it through the plain formula (fp32); with only one of the two read, the
    other adds nothing. Without the kernel (one that fails to build at the first backward), torch
    computes the same, and the engine warns once."""
    monkeypatch.setattr(norm.KERNELS, "_broken", {})
    if not kernel:
        def failing(*args):
            raise RuntimeError("no compiler for this GPU")

        monkeypatch.setattr(norm, "rms_norm_backward_", failing)
    gen = torch.Generator().manual_seed(1)
    width = 96
    h = (2 * torch.randn(3, 5, width, generator=gen)).to(kernel_device).requires_grad_()
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(kernel_device)
    gx, gh = (torch.randn(3, 5, width, generator=gen).to(kernel_device) for _ in range(2))

    def loss(x, stream):
        total = 0
        if used in ("both", "norm"):
            total = total + (x * gx).sum()
        if used in ("both", "stream"):
            total = total + (stream * gh).sum()
        return total

    x, stream = norm.NormBranch.apply(h, w, 1e-6)
    torch.testing.assert_close(stream, h)
    if kernel or used == "stream":  # only the stream's gradient: the norm's backward never runs
        loss(x, stream).backward()
    else:
        with pytest.warns(RuntimeWarning, match="RMSNorm kernels failed"):
            loss(x, stream).backward()
        assert norm.broken()
    got, h.grad = h.grad, None
    loss(rms_norm_torch(h, w, 1e-6), h).backward()
    torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=1e-6)


def test_the_fast_path_with_the_norm_kernels_equals_it_without_them(tiny_model: Path, kernel_device, monkeypatch) -> None:
    """The whole fast path (packed examples, checkpointing, every projection adapted) in fp32 with
    NormBranch and without it (``trainer.fast_path.kernels`` off): the same loss and adapter
    gradients, every layer's two norms through it."""
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(kernel_device)
    ran = []
    real = norm.NormBranch.backward

    def counting(ctx, dy, dh):
        ran.append(dh is not None)
        return real(ctx, dy, dh)

    monkeypatch.setattr(norm.NormBranch, "backward", staticmethod(counting))
    runs = {}
    for on in (True, False):
        model = _peft_model(tiny_model, None, ALL).to(kernel_device)
        fm, why = fast.prepare(model, FastPathConfig(kernels=on, cuda_graphs=False))
        assert fm is not None, why
        assert all(layer.norm_with_stream is on for layer in fm.layers)
        ran.clear()
        loss = fm.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        runs[on] = (loss.detach(), _grads(model))
        # the first layer's first norm reads the embeddings' output, which wants no gradient
        assert ran == ([True] * (2 * len(fm.layers) - 1) if on else [])
    (loss_on, grads_on), (loss_off, grads_off) = runs[True], runs[False]
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_off.items():
        assert grad.abs().sum() > 0, name
        # fp32 sums in another order: to a few parts in a million of the gradient's scale
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())


def test_a_norm_kernel_that_cannot_build_leaves_liger_s_norm(tiny_model: Path, kernel_device, monkeypatch) -> None:
    """If the kernels fail (a Triton that cannot compile them here), the step still runs with the
    norm and autograd's sum, and the engine warns once."""
    monkeypatch.setattr(norm.KERNELS, "_broken", {})

    def failing():
        raise RuntimeError("no such GPU")

    model = _peft_model(tiny_model, None, ALL).to(kernel_device)
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(kernel_device)
    fm, why = fast.prepare(model, FastPathConfig(cuda_graphs=False))
    assert fm is not None, why
    assert fm.layers[0].norm_with_stream
    monkeypatch.setattr(norm, "_kernels", failing)
    with pytest.warns(RuntimeWarning, match="RMSNorm kernels failed"):
        loss = fm.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    assert norm.broken() and all(g.abs().sum() > 0 for g in _grads(model).values())
