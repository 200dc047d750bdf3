"""engine/fast/update.py: the LoRA update added by the kernel that reads a product's output (the gated
activation for gate/up: SwiGLU, or Gemma's GeGLU; the residual's add for o and down) instead of
written by a product of its own.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU compiled. Each
is checked against the plain formula in fp32, and the fast path's products with the kernels against
the same products without them: the same values and gradients to the rounding of half precision.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_fast_path import _examples, _grads, _peft_model  # noqa: E402

from studio.core.config import FastPathConfig  # noqa: E402
from studio.engine import fast  # noqa: E402
from studio.engine.batching import collate  # noqa: E402
from studio.engine.fast import update  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}
"""Each gated activation the kernels compute, as transformers computes it."""


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few roundings of ``dtype`` of the largest value (the interpreter truncates to bf16
    where the compiled kernel rounds)."""
    eps = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 4 * eps * max(want.abs().max().item(), 1.0), (err, want.abs().max().item())


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "ffn", "rank"), [(70, 200, 8), (33, 130, 16), (16, 128, 24)])
def test_the_gated_activation_adds_the_update_and_gives_the_gradient_of_gate_and_up(
        kernel_device, dtype, rows, ffn, rank, activation) -> None:
    """Forward ``act(g) * u`` of ``gu + s * xa @ bt`` and its backward (written over ``gu``) equal
    the plain formula's in fp32 (SiLU, and GELU's tanh form as torch computes it); edge tiles (rows
    and columns that are not multiples of the block) and ranks that are not a power of two (padded
    with zeros inside) included; ``bt`` a transposed view as the adapters give it. The gates reach
    -12 and 12, where GELU's tanh saturates."""
    gen = torch.Generator().manual_seed(rank)
    gu = (3 * torch.randn(rows, 2 * ffn, generator=gen)).to(kernel_device, dtype)
    gu[0, :4] = torch.tensor([-12.0, -6.0, 6.0, 12.0])
    xa = torch.randn(rows, 2 * rank, generator=gen).to(kernel_device, dtype)
    bt = (0.2 * torch.randn(2 * ffn, 2 * rank, generator=gen)).to(kernel_device, dtype).t()  # a view, like b.t()
    dout = torch.randn(rows, ffn, generator=gen).to(kernel_device, dtype)
    scale = 2.0
    whole = (gu.float() + scale * (xa.float() @ bt.float())).requires_grad_()
    gate, up = whole.chunk(2, dim=-1)
    want = ACTS[activation](gate) * up
    (want * dout.float()).sum().backward()

    got = update.gated(gu, xa, bt, scale, activation=activation)
    _close(got, want.detach(), dtype)
    dgu = update.gated_backward_(gu.clone(), xa, bt, scale, dout, activation=activation)
    _close(dgu, whole.grad, dtype)

    # B^T block-diagonal, as the adapters make it: gate's columns read only gate's rows, up's only
    # up's (``split``); the same values as the whole inner product over the zeros.
    diag = bt.clone()
    diag[:rank, ffn:] = 0
    diag[rank:, :ffn] = 0
    want = update.gated(gu, xa, diag, scale, activation=activation)
    want_grad = update.gated_backward_(gu.clone(), xa, diag, scale, dout, activation=activation)
    split = (0, rank, rank, rank)
    _close(update.gated(gu, xa, diag, scale, split, activation), want, dtype)
    dgu = update.gated_backward_(gu, xa, diag, scale, dout, split, activation=activation)
    assert dgu.data_ptr() == gu.data_ptr()  # in place
    _close(dgu, want_grad, dtype)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gated_activation_without_an_update(kernel_device, dtype, activation) -> None:
    gu = torch.randn(40, 2 * 150).to(kernel_device, dtype)
    gate, up = gu.float().chunk(2, dim=-1)
    _close(update.gated(gu, None, None, 1.0, activation=activation), ACTS[activation](gate) * up, dtype)


