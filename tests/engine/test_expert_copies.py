"""engine/fast/expert_copies.py: a sparse layer's token copies gathered into expert order and summed
back, each token's copies meeting in one Triton kernel (the combine's forward, the gather's
backward) or in torch's ``index_add_`` where the kernels are off; the combine with gpt-oss'
down-projection bias added in its sum, and the routing weight's gradient through it.

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU compiled.
test_fast_moe.py runs the mixture-of-experts families' training step with it against transformers.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from studio.engine.fast import expert_copies  # noqa: E402
from studio.engine.fast.expert_copies import Combine, Gather  # noqa: E402


def _routing(tokens: int, k: int, experts: int, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each copy's place in a sort by random experts: ``order`` (the copy each sorted row is),
    ``rows`` (the token each sorted row is a copy of) and ``expert`` (each sorted row's expert), as
    moe.py's sort makes them."""
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    order = torch.sort(chosen.reshape(-1), stable=True).indices
    return order, order // k, chosen.reshape(-1)[order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "width"), [(37, 8, 300), (16, 2, 256), (5, 1, 1), (40, 4, 70)])
def test_each_token_s_copies_sum_in_fp32_as_index_add_sums_them(kernel_device, tokens: int, k: int, width: int,
                                                               dtype: torch.dtype) -> None:
    """``copies_sum`` against ``index_add_`` in fp32: edge tiles of tokens and columns, one copy a
    token (the routing weights' gather), eight (Qwen3-30B-A3B's)."""
    gen = torch.Generator().manual_seed(tokens * k + width)
    order, rows, _ = _routing(tokens, k, 16, gen)
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
    order, rows, _ = _routing(tokens, k, 8, gen)
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


