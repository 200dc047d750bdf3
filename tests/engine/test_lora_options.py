"""The CPU plan (k-bit configs load full precision without CUDA) and PEFT's LoRA variants, on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from studio.engine.model import attach_lora, load_base


def test_without_cuda_a_four_bit_config_loads_full_precision_with_a_notice(tiny_config):
    tiny_config.quantization.bits = 4
    base = load_base(tiny_config, device=torch.device("cpu"))
    assert base.quantization == "float32"
    assert not getattr(base.model, "is_loaded_in_4bit", False)
    assert len(base.warnings) == 1
    assert "no CUDA GPU" in base.warnings[0] and "quantization.on_cpu: keep" in base.warnings[0]


def test_eight_bit_follows_the_cpu_plan_too(tiny_config):
    tiny_config.quantization.bits = 8
    base = load_base(tiny_config, device=torch.device("cpu"))
    assert base.quantization == "float32" and "instead of 8-bit" in base.warnings[0]


def test_full_precision_configs_get_no_cpu_notice(tiny_config):
    tiny_config.quantization.bits = None
    assert load_base(tiny_config, device=torch.device("cpu")).warnings == []


@pytest.mark.parametrize(("use_dora", "use_rslora"), [(True, False), (False, True)])
def test_dora_and_rslora_reach_peft(tiny_config, use_dora, use_rslora):
    tiny_config.quantization.bits = None
    tiny_config.lora.r, tiny_config.lora.alpha = 16, 32
    tiny_config.lora.use_dora, tiny_config.lora.use_rslora = use_dora, use_rslora
    base = load_base(tiny_config, device=torch.device("cpu"))
    model = attach_lora(base, tiny_config)
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert adapted
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    has_magnitude = any("lora_magnitude_vector" in n for n in names)
    assert has_magnitude is use_dora
    expected = 32 / math.sqrt(16) if use_rslora else 32 / 16
    assert adapted[0].scaling["default"] == pytest.approx(expected)


def test_the_estimate_counts_dora_magnitudes_and_paged_adamw_state(tiny_config):
    from studio.core.memory import estimate
    from studio.core.model.info import load_model_info

    info = load_model_info(tiny_config.model.base_model)
    plain = estimate(tiny_config, info, None)
    tiny_config.lora.use_dora = True
    dora = estimate(tiny_config, info, None)
    magnitudes = info.layers * sum(out for _, out in info.linear_shapes().values())  # all-linear
    assert dora.categories["lora"] - plain.categories["lora"] == 4 * magnitudes  # fp32
    assert any("DoRA" in note for note in dora.notes)
    tiny_config.lora.use_dora = False
    tiny_config.trainer.optimizer = "paged_adamw"
    paged = estimate(tiny_config, info, None)
    assert paged.categories["optimizer"] == plain.categories["optimizer"]  # 32-bit m and v, as AdamW
    assert any("paged" in note for note in paged.notes)