def test_an_activation_the_kernels_do_not_compute_is_refused() -> None:
    """A gated MLP of another activation never reaches the kernels: Projection.gated declines it
    (the layer then runs the product and the activation apart) and the kernel's wrapper refuses it."""
    gu = torch.randn(4, 2 * 16)
    with pytest.raises(ValueError, match="not gelu"):
        update.gated(gu, None, None, 1.0, activation="gelu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_update_meets_the_base_output_before_the_residual(kernel_device, dtype) -> None:
    """``residual + round(y + update)``: the update is added to the base output and rounded as the
    product's output would be, then the stream is added (products.LoraProduct's order)."""
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(50, 140, generator=gen).to(kernel_device, dtype)
    xa = torch.randn(50, 16, generator=gen).to(kernel_device, dtype)
    bt = torch.randn(16, 140, generator=gen).to(kernel_device, dtype)
    residual = (20 * torch.randn(50, 140, generator=gen)).to(kernel_device, dtype)
    want = residual.float() + (y.float() + 0.5 * (xa.float() @ bt.float())).to(dtype).float()
    got = update.add_update_and_residual_(y.clone(), xa, bt, 0.5, residual)
    _close(got, want, dtype)


def _proj(model, names: list[str], dtype: torch.dtype, device: torch.device):
    from studio.engine.fast.frozen import Workspace
    from studio.engine.fast.projection import Projection

    layer = model.base_model.model.model.layers[0]
    parent = layer.mlp if names[0] in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
    workspace = Workspace()
    proj = Projection([getattr(parent, n) for n in names], "default", dtype, workspace)
    workspace.allocate(dtype, device)
    return proj


@pytest.mark.parametrize(("targets", "activation"), [(ALL, "silu"), (["up_proj", "o_proj"], "silu"),
                                                    (["gate_proj", "o_proj"], "silu"), (ALL, "gelu_pytorch_tanh"),
                                                    (["gate_proj", "o_proj"], "gelu_pytorch_tanh")])
def test_the_products_with_the_kernels_give_the_same_values_and_gradients(tiny_model: Path, kernel_device,
                                                                          targets, activation) -> None:
    """Projection.gated (gate/up's update added inside the gated activation: SwiGLU, GeGLU) against
    the product then the activation, and o's product with its residual against the update's own
    product: the same outputs and the same gradients of the input, the residual and each adapter,
    in bf16; with both gate and up adapted and with one of them (B^T's block diagonal then has one
    block)."""
    dtype = torch.bfloat16
    model = _peft_model(tiny_model, None, targets, dtype=dtype).to(kernel_device)
    gen = torch.Generator().manual_seed(0)

    gate_up = _proj(model, ["gate_proj", "up_proj"], dtype, kernel_device)
    x = torch.randn(2, 7, gate_up.weights.in_features, generator=gen).to(kernel_device, dtype).requires_grad_()
    dout = torch.randn(2, 7, gate_up.weights.out_features[0], generator=gen).to(kernel_device, dtype)
    results = []
    for in_kernel in (True, False):
        gate_up.in_kernel = in_kernel
        for t in (x, *gate_up.a, *gate_up.b):
            t.grad = None
        act = gate_up.gated(x, activation=activation)
        if in_kernel:
            assert act is not None
        else:
            assert act is None
            gate, up = gate_up(x).chunk(2, dim=-1)
            act = ACTS[activation](gate.float()) * up.float()
        (act.float() * dout.float()).sum().backward()
        results.append((act.detach().float(), [t.grad.float() for t in (x, *gate_up.a, *gate_up.b)]))
    (act0, g0), (act1, g1) = results
    _close(act0, act1, dtype)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())

    o = _proj(model, ["o_proj"], dtype, kernel_device)
    x = torch.randn(2, 7, o.weights.in_features, generator=gen).to(kernel_device, dtype).requires_grad_()
    r = (4 * torch.randn(2, 7, o.weights.out_features[0], generator=gen)).to(kernel_device, dtype).requires_grad_()
    dy = torch.randn(2, 7, o.weights.out_features[0], generator=gen).to(kernel_device, dtype)
    results = []
    for in_kernel in (True, False):
        o.in_kernel = in_kernel
        for t in (x, r, *o.a, *o.b):
            t.grad = None
        y = o(x, residual=r)
        y.backward(dy)
        results.append((y.detach(), [t.grad.float() for t in (x, r, *o.a, *o.b)]))
    (y0, g0), (y1, g1) = results
    _close(y0, y1, dtype)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_fast_path_with_the_kernels_trains_as_without_them(tiny_model: Path, kernel_device, dropout) -> None:
    """The whole fast path (all seven projections adapted, packed examples, checkpointing), in bf16
    with the kernels on and off (``trainer.fast_path.kernels``), against the same model in fp32: the
    kernels' loss and adapter gradients are as close to fp32's as the products' own order is (bf16
    alone moves these gradients by 2-3%), with adapter dropout too (the kernels read the masked
    ``x A^T``)."""
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(kernel_device)
    runs = {}
    for dtype, on in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        model = _peft_model(tiny_model, None, ALL, dtype=dtype, dropout=dropout).to(kernel_device)
        model.train()
        fm, why = fast.prepare(model, FastPathConfig(kernels=on, cuda_graphs=False))
        assert fm is not None, why
        assert fm.layers[0].o.in_kernel is on
        loss = fm.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        runs[dtype, on] = (loss.item(), _grads(model))
    ref_loss, ref = runs[torch.float32, False]
    errors = {}
    for on in (True, False):
        loss, grads = runs[torch.bfloat16, on]
        assert abs(loss - ref_loss) < 0.005 * abs(ref_loss)
        errors[on] = [((grads[n].float() - g).norm() / g.norm()).item() for n, g in ref.items()]
    assert len(errors[True]) == 2 * 7 * 2  # A and B of every adapter of both layers
    mean_on, mean_off = (sum(e) / len(e) for e in (errors[True], errors[False]))
    assert mean_on < 1.5 * mean_off + 0.005, (mean_on, mean_off)
    assert max(errors[True]) < 0.08, max(errors[True])


