"""engine/fast/cross_entropy.py: the training loss fused with the output head in chunks of at least
128 rows (liger's chunks of 32 rows read Gemma 2's whole 256,000-word head twice each). Its loss and
the hidden states' gradient equal the plain computation's (the head's product in the compute dtype,
the soft-cap and the softmax in fp32): with ignored rows, a vocabulary that is not a multiple of the
kernel's block, several chunks, Gemma 2's final soft-cap with logits far past it, a mean and a sum.
On the CPU the kernel runs in Triton's interpreter; on a GPU compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from studio.core.memory.fast import LOSS_CHUNK_ROWS, loss_chunk_rows  # noqa: E402
from studio.engine.fast import cross_entropy as head_loss  # noqa: E402
from studio.engine.fast.loss import IGNORE_INDEX, cross_entropy  # noqa: E402


def _plain(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str, softcap: float | None):
    """The loss as transformers computes it: logits in the compute dtype, then fp32 (capped there)."""
    logits = (h @ weight.t()).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, reduction=reduction, ignore_index=IGNORE_INDEX)


def _case(rows: int, vocab: int, device, dtype, spread: float = 1.0):
    gen = torch.Generator().manual_seed(rows + vocab)
    h = (spread * torch.randn(rows, 64, generator=gen)).to(device, dtype).requires_grad_()
    weight = (0.3 * torch.randn(vocab, 64, generator=gen)).to(device, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::5] = IGNORE_INDEX
    return h, weight, targets.to(device)


@pytest.mark.parametrize(("dtype", "reduction", "softcap", "spread"), [
    (torch.float32, "mean", None, 1.0), (torch.float32, "sum", None, 1.0), (torch.float32, "mean", 30.0, 20.0),
    (torch.bfloat16, "mean", None, 1.0), (torch.bfloat16, "sum", 30.0, 1.0), (torch.bfloat16, "mean", 30.0, 20.0)])
def test_the_fused_loss_and_its_gradient_equal_the_plain_computation(kernel_device, dtype, reduction, softcap,
                                                                     spread) -> None:
    """300 rows (three chunks: 128, 128 and 44), a vocabulary of 200 (the interpreter's block is 64: a
    last partial one), every fifth target ignored; ``spread`` 20 puts logits far past the cap of 30.
    On a GPU an fp32 model's loss is liger's (``available`` says no), but the kernel computes fp32
    logits all the same: compiled, its arithmetic meets fp32's tolerance."""
    h, weight, targets = _case(300, 200, kernel_device, dtype, spread)
    assert loss_chunk_rows(300, 64, 200) == LOSS_CHUNK_ROWS == 128
    assert head_loss.available(kernel_device, dtype) == (dtype != torch.float32 or kernel_device.type != "cuda")
    got = head_loss.HeadCrossEntropy.apply(h, weight, targets, reduction, softcap)
    (dh,) = torch.autograd.grad(got, h)
    leaf = h.detach().requires_grad_()
    want = _plain(leaf, weight, targets, reduction, softcap)
    (want_dh,) = torch.autograd.grad(want, leaf)
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=0.0)
    torch.testing.assert_close(dh.float(), want_dh.float(), rtol=rel * 5, atol=rel * want_dh.abs().max().item())
    assert dh[::5].abs().max() == 0  # the ignored rows get no gradient


def test_the_loss_s_incoming_gradient_scales_the_hidden_states_one(kernel_device) -> None:
    h, weight, targets = _case(40, 130, kernel_device, torch.float32)
    loss = head_loss.HeadCrossEntropy.apply(h, weight, targets, "mean", None)
    (once,) = torch.autograd.grad(loss, h, retain_graph=True)
    (thrice,) = torch.autograd.grad(3 * loss, h)
    torch.testing.assert_close(thrice, 3 * once)


def test_a_batch_whose_every_target_is_ignored_has_no_loss_and_no_gradient(kernel_device) -> None:
    h, weight, targets = _case(20, 100, kernel_device, torch.float32)
    targets[:] = IGNORE_INDEX
    loss = head_loss.HeadCrossEntropy.apply(h, weight, targets, "mean", 30.0)
    (dh,) = torch.autograd.grad(loss, h)
    assert loss.item() == 0 and dh.abs().max() == 0


def test_the_training_loss_takes_the_fused_loss_where_its_kernel_runs(kernel_device) -> None:
    """loss.cross_entropy with ``kernels``: Studio's fused loss for a bf16 model (here no liger: the
    plain way otherwise); the same number as without, to bf16 logits' tolerance."""
    h, weight, targets = _case(50, 200, kernel_device, torch.bfloat16)
    with_kernel = cross_entropy(h, weight, targets, "mean", None, softcap=30.0, kernels=True)
    assert with_kernel.grad_fn is not None and "HeadCrossEntropy" in type(with_kernel.grad_fn).__name__
    without = cross_entropy(h, weight, targets, "mean", None, softcap=30.0, kernels=False)
    assert "HeadCrossEntropy" not in type(without.grad_fn).__name__
    torch.testing.assert_close(with_kernel, without, rtol=1e-2, atol=0.0)


@pytest.mark.parametrize(("tokens", "hidden", "vocab", "rows"), [
    (2048, 3584, 256000, 128),    # Gemma-2-9B at 2,048 tokens: liger's rule gives 32 rows
    (2048, 4096, 128256, 128),    # Llama-3-8B: 64
    (16384, 3584, 256000, 256),   # 230 by liger's rule, rounded up to 128s
    (8192, 4096, 32000, 1152),    # Llama-2-7B at 8,192 tokens: 1,049
    (100, 3584, 256000, 100),     # fewer tokens than the floor: all of them
])
def test_a_chunk_is_as_wide_as_liger_s_rule_but_never_thinner_than_the_floor(tokens, hidden, vocab, rows) -> None:
    assert loss_chunk_rows(tokens, hidden, vocab) == rows
