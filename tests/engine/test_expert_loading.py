"""A 4-bit load packs a mixture of experts' expert weights as transformers loads them
(engine/quantized_experts.py's experts_packed_on_load), on the CPU through bitsandbytes' CPU
backend: bit for bit the weights packing after the load gives, so the same answers; the model and
its quantizer look as after any 4-bit load; PEFT's expert adapters attach and the fast path reads
the packed weights; a packing that fails fails the 4-bit load instead of leaving random experts; and
the load holds one projection's expert weights unpacked at a time, where packing after the load held
every layer's. Tiny random Qwen3-MoE, Mixtral and OLMoE checkpoints stored as the Hub ships them (a
tensor per expert), with the tiny tokenizer."""

from __future__ import annotations

import gc
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from test_fast_families import _check_family
from test_quantized_experts import _moe_folder

from bench.moe_load_peak import ExpertBytesProbe, expert_bytes
from studio.core.config import RunConfig
from studio.core.decoder.spec import EXPERT_PARAMETERS
from studio.engine import fast
from studio.engine.model import load_base
from studio.engine.quantized_experts import ExpertsLoad, packed_experts

pytest.importorskip("bitsandbytes")

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
CPU = torch.device("cpu")


def _run_config(folder: Path) -> RunConfig:
    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits, config.quantization.on_cpu = 4, "keep"
    return config


def _packing_after_the_load(monkeypatch) -> None:
    """The loader as before issue 42: the experts load in 16 bits and are packed once loaded."""
    monkeypatch.setattr("studio.engine.quantized_experts.experts_packed_on_load", lambda: nullcontext(ExpertsLoad()))


def _experts(model) -> list:
    return [m for m in model.modules() if packed_experts(m)]


def _state_tensors(state) -> list[torch.Tensor]:
    found = []
    while state is not None:
        found += [t for t in (state.absmax, state.code, state.offset) if torch.is_tensor(t)]
        state = state.state2
    return found


@pytest.mark.parametrize("name", FAMILIES)
def test_packing_on_load_gives_the_weights_and_answers_packing_after_the_load_gives(
        name: str, tmp_path: Path, monkeypatch) -> None:
    """Every projection of every experts module packed during the load, bit for bit as packing the
    loaded 16-bit weights packs them (values, scales, their double quantization); the parameters
    hold nothing; the same logits and the same generation; no warning (packing after the load warns)."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    from studio.engine.generate import generate

    config = _run_config(_moe_folder(tmp_path / name, name))
    base = load_base(config, device=CPU)
    assert base.quantization == "nf4" and base.warnings == []
    model = base.model
    # As after any bitsandbytes 4-bit load: what PEFT, saving and Studio read
    assert model.is_loaded_in_4bit and isinstance(model.hf_quantizer, Bnb4BitHfQuantizer)
    assert model.config.quantization_config.quant_method == "bitsandbytes"
    assert AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"] is Bnb4BitHfQuantizer  # transformers' table put back

    with monkeypatch.context() as patch:
        _packing_after_the_load(patch)
        after = load_base(config, device=CPU)
    assert len(after.warnings) == 1 and "packed in 4 bits after the load" in after.warnings[0], after.warnings

    experts, reference = _experts(model), _experts(after.model)
    assert len(experts) == len(reference) == 2  # Qwen3-MoE's middle layer of three is dense
    for module, packed_after in zip(experts, reference, strict=True):
        assert set(packed_experts(module)) == set(EXPERT_PARAMETERS)
        for param_name, weights in packed_experts(module).items():
            want = packed_experts(packed_after)[param_name]
            assert torch.equal(weights.packed, want.packed), param_name
            got_state, want_state = _state_tensors(weights.quant_state), _state_tensors(want.quant_state)
            assert len(got_state) == len(want_state) == 5  # absmax, code, offset; the scales' absmax and code
            assert all(torch.equal(a, b) for a, b in zip(got_state, want_state, strict=True)), param_name
            param = getattr(module, param_name)
            assert param is weights.param and tuple(param.shape) == weights.shape
            assert param.untyped_storage().nbytes() <= param.element_size()  # nothing held in 16 bits

    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, after.model(input_ids=ids).logits)
    prompt = ids[0].tolist()
    answer = generate(model, base.tokenizer, prompt, max_new_tokens=8).token_ids
    assert answer == generate(after.model, base.tokenizer, prompt, max_new_tokens=8).token_ids


def test_expert_adapters_attach_to_a_loaded_model_and_the_fast_path_reads_its_packed_experts(
        tmp_path: Path, monkeypatch) -> None:
    """lora.target_experts on a model whose experts were packed as they loaded: PEFT's adapters on
    the experts attach; the fast path reads the packed weights and gives the loss and every LoRA
    gradient transformers' forward gives on the weights lent to it."""
    from studio.engine.model import attach_lora

    config = _run_config(_moe_folder(tmp_path / "olmoe", "olmoe"))
    config.lora.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    config.lora.target_experts = True
    base = load_base(config, device=CPU)
    model = attach_lora(base, config)
    adapted = [n for n, _ in model.named_parameters() if "experts" in n and "lora_A" in n]
    assert len(adapted) == 2 * len(_experts(model))
    with torch.no_grad():  # B starts at zero in LoRA, which would make every A gradient zero
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(std=0.05)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    assert all(layer.gate_up.weights.packed is not None and layer.down.weights.packed is not None
               for layer in fast_model.layers)
    _check_family(model, monkeypatch)