def test_a_kernel_that_cannot_build_leaves_the_products_their_own_order(tiny_model: Path, kernel_device,
                                                                        monkeypatch) -> None:
    """If the kernels fail (a Triton that cannot compile them here), the step still runs, with the
    update written by its own product, and the engine says so: a warning, and the products no longer
    take the kernels' way."""
    model = _peft_model(tiny_model, None, ALL, dtype=torch.bfloat16).to(kernel_device)
    batch = collate([[e] for e in _examples([12, 9])], pad_id=0, packing=True).to(kernel_device)
    fm, why = fast.prepare(model, FastPathConfig(cuda_graphs=False))
    assert fm is not None, why
    assert fm.layers[0].gate_up.in_kernel

    def fail():
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(update, "_kernels", fail)
    monkeypatch.setattr(update.KERNELS, "_broken", {})
    with pytest.warns(RuntimeWarning, match="LoRA update kernels failed"):
        loss = fm.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert update.broken()
    assert fm.layers[0].down.handoff() is None
    expected, _ = fast.prepare(model, FastPathConfig(cuda_graphs=False))  # built with the kernels given up on
    assert not expected.layers[0].gate_up.in_kernel
    with torch.no_grad():
        want = expected.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    assert abs(loss.item() - want.item()) < 1e-3 * abs(want.item())


@pytest.mark.parametrize(("recompute", "activation"), [(False, "silu"), (True, "silu"),
                                                      (False, "gelu_pytorch_tanh"), (True, "gelu_pytorch_tanh")])
