"""``lora.target_experts``: the experts' adapters as PEFT's ``target_parameters`` (engine/model.py's
attach_lora), saved and loaded back with ``PeftModel`` on the tiny mixtures of experts, counted by
the estimator as PEFT builds them, and refused on a dense model naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fast_moe import CASES, _config

from studio.core.config import ConfigError, RunConfig
from studio.core.memory.params import expert_lora_params, trainable_params
from studio.core.memory.plan import plan_for
from studio.core.model.info import from_config_dict
from studio.engine.model import BaseModel, attach_lora, save_adapter


def _base(config) -> BaseModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return BaseModel(model, None, torch.device("cpu"), torch.float32, "float32", "tiny")


def _run_config(experts: bool) -> RunConfig:
    config = RunConfig()
    config.model.base_model = "tiny"
    config.lora.r, config.lora.alpha = 4, 8
    config.lora.target_modules = ["q_proj", "v_proj"]
    config.lora.target_experts = experts
    return config


@pytest.mark.parametrize("name", list(CASES))
def test_expert_adapters_save_and_load_with_peft_and_are_counted(name: str, tmp_path: Path) -> None:
    """Every sparse layer's gate/up and down get an adapter; the saved folder loads with
    PeftModel.from_pretrained on a fresh base and gives the trained model's logits; the estimator's
    trainable parameters are PEFT's."""
    from peft import PeftModel

    config = _config(name)
    run = _run_config(experts=True)
    model = attach_lora(_base(config), run)
    expert_adapters = {n: p for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    sparse = sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert len(expert_adapters) == 2 * 2 * sparse and all(p.requires_grad for p in expert_adapters.values())
    with torch.no_grad():  # B starts at zero: give the adapters something to carry
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        with model.disable_adapter():
            untuned = model(input_ids=ids).logits
    assert (trained - untuned).abs().max() > 1e-3
    save_adapter(model, tmp_path / "adapter")

    loaded = PeftModel.from_pretrained(_base(config).model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained)

    info = from_config_dict(config.to_dict(), name)
    plan = plan_for(run, info=info)
    assert expert_lora_params(info, plan) == sum(p.numel() for p in expert_adapters.values())
    assert trainable_params(info, plan) == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("experts", [False, True])
def test_all_linear_adapts_what_the_estimate_counts_and_never_the_router(name: str, experts: bool,
                                                                          tmp_path: Path) -> None:
    """The default ``lora.target_modules: all-linear`` on a mixture of experts: adapters on the
    attention (and Qwen3-MoE's dense layer's MLP) only, the experts only when ``target_experts``
    asks, the router frozen and unadapted; the run takes the fast path (on a GPU) and the estimate
    counts PEFT's trainable parameters. PEFT 0.21 alone reads all-linear here as the experts and the
    router too, at twice the rank on gate/up (the 24 GB Qwen3-30B-A3B run that took the plain path
    and ran out of memory). The adapter saved loads back with the same modules adapted."""
    from peft import PeftModel

    from studio.core.plan import PathFacts, choose_path, fast_targets
    from studio.engine.fast.build import path_facts
    from studio.engine.model import load_adapter

    config = _config(name)
    run = _run_config(experts=experts)
    run.lora.target_modules = "all-linear"
    model = attach_lora(_base(config), run)
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    modules = {n.rsplit(".", 1)[-1] for n in adapted if ".experts" not in n}
    dense = {"gate_proj", "up_proj", "down_proj"} if name == "qwen3_moe" else set()
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"} | dense, modules
    assert not [n for n in adapted if ".router" in n or n.endswith(".gate") or ".gate." in n]
    routers = [p for n, p in model.named_parameters() if ".mlp.gate." in n or ".mlp.router." in n]
    assert routers and not any(p.requires_grad for p in routers)
    expert_adapters = [n for n in adapted if ".experts" in n]
    assert bool(expert_adapters) == experts
    if name == "qwen3_moe":  # the dense layer's MLP keeps its own adapters, not the experts'
        assert [n for n in adapted if n.endswith("mlp.gate_proj")]

    facts = path_facts(model, torch.device("cpu"))
    assert set(facts.lora_targets) <= set(fast_targets()), facts.lora_targets
    assert choose_path(PathFacts(**{**facts.__dict__, "cuda": True})).path == "fast"
    info = from_config_dict(config.to_dict(), name)
    plan = plan_for(run, info=info)
    assert trainable_params(info, plan) == sum(p.numel() for p in model.parameters() if p.requires_grad)

    save_adapter(model, tmp_path / "adapter")
    reloaded = load_adapter(_base(config), tmp_path / "adapter")
    assert isinstance(reloaded, PeftModel)
    assert {n.split(".lora_")[0] for n, _ in reloaded.named_parameters() if ".lora_A" in n} == adapted


def test_off_leaves_the_experts_without_adapters() -> None:
    model = attach_lora(_base(_config("mixtral")), _run_config(experts=False))
    assert not [n for n, _ in model.named_parameters() if "experts" in n and "lora_" in n]


def test_a_dense_model_is_refused_naming_the_key() -> None:
    from transformers import AutoConfig

    from studio.core.memory.estimate import estimate

    config = AutoConfig.for_model("llama", vocab_size=300, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(ConfigError, match="lora.target_experts"):
        attach_lora(_base(config), _run_config(experts=True))
    with pytest.raises(ValueError, match="lora.target_experts"):
        estimate(_run_config(experts=True), from_config_dict(config.to_dict(), "llama"))


@pytest.mark.usefixtures("on_cpu")
def test_a_merged_export_with_expert_adapters_loads_in_transformers_and_answers_like_the_adapter(
        tmp_path: Path) -> None:
    """``studio export --format merged`` of a run with expert adapters on a bf16 mixture of experts:
    the experts' updates merged into the 3-D weights, a folder transformers loads as the base class
    with the adapted model's logits."""
    from peft import PeftModel
    from test_quantized_experts import _moe_folder
    from transformers import AutoModelForCausalLM

    from studio.core.runs import create_run
    from studio.engine.exporting import export_run

    folder = _moe_folder(tmp_path / "base", "olmoe")
    run_config = _run_config(experts=True)
    run_config.model.base_model, run_config.output_dir = str(folder), str(tmp_path / "runs")
    run = create_run(run_config)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = attach_lora(BaseModel(base, None, torch.device("cpu"), torch.float32, "float32", str(folder)), run_config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    save_adapter(model, run.adapter_dir)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                        str(run.adapter_dir)).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert result.ok, result.message
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged) is type(adapted.get_base_model())
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            assert (adapted(input_ids=ids).logits - expected).abs().max() > 1e-2
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