def _bias(experts: int, width: int, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Each expert's bias row ``[experts, width]`` on ``device`` in ``dtype``, as a view of a wider
    tensor (a row stride that is not its width, as a slice of a stored tensor has)."""
    return torch.randn(experts, width + 7, generator=gen).to(device, dtype)[:, 3:width + 3]


@pytest.mark.parametrize("expert_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "width"), [(37, 8, 300), (40, 4, 70), (5, 1, 1), (18, 1, 260)])
def test_each_copy_s_weighted_bias_joins_the_sum_in_fp32(kernel_device, tokens: int, k: int, width: int,
                                                        dtype: torch.dtype, expert_dtype: torch.dtype) -> None:
    """``copies_sum`` with a bias against an fp32 reference of ``(src + bias[expert] x weight)``
    summed by ``index_add_``: edge tiles of tokens and columns, one copy a token and four or eight,
    the experts in int64 (moe.py's sort) or int32, a bias row stride that is not its width; one
    rounding. The bias's terms are no rounding error's size: without them the sum is far off."""
    gen = torch.Generator().manual_seed(tokens * k + width + 1)
    experts = 16
    order, rows, expert = _routing(tokens, k, experts, gen)
    src = torch.randn(tokens * k, width, generator=gen).to(kernel_device, dtype)
    bias = _bias(experts, width, gen, kernel_device, dtype)
    assert bias.stride() == (width + 7, 1)
    weight = torch.rand(tokens * k, generator=gen).add(0.5).to(kernel_device, dtype)
    pos = expert_copies.positions(order.to(kernel_device))
    got = expert_copies.copies_sum(src, pos, k, bias, expert.to(kernel_device, expert_dtype), weight)
    terms = src.float().cpu() + bias.float().cpu()[expert] * weight.float().cpu()[:, None]
    want = torch.zeros(tokens, width).index_add_(0, rows, terms)
    assert got.dtype == dtype and got.shape == (tokens, width)
    tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8}[dtype]
    error = (got.float().cpu() - want).abs().max()
    assert error <= 2 * tol * want.abs().max()  # one rounding
    unbiased = torch.zeros(tokens, width).index_add_(0, rows, src.float().cpu())
    assert (unbiased - want).abs().max() > 100 * error + 0.1


def _combine_inputs(device: torch.device, dtype: torch.dtype, expert_dtype: torch.dtype):
    """A combine's inputs: 23 tokens of 4 copies among 8 experts, 96 columns (``y``, each copy's
    routing ``weight``, the experts' ``bias``), and the output's gradient."""
    gen = torch.Generator().manual_seed(5)
    tokens, k, width, experts = 23, 4, 96, 8
    order, rows, expert = _routing(tokens, k, experts, gen)
    pos = expert_copies.positions(order.to(device))
    y = torch.randn(tokens * k, width, generator=gen).to(device, dtype)
    weight = torch.rand(tokens * k, generator=gen).add(0.5).to(device, dtype)
    bias = _bias(experts, width, gen, device, dtype)
    dout = torch.randn(tokens, width, generator=gen).to(device, dtype)
    return k, rows.to(device), pos, expert.to(device, expert_dtype), y, weight, bias, dout


class _Made(TorchDispatchMode):
    """Each aten operation run under it, by name, with the bytes of new memory its outputs own (a
    view of an input's memory owns none)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                if isinstance(a, torch.Tensor)}
        made = [o.untyped_storage().nbytes() for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in held]
        self.ops.append((func.overloadpacket.__name__, max(made, default=0)))
        return out


def _reference(y, weight, bias, expert, rows, dout):
    """``(y + bias[expert] x weight)`` summed by ``index_add_`` through torch's autograd, in fp32: the
    output and ``y``'s and ``weight``'s gradients."""
    y = y.to(torch.float32, copy=True).requires_grad_()
    weight = weight.to(torch.float32, copy=True).requires_grad_()
    terms = y + bias.float()[expert.long()] * weight[:, None]
    out = torch.zeros(dout.shape, device=y.device).index_add_(0, rows, terms)
    out.backward(dout.float())
    return out.detach(), y.grad, weight.grad


@pytest.mark.parametrize("expert_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "index_add"])
def test_the_combine_with_a_bias_gives_torch_s_values_and_gradients(kernel_device, kernel: bool, dtype: torch.dtype,
                                                                    expert_dtype: torch.dtype) -> None:
    """``Combine`` with a bias, kernel or not: the output, ``y``'s gradient and the routing weight's
    (in its dtype; through the ``[tokens, experts]`` product) those of ``(y + bias[expert] x weight)``
    and ``index_add_`` through autograd, the bias no gradient; with ``value`` False the output is a
    zero that owns no memory and nothing else is made, the gradients the same, and the backward
    makes nothing of the sorted rows' size but ``y``'s gradient; the weight's gradient (its product)
    only where it is wanted."""
    k, rows, pos, expert, y, weight, bias, dout = _combine_inputs(kernel_device, dtype, expert_dtype)
    want, want_dy, want_dw = _reference(y, weight, bias, expert, rows, dout)
    if dtype == torch.float32:
        tol = out_tol = dict(rtol=1e-5, atol=1e-5)
    else:  # the weight's gradient: one rounding of the product; the sum: one with the kernel, else one
        # for each of index_add_'s bf16 additions and the bias's product and sum before them
        tol = dict(rtol=2 ** -7, atol=2 ** -6)
        out_tol = dict(rtol=0, atol=(2 if kernel else 2 * (k + 2)) * 2 ** -8 * want.abs().max().item())

    ours_y, ours_w = y.clone().requires_grad_(), weight.clone().requires_grad_()
    out = Combine.apply(ours_y, rows, pos, k, kernel, True, bias, expert, ours_w)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want, **out_tol)
    out.backward(dout)
    assert ours_w.grad.dtype == dtype and bias.grad is None
    torch.testing.assert_close(ours_y.grad.float(), want_dy, rtol=0, atol=0)
    torch.testing.assert_close(ours_w.grad.float(), want_dw, **tol)
    assert want_dw.abs().max() > 1  # (a gradient of the bias's terms, not a zero that matches a zero)

    empty_y, empty_w = y.clone().requires_grad_(), weight.clone().requires_grad_()
    with _Made() as made:
        zero = Combine.apply(empty_y, rows, pos, k, kernel, False, bias, expert, empty_w)
    assert all(nbytes <= zero.element_size() for _, nbytes in made.ops), made.ops  # nothing of the bias's terms
    assert zero.shape == want.shape and zero.stride() == (0, 0) and not zero.any()
    with _Made() as made:
        zero.backward(dout)
    torch.testing.assert_close(empty_y.grad, ours_y.grad, rtol=0, atol=0)
    torch.testing.assert_close(empty_w.grad, ours_w.grad, rtol=0, atol=0)
    # the sorted rows' size made once, y's gradient: the weight's comes of a [tokens, experts] product
    assert [name for name, nbytes in made.ops if nbytes >= y.numel() * y.element_size()] == ["index_select"]
    assert "mm" in [name for name, _ in made.ops]

    frozen_y = y.clone().requires_grad_()
    out = Combine.apply(frozen_y, rows, pos, k, kernel, True, bias, expert, weight)
    with _Made() as made:
        out.backward(dout)
    torch.testing.assert_close(frozen_y.grad, ours_y.grad, rtol=0, atol=0)
    assert "mm" not in [name for name, _ in made.ops]  # no gradient for a weight that wants none


@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no_bias"])
def test_the_combine_saves_the_same_tensors_however_it_sums(kernel_device, biased: bool) -> None:
    """Torch's checkpointing pairs a forward's saved tensors with its recomputation's one by one:
    ``Combine`` saves as many, of the same shapes and dtypes, with ``value`` True or False and with
    the kernel or without. Through a non-reentrant checkpoint whose forward computes the value and
    whose recomputation does not (as moe.py's), the gradients are the plain forward's."""
    k, rows, pos, expert, y, weight, bias, dout = _combine_inputs(kernel_device, torch.float32, torch.int64)
    extra = (bias, expert) if biased else (None, None)

    def saved(kernel: bool, value: bool) -> list[tuple]:
        packed = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Combine.apply(y.clone().requires_grad_(), rows, pos, k, kernel, value, *extra,
                          weight.clone().requires_grad_())
        return packed

    ways = [saved(kernel, value) for kernel in (True, False) for value in (True, False)]
    assert ways[0] and all(way == ways[0] for way in ways)

    values = iter([True, False])

    def layer(y_: torch.Tensor, w_: torch.Tensor) -> torch.Tensor:
        return Combine.apply(y_ * 2, rows, pos, k, True, next(values), *extra, w_ * 3)

    ours_y, ours_w = y.clone().requires_grad_(), weight.clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(layer, ours_y, ours_w, use_reentrant=False)
    out.backward(dout)
    assert next(values, None) is None  # (the recomputation ran, without the value)
    plain_y, plain_w = y.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = Combine.apply(plain_y * 2, rows, pos, k, True, True, *extra, plain_w * 3)
    plain.backward(dout)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(ours_y.grad, plain_y.grad, rtol=0, atol=0)
    if biased:
        torch.testing.assert_close(ours_w.grad, plain_w.grad, rtol=0, atol=0)
        assert plain_w.grad.abs().max() > 1
    else:
        assert ours_w.grad is None and plain_w.grad is None