def test_down_hands_its_lora_input_gradient_to_the_activations_backward(tiny_model: Path, kernel_device, recompute,
                                                                        activation) -> None:
    """gate/up -> SwiGLU or GeGLU -> down, with down's LoRA input-gradient term handed to the
    activation's backward (update.Handoff) against the same chain with every update in its own
    product: the same output and the same gradients of the input and of all three adapters; the
    recomputation's down (no value, only a backward) too. The handoff is spent: a second backward
    would find it empty."""
    dtype = torch.bfloat16
    model = _peft_model(tiny_model, None, ["gate_proj", "up_proj", "down_proj"], dtype=dtype).to(kernel_device)
    gate_up = _proj(model, ["gate_proj", "up_proj"], dtype, kernel_device)
    down = _proj(model, ["down_proj"], dtype, kernel_device)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, gate_up.weights.in_features, generator=gen).to(kernel_device, dtype).requires_grad_()
    r = (4 * torch.randn(2, 9, down.weights.out_features[0], generator=gen)).to(kernel_device, dtype)
    dy = torch.randn(2, 9, down.weights.out_features[0], generator=gen).to(kernel_device, dtype)
    params = (x, *gate_up.a, *gate_up.b, *down.a, *down.b)
    results = []
    for on in (True, False):
        gate_up.in_kernel = down.in_kernel = on
        for t in params:
            t.grad = None
        handoff = down.handoff()
        assert (handoff is not None) is on
        if on:
            act = gate_up.gated(x, handoff=handoff, activation=activation)
        else:
            gate, up = gate_up(x).chunk(2, dim=-1)
            act = ACTS[activation](gate) * up
        if recompute:
            y = down(act, value=False, handoff=handoff)
        else:
            y = down(act, residual=r, handoff=handoff)
        y.backward(dy)
        if on:
            assert handoff.take() is None  # the activation's backward took the term
        results.append((y.detach().float(), [t.grad.float() for t in params]))
    (y0, g0), (y1, g1) = results
    if not recompute:
        _close(y0, y1, dtype)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())


def test_a_small_update_survives_the_residual_kernel_in_bf16(tiny_model: Path, kernel_device) -> None:
    """The residual kernel keeps the plain order's rounding (products.LoraProduct): an update under
    half the stream's last bf16 digit meets the base output first, so it reaches the output on
    average instead of rounding away against the stream (test_fast_path's test of the same name
    for the products' own order)."""
    dtype = torch.bfloat16
    model = _peft_model(tiny_model, None, ["down_proj"], dtype=dtype).to(kernel_device)
    proj = _proj(model, ["down_proj"], dtype, kernel_device)
    proj.in_kernel = True
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, proj.weights.in_features, generator=gen).to(kernel_device, dtype)
    stream = (8 + 8 * torch.rand(1, 512, sum(proj.weights.out_features), generator=gen)).to(kernel_device, dtype)
    with torch.no_grad():
        a, bt, scale = proj.adapters()
        upd = scale * (x.float() @ a.float().t()) @ bt.float()
        proj.b[0].mul_(1 / 256 / upd.std().item())  # a sixteenth of the stream's last digit
        upd = scale * (x.float() @ a.float().t()) @ proj.adapters()[1].float()
        assert (upd.abs() < 1 / 32).float().mean() > 0.999
        moved = proj(x, residual=stream).float() - proj(x, residual=stream, adapters=(None, None, 1.0)).float()
    slope = float((moved * upd).sum() / (upd * upd).sum())
    assert slope > 0.7, slope


def test_a_row_count_compiles_no_kernel_of_its_own(monkeypatch) -> None:
    """The kernels' row count changes with the batch: Triton is told not to compile a case apart for
    a multiple of 16 or for 1 (a compile in the middle of a run otherwise); the other integers
    (widths, ranks) keep their cases."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = update.KERNELS.get()
    assert kernels is not None
    for name, kernel in kernels.items():
        told = set(kernel.do_not_specialize)
        assert told & {"n_rows", kernel.arg_names.index("n_rows")}, name
        assert "ffn" not in told and "n_cols" not in told, name
