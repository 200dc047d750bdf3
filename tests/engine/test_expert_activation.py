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


def _torch_way(spec, gu: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               expert: torch.Tensor | None = None) -> torch.Tensor:
    """What moe.py computes without the kernel."""
    gu = gu + bias[expert] if bias is not None else gu
    return SparseMlp(torch.zeros(spec.experts, 8), None, None, spec, None, 0).activate(gu) * weight[:, None]


def _parts(gu: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """gate/up's output as moe.py's products give it in parts of its output features: each contiguous."""
    return [c.contiguous() for c in gu.chunk(parts, dim=1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "width"), [(70, 200), (33, 130), (16, 256), (1, 520)])
@pytest.mark.parametrize("spec", [SILU, CLAMPED], ids=["silu", "clamped_interleaved"])
@pytest.mark.parametrize(("parts", "biased"), [(1, False), (2, False), (2, True), (1, True)],
                         ids=["whole", "halves", "halves_biased", "whole_biased"])
def test_the_kernels_give_the_activation_times_the_weight_and_their_gradients(kernel_device, spec, rows, width,
                                                                               dtype, parts, biased) -> None:
    """Forward ``act(gate + bias, up + bias) x w`` and the gradients of gate/up (written over it)
    and of each row's weight, against autograd through the torch operations in fp32: edge tiles
    (rows and columns that are not multiples of a block), a row longer than the backward's step
    along it, values on both sides of gpt-oss' limit and on it (where a clamp passes its gradient);
    gate/up whole and in the two halves moe.py dequantizes it in (interleaved: a launch a half;
    gate first: gate's half and up's in one launch), with and without each row's expert's bias."""
    gen = torch.Generator().manual_seed(rows + width)
    gu = (4 * torch.randn(rows, 2 * width, generator=gen))
    limit = spec.swiglu_limit
    gu[0, :6] = torch.tensor([limit, -limit, limit + 1, -limit - 1, 12.0, -12.0])  # interleaved: gate, up, ...
    experts = 5
    bias = torch.randn(experts, 2 * width, generator=gen) if biased else None
    expert = torch.randint(0, experts, (rows,), generator=gen) if biased else None
    if biased:
        bias[expert[0], :6] = 0  # row 0's clamp edges stay where they are
        bias, expert = bias.to(kernel_device, dtype), expert.to(kernel_device)
    gu = gu.to(kernel_device, dtype)
    weight = torch.rand(rows, generator=gen).to(kernel_device, dtype)
    dout = torch.randn(rows, width, generator=gen).to(kernel_device, dtype)

    leaves = [gu.float().requires_grad_(), weight.float().requires_grad_()]
    want = _torch_way(spec, *leaves, bias.float() if biased else None, expert)
    want.backward(dout.float())

    got = expert_activation.routed_activation(_parts(gu, parts), weight, spec, bias, expert)
    dparts, dweight = expert_activation.routed_activation_backward_(_parts(gu, parts), weight, dout, spec, bias,
                                                                    expert)
    dgu = torch.cat(dparts, dim=1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype]
    for name, value, ref in (("output", got, want.detach()), ("gate/up", dgu, leaves[0].grad),
                             ("weight", dweight, leaves[1].grad)):
        assert value.dtype == dtype and value.shape == ref.shape, name
        err = (value.float() - ref).abs().max().item()
        assert err <= 4 * tol * max(ref.abs().max().item(), 1.0), (name, err, ref.abs().max().item())
    if spec is CLAMPED:  # the clamps' edges: on the bounds the gradient passes, beyond them none
        assert (dgu[0, :2] != 0).all() and dgu[0, 2:4].tolist() == [0.0, 0.0]


def test_the_parts_meet_the_kernel_as_moe_py_dequantizes_them() -> None:
    """Interleaved, each half is whole gate/up pairs and writes its half of the output; gate first,
    the first half is gate's, the second up's, one launch; the bias split the same way."""
    gu, bias = torch.arange(2 * 8.0).view(1, 16), torch.arange(3 * 16.0).view(3, 16)
    halves = _parts(gu, 2)
    inter = expert_activation.segments(halves, CLAMPED, bias)
    assert [(s.start, s.width) for s in inter] == [(0, 4), (4, 4)]
    assert inter[1].gate is halves[1] and inter[1].bias_gate.tolist() == bias[:, 8:].tolist()
    first = expert_activation.segments(halves, SILU, bias)
    assert len(first) == 1 and first[0].gate is halves[0] and first[0].up is halves[1]
    assert first[0].bias_up.tolist() == bias[:, 8:].tolist() and (first[0].start, first[0].width) == (0, 8)
    whole = expert_activation.segments([gu], SILU)
    assert whole[0].up.tolist() == gu[:, 8:].tolist() and whole[0].bias_gate is None


def test_the_backward_writes_over_gate_up_s_output(kernel_device) -> None:
    gu = torch.randn(20, 2 * 64).to(kernel_device, torch.bfloat16)
    dgu, _ = expert_activation.routed_activation_backward_([gu], torch.rand(20).to(gu), torch.randn(20, 64).to(gu),
                                                           SILU)
    assert dgu[0].data_ptr() == gu.data_ptr()


def test_a_layout_or_activation_the_spec_names_reaches_the_kernel_as_it_is() -> None:
    """The kernel's constants come from the description: SiLU with gate first takes neither clamp
    nor interleaving; gpt-oss' alpha and limit are its own (build.py reads them off the module)."""
    assert expert_activation._constants(SILU) == {"alpha": 1.0, "limit": 0.0, "INTERLEAVED": False, "CLAMPED": False}
    mine = replace(CLAMPED, swiglu_alpha=1.5, swiglu_limit=5.0)
    assert expert_activation._constants(mine) == {"alpha": 1.5, "limit": 5.0, "INTERLEAVED": True, "CLAMPED": True}
