"""engine/fast/expert_copies.py: a sparse layer's token copies gathered into expert order and summed
back, each token's copies meeting in one Triton kernel (the combine's forward, the gather's
backward) or in torch's ``index_add_`` where the kernels are off.

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU compiled.
test_fast_moe.py runs the mixture-of-experts families' training step with it against transformers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from studio.engine.fast import expert_copies  # noqa: E402
from studio.engine.fast.expert_copies import Combine, Gather  # noqa: E402


def _routing(tokens: int, k: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each copy's place in a sort by random experts: ``order`` (the copy each sorted row is) and
    ``rows`` (the token each sorted row is a copy of), as moe.py's sort makes them."""
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    order = torch.sort(chosen.reshape(-1), stable=True).indices
    return order, order // k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "width"), [(37, 8, 300), (16, 2, 256), (5, 1, 1), (40, 4, 70)])
def test_each_token_s_copies_sum_in_fp32_as_index_add_sums_them(kernel_device, tokens: int, k: int, width: int,
                                                               dtype: torch.dtype) -> None:
    """``copies_sum`` against ``index_add_`` in fp32: edge tiles of tokens and columns, one copy a
    token (the routing weights' gather), eight (Qwen3-30B-A3B's)."""
    gen = torch.Generator().manual_seed(tokens * k + width)
    order, rows = _routing(tokens, k, 16, gen)
    src = torch.randn(tokens * k, width, generator=gen).to(kernel_device, dtype)
    pos = expert_copies.positions(order.to(kernel_device))
    assert pos.dtype == torch.int32 and torch.equal(order[pos.long().cpu()], torch.arange(tokens * k))
    got = expert_copies.copies_sum(src, pos, k)
    want = torch.zeros(tokens, width).index_add_(0, rows, src.float().cpu())
    assert got.dtype == dtype and got.shape == (tokens, width)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    assert (got.float().cpu() - want).abs().max() <= 2 * tol * want.abs().max()  # one rounding


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "index_add"])
def test_the_gather_and_the_combine_give_torch_s_values_and_gradients(kernel_device, kernel: bool) -> None:
    """``Gather`` (a token's row to its copies) and ``Combine`` (the copies summed back), kernel or
    not: the values and gradients of ``x[rows]`` and ``index_add_`` through autograd; with ``value``
    False the combine's output is a zero that owns no memory, its gradient the same."""
    gen = torch.Generator().manual_seed(3)
    tokens, k, width = 23, 4, 96
    order, rows = _routing(tokens, k, 8, gen)
    order, rows = order.to(kernel_device), rows.to(kernel_device)
    pos = expert_copies.positions(order)
    x = torch.randn(tokens, width, generator=gen).to(kernel_device)
    dy = torch.randn(tokens * k, width, generator=gen).to(kernel_device)
    dout = torch.randn(tokens, width, generator=gen).to(kernel_device)

    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    Gather.apply(ours, rows, pos, k, kernel).backward(dy)
    theirs[rows].backward(dy)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-5)

    y = torch.randn(tokens * k, width, generator=gen).to(kernel_device)
    ours, theirs = y.clone().requires_grad_(), y.clone().requires_grad_()
    out = Combine.apply(ours, rows, pos, k, kernel, True)
    want = torch.zeros(tokens, width, device=kernel_device).index_add_(0, rows, theirs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.backward(dout)
    want.backward(dout)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)

    empty = y.clone().requires_grad_()
    zero = Combine.apply(empty, rows, pos, k, kernel, False)
    assert zero.shape == (tokens, width) and zero.stride() == (0, 0) and not zero.any()
    zero.backward(dout)
    torch.testing.assert_close(empty.grad, theirs.grad, rtol=0, atol=0)
