"""engine/fast/expert_activation.py: a sparse layer's gated activation times each row's routing weight
in one Triton kernel forward and one backward (SiLU with gate's columns first: Qwen3-MoE, OLMoE,
Mixtral; gpt-oss' clamped SwiGLU with gate and up interleaved).

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); on a GPU compiled. Each
is checked against the torch operations moe.py runs without it (in fp32); test_fast_moe.py runs the
mixture-of-experts families' training step with the kernels against transformers' own model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from test_fast_moe import _config  # noqa: E402

from studio.core.decoder import describe_decoder  # noqa: E402
from studio.engine.fast import expert_activation  # noqa: E402
from studio.engine.fast.moe import SparseMlp  # noqa: E402

SILU = describe_decoder(_config("qwen3_moe").to_dict()).moe
CLAMPED = describe_decoder(_config("gpt_oss").to_dict()).moe


def _torch_way(spec, gu: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What moe.py computes without the kernel."""
    return SparseMlp(torch.zeros(spec.experts, 8), None, None, spec, None, 0).activate(gu) * weight[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(70, 200), (33, 130), (16, 256), (1, 520)])
@pytest.mark.parametrize("spec", [SILU, CLAMPED], ids=["silu", "clamped_interleaved"])
def test_the_kernels_give_the_activation_times_the_weight_and_their_gradients(kernel_device, spec, rows, width,
                                                                               dtype) -> None:
    """Forward ``act(gate, up) x w`` and the gradients of gate/up (written over it) and of each
    row's weight, against autograd through the torch operations in fp32: edge tiles (rows and
    columns that are not multiples of a block), a row longer than the backward's step along it,
    values on both sides of gpt-oss' limit and on it (where a clamp passes its gradient)."""
    gen = torch.Generator().manual_seed(rows + width)
    gu = (4 * torch.randn(rows, 2 * width, generator=gen))
    limit = spec.swiglu_limit
    gu[0, :6] = torch.tensor([limit, -limit, limit + 1, -limit - 1, 12.0, -12.0])  # interleaved: gate, up, ...
    gu = gu.to(kernel_device, dtype)
    weight = torch.rand(rows, generator=gen).to(kernel_device, dtype)
    dout = torch.randn(rows, width, generator=gen).to(kernel_device, dtype)

    leaves = [gu.float().requires_grad_(), weight.float().requires_grad_()]
    want = _torch_way(spec, *leaves)
    want.backward(dout.float())

    got = expert_activation.routed_activation(gu, weight, spec)
    dgu, dweight = expert_activation.routed_activation_backward_(gu.clone(), weight, dout, spec)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype]
    for name, value, ref in (("output", got, want.detach()), ("gate/up", dgu, leaves[0].grad),
                             ("weight", dweight, leaves[1].grad)):
        assert value.dtype == dtype and value.shape == ref.shape, name
        err = (value.float() - ref).abs().max().item()
        assert err <= 4 * tol * max(ref.abs().max().item(), 1.0), (name, err, ref.abs().max().item())
    if spec is CLAMPED:  # the clamps' edges: on the bounds the gradient passes, beyond them none
        assert (dgu[0, :2] != 0).all() and dgu[0, 2:4].tolist() == [0.0, 0.0]


def test_the_backward_writes_over_gate_up_s_output(kernel_device) -> None:
    gu = torch.randn(20, 2 * 64).to(kernel_device, torch.bfloat16)
    dgu, _ = expert_activation.routed_activation_backward_(gu, torch.rand(20).to(gu), torch.randn(20, 64).to(gu), SILU)
    assert dgu.data_ptr() == gu.data_ptr()


def test_a_layout_or_activation_the_spec_names_reaches_the_kernel_as_it_is() -> None:
    """The kernel's constants come from the description: SiLU with gate first takes neither clamp
    nor interleaving; gpt-oss' alpha and limit are its own (build.py reads them off the module)."""
    assert expert_activation._constants(SILU) == {"alpha": 1.0, "limit": 0.0, "INTERLEAVED": False, "CLAMPED": False}
    mine = replace(CLAMPED, swiglu_alpha=1.5, swiglu_limit=5.0)
    assert expert_activation._constants(mine) == {"alpha": 1.5, "limit": 5.0, "INTERLEAVED": True, "CLAMPED": True}
