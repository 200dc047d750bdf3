"""A mixture of experts' expert weights in 4 bits (studio/engine/quantized_experts.py), on the CPU
through bitsandbytes' CPU backend: a 4-bit load packs them and frees their 16-bit tensors; the
fast path over the packed experts gives transformers' loss and LoRA gradients on the same weights,
and stays within NF4's rounding of the 16-bit model's; generation, PEFT's expert adapters and the
plain forward read them dequantized for each forward (engine/expert_weights.py)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from test_fast_families import _batch, _check_family, _grads
from test_fast_moe import CASES, _config, _peft

from studio.core.config import RunConfig
from studio.engine import fast
from studio.engine.quantized_experts import ExpertsLoad, packed_experts, quantize_experts

pytest.importorskip("bitsandbytes")


def _experts(model) -> list:
    return [m for m in model.modules() if packed_experts(m)]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    error = float((got - want).norm() / want.norm())
    assert error < rel, f"{what}: relative error {error:.3f} (allowed: {rel:.3f})"


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_path_over_4bit_experts_is_transformers_on_the_same_weights(name: str, monkeypatch) -> None:
    """Packed experts: the fast path's loss and every LoRA gradient (the experts' included) equal
    transformers' forward on the weights lent to it, padded and packed, host-held inputs."""
    model = _peft(_config(name))
    assert quantize_experts(model, "nf4", double_quant=True) == sum(
        1 for m in model.modules() if hasattr(m, "gate_up_proj") and type(m).__name__.endswith("Experts"))
    _check_family(model, monkeypatch, padded_reference=name == "gpt_oss")


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_4bit_experts_without_adapters_give_the_attention_s_gradients(name: str, monkeypatch) -> None:
    """LoRA on the attention only: transformers' backward on the weights lent to it (gpt-oss'
    experts multiply by the parameter itself, which autograd saves) and the fast path agree."""
    model = _peft(_config(name), experts=False)
    quantize_experts(model, "nf4", double_quant=True)
    _check_family(model, monkeypatch, padded_reference=name == "gpt_oss")


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("nf4", False), ("fp4", True)])
def test_4bit_experts_train_like_the_16bit_model_within_rounding(quant_type: str, double_quant: bool) -> None:
    """The packed experts are the original ones within 4-bit rounding (each expert in its place), and
    the step's loss and LoRA gradients (the experts' included) move by no more than a few times that
    rounding (a random two-layer model: the second layer's routing moves with the first's output)."""
    batch = _batch(packing=False)
    reference = _peft(_config("olmoe"))
    fast_model, _ = fast.prepare(reference)
    expected_loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    expected_loss.backward()
    expected = _grads(reference)

    model = _peft(_config("olmoe"))
    originals = {id(m): {n: getattr(m, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
                 for m in model.modules() if type(m).__name__.endswith("Experts")}
    quantize_experts(model, quant_type, double_quant)
    rounding = 0.0
    for module in _experts(model):
        for name, packed in packed_experts(module).items():
            original = originals[id(module)][name]
            error = float((packed.dequantize(torch.float32) - original).norm() / original.norm())
            assert error < (0.11 if quant_type == "nf4" else 0.14), f"{name}: {error:.3f}"
            rounding = max(rounding, error)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    assert all(layer.gate_up.weights.packed is not None for layer in fast_model.layers)
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    got = _grads(model)
    assert got.keys() == expected.keys() and any("experts" in n for n in got)
    assert abs(float(loss.detach() - expected_loss.detach())) < 0.01 * float(expected_loss.detach())
    _close(torch.cat([got[k].flatten() for k in expected]), torch.cat([g.flatten() for g in expected.values()]),
           3 * rounding, "LoRA gradients")


def _moe_folder(folder: Path, name: str = "qwen3_moe", **overrides) -> Path:
    """A tiny random checkpoint of ``name`` (its config with ``overrides``) stored in bfloat16 as the
    Hub ships one (a tensor per expert) with the tiny model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    torch.manual_seed(0)
    config = _config(name, **overrides)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_4bit_load_packs_the_experts_and_frees_their_16bit_tensors(tmp_path: Path, monkeypatch) -> None:
    """quantization.bits 4 (bitsandbytes' CPU backend kept): every experts module's weights are
    packed at half a byte a value and the parameters hold nothing; transformers'
    forward and generation read the packed weights (the same model with the dequantized experts as
    plain parameters answers alike), and free them again after each layer."""
    from studio.engine.generate import generate
    from studio.engine.model import load_base

    folder = _moe_folder(tmp_path / "base")
    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits, config.quantization.on_cpu = 4, "keep"
    base = load_base(config, device=torch.device("cpu"))
    assert base.quantization == "nf4", base.warnings
    experts = _experts(base.model)
    assert len(experts) == 2  # Qwen3-MoE's middle layer is dense

    def freed() -> bool:
        return all(getattr(m, n).untyped_storage().nbytes() <= getattr(m, n).element_size()
                   for m in experts for n in packed_experts(m))

    assert freed()
    for module in experts:
        for name, packed in packed_experts(module).items():
            param = getattr(module, name)
            assert packed.packed.numel() * packed.packed.element_size() == param.numel() // 2, name  # 4 bits a value
            assert tuple(param.shape) == packed.shape

    # What the VRAM pane measures: the packed experts apart from the other weights, none counted twice
    from studio.engine.memory import parameter_bytes

    packed_bytes = sum(w.nbytes() for m in experts for w in packed_experts(m).values())
    measured = parameter_bytes(base.model)
    # code tables bitsandbytes shares count once; the placeholders hold one value each
    assert 0.9 * packed_bytes < measured["experts"] <= packed_bytes + 4 * 4

    # The same 4-bit load with the experts left as bitsandbytes leaves them, given the dequantized weights
    monkeypatch.setattr("studio.engine.quantized_experts.experts_packed_on_load", lambda: nullcontext(ExpertsLoad()))
    monkeypatch.setattr("studio.engine.quantized_experts.quantize_experts", lambda *args: 0)
    plain = load_base(config, device=torch.device("cpu")).model
    unpacked = [m for m in plain.modules() if type(m).__name__.endswith("Experts")]
    for module, packed in zip(unpacked, experts, strict=True):
        for name, weights in packed_experts(packed).items():
            assert getattr(module, name).untyped_storage().nbytes() == weights.param.numel() * 4  # fp32 on the CPU
            getattr(module, name).data = weights.dequantize(torch.float32)
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(base.model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert freed()
    prompt = ids[0].tolist()
    result = generate(base.model, base.tokenizer, prompt, max_new_tokens=8)
    assert result.token_ids == generate(plain, base.tokenizer, prompt, max_new_tokens=8).token_ids
    assert freed()


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"])
def test_gate_up_read_in_halves_trains_as_read_whole(name: str, kernels: bool, monkeypatch) -> None:
    """Packed gate/up dequantized and multiplied in two halves of its output features (the
    workspace then holds half of it): the loss and every LoRA gradient of reading it whole, within
    fp32 rounding of the backward's two summed products. With the kernels (Triton's interpreter on
    the CPU), the activation reads the halves where their products wrote them (gpt-oss: interleaved,
    gate/up's bias added inside it, down's in the combine's sum)."""
    import studio.engine.fast.moe as moe

    if kernels:  # the model is on the CPU: the kernels in Triton's interpreter
        pytest.importorskip("triton")
        if torch.cuda.is_available():  # where Triton was imported before the switch (kernels.py's docstrings)
            pytest.skip("the interpreter runs on CPU machines; on a GPU test_expert_activation.py runs the kernels "
                        "compiled, bench/moe.py the real shapes")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    batch = _batch(packing=False)
    results = []
    for parts in ({"gate_up_proj": 2}, {}):
        monkeypatch.setattr(moe, "PARTS", parts)
        model = _peft(_config(name))
        quantize_experts(model, "nf4", double_quant=True)
        fast_model, why = fast.prepare(model)
        assert fast_model is not None, why
        sparse = [layer.moe for layer in fast_model.layers if isinstance(getattr(layer, "moe", None), moe.SparseMlp)]
        assert sparse and {m.gate_up.weights.parts for m in sparse} == {2 if parts else 1}
        assert {m.down.weights.parts for m in sparse} == {1}
        assert {m.kernels and moe.expert_activation.available(torch.device("cpu"), torch.float32)
                for m in sparse} == {kernels}
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (halves, got), (whole, want) = results
    assert torch.allclose(halves, whole, rtol=1e-6)
    assert got.keys() == want.keys() and any("experts" in n for n in got)
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-7), key


@pytest.mark.parametrize(("name", "overrides"), [(n, {}) for n in CASES] + [("gpt_oss", {"intermediate_size": 96})])
def test_the_estimate_knows_when_gate_up_is_read_in_halves(name: str, overrides: dict) -> None:
    """core/memory/fast.py's gate_up_in_halves (which sizes the shared buffer in the estimate,
    torch-free) says what the engine does for each family's packed experts, halves or whole (gpt-oss
    with an intermediate of 96: each row's half, 96 values, is not whole 64-value blocks)."""
    import studio.engine.fast.moe as moe
    from studio.core.memory.fast import gate_up_in_halves
    from studio.core.model.info import from_config_dict

    config = _config(name, **overrides)
    model = _peft(config)
    quantize_experts(model, "nf4", double_quant=True)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    parts = {layer.moe.gate_up.weights.parts for layer in fast_model.layers
             if isinstance(getattr(layer, "moe", None), moe.SparseMlp)}
    assert parts in ({1}, {2})
    assert gate_up_in_halves(from_config_dict(config.to_dict(), name)) == (parts == {2}) == (not overrides)
