"""Full fine-tuning (``lora: null``) in the estimator, `studio estimate` and the gauge's numbers:
hand-computed bytes for the Llama-2-7B shape, the plain path, the categories a person reads."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from studio.cli.estimate import main as estimate_main
from studio.core.config import parse_config
from studio.core.memory import CATEGORIES, OPTIONAL_CATEGORIES, estimate, plan_for, walkthrough
from studio.core.memory.gpus import GB
from studio.core.model.info import KNOWN_MODELS
from studio.core.plan import PathFacts, choose_path

LLAMA7 = KNOWN_MODELS["meta-llama/Llama-2-7b-hf"]
N = 6_738_415_616  # Llama-2-7B's parameters: 32 x 202,383,360 per layer + 2 x 32000 x 4096 + the final norm


def _config(extra: str = ""):
    return parse_config("model: {base_model: meta-llama/Llama-2-7b-hf}\nlora: null\n" + extra)


def test_the_llama_2_7b_shape_has_the_parameter_count_the_hand_sums_use():
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert 32 * per_layer + 2 * 32000 * 4096 + 4096 == N == LLAMA7.total_params()


def test_bf16_full_fine_tuning_with_torch_adamw_is_8_bytes_a_parameter_plus_activations():
    result = estimate(_config(), LLAMA7, 80 * GB)
    c = result.categories
    # bf16 weights (2 B), bf16 gradients (2 B), torch AdamW's m and v in the parameter's dtype (2 x 2 B)
    assert c["weights"] == 2 * N
    assert c["gradients"] == 2 * N
    assert c["optimizer"] == 4 * N
    assert c["lora"] == 0
    assert (c["weights"] + c["gradients"] + c["optimizer"]) / GB == pytest.approx(53.9, abs=0.1)
    assert result.path == "plain" and "full fine-tuning" in result.choice.reason
    assert c["activations"] > 0 and sum(c.values()) == result.total
    assert any("full fine-tuning" in note and "no fp32 master copy" in note for note in result.notes)


@pytest.mark.parametrize(("optimizer", "state_bytes"), [
    ("paged_adamw", 8 * N),  # bitsandbytes' 32-bit state is fp32 whatever the weights' dtype
    ("adamw_8bit", None),    # 1 byte each for m and v plus an fp32 absmax per 256 (norms stay 32-bit)
])
def test_optimizer_state_of_a_full_fine_tune_follows_the_optimizer(optimizer, state_bytes):
    result = estimate(_config(f"trainer: {{optimizer: {optimizer}}}\n"), LLAMA7, 80 * GB)
    if state_bytes is None:
        norms = 65 * 4096
        big = N - norms
        state_bytes = 2 * (big + 4 * -(-big // 256)) + 8 * norms
    assert result.categories["optimizer"] == state_bytes


def test_fp32_full_fine_tuning_is_16_bytes_a_parameter():
    c = estimate(_config("quantization: {compute_dtype: float32}\n"), LLAMA7, 80 * GB).categories
    assert (c["weights"], c["gradients"], c["optimizer"]) == (4 * N, 4 * N, 8 * N)


def test_full_fine_tuning_takes_the_plain_path_even_where_the_fast_path_is_forced():
    facts = PathFacts(cuda=True, weights="bf16", lora_targets=(), full_finetune=True, env="1")
    assert choose_path(facts).path == "plain"
    plan = plan_for(_config())
    assert plan.lora_r is None and plan.weights == "bf16" and plan.lora_targets == ()


def test_studio_estimate_says_full_fine_tuning_and_prints_every_category(tmp_path, capsys):
    path = tmp_path / "full.yaml"
    path.write_text("model: {base_model: meta-llama/Llama-2-7b-hf}\nlora: null\n")
    assert estimate_main(Namespace(config=str(path), gpu_gb=80.0, json=False, model=None)) == 0
    out = capsys.readouterr().out
    assert "BF16 weights, full fine-tuning" in out and "path: plain (full fine-tuning: the fast path" in out
    for name in CATEGORIES:  # a dense model has no experts to list
        assert (f"  {name}" in out) == (name not in OPTIONAL_CATEGORIES)
    assert estimate_main(Namespace(config=str(path), gpu_gb=80.0, json=True, model=None)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["lora_r"] is None and data["path"] == "plain"
    assert data["categories"]["gradients"] == 2 * N


def test_the_gauge_walkthrough_of_a_full_fine_tune_config_still_has_its_lora_steps():
    steps = walkthrough(_config(), LLAMA7, 80 * GB)
    lora_step = next(s for s in steps if s.title == "LoRA on 8-bit")
    assert lora_step.estimate.categories["lora"] > 0
    assert steps[1].estimate.categories["optimizer"] == 4 * N  # "Full fine-tune, bf16" = this config's state