def test_a_packing_that_fails_fails_the_4bit_load_instead_of_leaving_random_experts(
        tmp_path: Path, monkeypatch) -> None:
    """transformers logs a failed conversion and initializes that weight at random; the loader
    refuses such a model: on the CPU the base loads unquantized (the checkpoint's weights) with a
    warning naming the projection and the error."""
    from studio.engine import quantized_experts

    folder = _moe_folder(tmp_path / "mixtral", "mixtral")
    packing, calls = quantized_experts._quantize, []

    def failing(values, *args):
        calls.append(values.shape)
        if len(calls) == 3:
            raise RuntimeError("out of memory (injected)")
        return packing(values, *args)

    monkeypatch.setattr(quantized_experts, "_quantize", failing)
    base = load_base(_run_config(folder), device=CPU)
    assert base.quantization == "float32" and not _experts(base.model)
    assert any("packing the expert weights in 4 bits failed (model.layers.1.mlp.experts." in w
               and "out of memory (injected)" in w for w in base.warnings), base.warnings
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for (got_name, got), (want_name, want) in zip(base.model.named_parameters(), saved.named_parameters(), strict=True):
        assert got_name == want_name and torch.equal(got, want), got_name


@pytest.mark.parametrize("name", FAMILIES)
def test_the_load_holds_one_projection_of_expert_weights_unpacked_not_every_layers(
        name: str, tmp_path: Path, monkeypatch) -> None:
    """Four sparse layers of eight experts. Counting, each time a projection is packed, the expert
    weights alive in floating point on the device (the projection, per-expert checkpoint tensors,
    stacks, layers not packed yet): packing on load never holds more than one layer's, and holds one
    projection's; packing after the load held all four layers' at once (the instrument sees it)."""
    sizes = {"qwen3_moe": dict(num_experts=8, moe_intermediate_size=48, mlp_only_layers=[]),
             "mixtral": dict(num_local_experts=8, intermediate_size=48),
             "olmoe": dict(num_experts=8, intermediate_size=48)}[name]
    folder = _moe_folder(tmp_path / name, name, num_hidden_layers=4, **sizes)
    shape = json.loads((folder / "config.json").read_text())
    one_layer, every_layer = expert_bytes(shape, 1, 4), expert_bytes(shape, 4, 4)  # fp32 on the CPU
    gate_up = one_layer * 2 // 3

    probe = ExpertBytesProbe(shape, CPU)
    with probe.watching():
        base = load_base(_run_config(folder), device=CPU)
    assert base.quantization == "nf4" and base.warnings == []
    assert len(probe.samples) == 8  # two projections in each of four layers, each packed once
    assert probe.peak <= one_layer
    assert probe.peak == gate_up  # the projection being packed is what is alive: the count sees it
    del base
    gc.collect()

    with monkeypatch.context() as patch:
        _packing_after_the_load(patch)
        after = ExpertBytesProbe(shape, CPU)
        with after.watching():
            load_base(_run_config(folder), device=CPU)
    assert len(after.samples) == 8
    assert after.peak >= every_layer


def test_a_checkpoint_with_fused_experts_packs_them_on_load_too(tmp_path: Path) -> None:
    """A checkpoint that stores each layer's experts as the 3-D tensors transformers 5 holds (no
    per-expert tensors to stack): its projections are packed on load as well, to the same model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hub = _moe_folder(tmp_path / "hub", "olmoe")
    fused = _moe_folder(tmp_path / "fused", "olmoe")
    weights = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.bfloat16).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in weights
    (fused / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(fused / "model.safetensors"),
              metadata={"format": "pt"})

    base = load_base(_run_config(fused), device=CPU)
    assert base.quantization == "nf4" and base.warnings == []
    assert [set(packed_experts(m)) for m in _experts(base.model)] == [set(EXPERT_PARAMETERS)] * 2
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_base(_run_config(hub), device=CPU).model(input_ids=ids).logits
        assert torch.equal(base.model(input_ids=ids).logits, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's reserved memory is a CUDA measure")
def test_a_cuda_load_gives_back_the_memory_it_packed_the_experts_in(tmp_path: Path, monkeypatch) -> None:
    """A 4-bit load on the card holds each layer's experts in 16 bits while it packs them; once it
    has loaded, that memory is handed back to the driver, not kept free but reserved (a training
    step's peak reserved would otherwise start at the load's). Without the hand-back the instrument
    sees a layer's gate/up projection or more still reserved."""
    from studio.engine import model as model_module

    folder = _moe_folder(tmp_path / "qwen3_moe", "qwen3_moe", num_hidden_layers=2, hidden_size=512, num_experts=64,
                         moe_intermediate_size=1024, mlp_only_layers=[])
    config = _run_config(folder)
    gate_up = 64 * 2 * 1024 * 512 * 2  # one layer's gate/up in bf16: 128 MiB

    def free_but_reserved() -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    cuda = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "give_back_load_memory", lambda: None)
        base = load_base(config, device=cuda)
        kept = free_but_reserved()
    assert base.quantization == "nf4" and _experts(base.model)
    del base
    gc.collect()
    torch.cuda.empty_cache()

    base = load_base(config, device=cuda)
    assert base.quantization == "nf4" and _experts(base.model)
    given_back = free_but_reserved()
    assert kept >= gate_up, kept
    # what stays: pages partly in use (the large pool maps 20 MiB at a time, the small one 2 MiB)
    assert given_back < 48 * 2**20, given_back
