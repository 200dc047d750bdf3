"""The 4-bit experts' 16-bit working set in transformers' forward without gradients
(core/memory/expert_groups.py): a group of experts, not a whole layer's (but with PEFT's expert
adapter), counted in the generation phase and in the plain path's evaluation; each expectation
counted from the models' shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from studio.core.memory import Plan, estimate_plan
from studio.core.memory.expert_groups import EXPERT_GROUP_BYTES, experts_per_group, lent_expert_bytes
from studio.core.model.info import load_model_info

GPT_OSS = load_model_info("openai/gpt-oss-20b")
QWEN3_MOE = load_model_info("Qwen/Qwen3-30B-A3B")


def _expert(info) -> int:
    """One expert's gate, up and down in bf16."""
    return 3 * info.hidden * info.expert_intermediate * 2


@pytest.mark.parametrize(("info", "experts", "per_layer"), [
    (GPT_OSS, 5, 32 * 3 * 2880 * 2880 * 2),    # 50 MB an expert, 1.59 GB a layer
    (QWEN3_MOE, 28, 128 * 3 * 2048 * 768 * 2),  # 9.4 MB an expert, 1.21 GB a layer
])
def test_a_group_is_as_many_experts_as_fit_the_budget(info, experts: int, per_layer: int) -> None:
    expert = _expert(info)
    assert info.experts * expert == per_layer
    assert experts_per_group(expert) == experts
    assert experts * expert <= EXPERT_GROUP_BYTES < (experts + 1) * expert
    assert lent_expert_bytes(info, Plan(weights="nf4")) == experts * expert < per_layer / 4
    # PEFT's expert adapter adds its delta to the whole parameter: the layer dequantized, and the sum
    assert lent_expert_bytes(info, Plan(weights="nf4", lora_experts=True)) == 2 * per_layer
    # experts bitsandbytes' 8-bit loading or a 16-bit load leaves as they are: nothing dequantized
    assert lent_expert_bytes(info, Plan(weights="int8")) == lent_expert_bytes(info, Plan(weights="bf16")) == 0


def test_a_layer_of_fewer_experts_than_a_group_holds_them_all_and_a_dense_model_none() -> None:
    few = replace(QWEN3_MOE, experts=8)
    assert lent_expert_bytes(few, Plan(weights="nf4")) == 8 * _expert(QWEN3_MOE)
    assert lent_expert_bytes(load_model_info("HuggingFaceTB/SmolLM3-3B"), Plan(weights="nf4")) == 0
    assert experts_per_group(2 * EXPERT_GROUP_BYTES) == 1  # an expert larger than the budget goes alone


@pytest.mark.parametrize("info", [GPT_OSS, QWEN3_MOE])
@pytest.mark.parametrize("path", ["plain", "fast"])
def test_the_answer_counts_a_group_of_experts_instead_of_one_dense_weight(info, path: str, monkeypatch) -> None:
    """Generation (both paths) and the plain path's evaluation run transformers' forward without
    gradients: they hold a group of experts in 16 bits where they held one dequantized attention
    weight; the fast path's evaluation (its own forward) and the training step do not change. A step
    of 8 x 1024 tokens: larger than the answer, whose KV cache then stays on the card either way."""
    plan = Plan(weights="nf4", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), micro_batch=8,
                seq_len=1024, path=path, generate_new_tokens=64)
    grouped = estimate_plan(info, plan).phases
    monkeypatch.setattr("studio.core.memory.phases.lent_expert_bytes", lambda *_: 0)
    before = estimate_plan(info, plan).phases
    dense = max(a * b for a, b in info.linear_shapes().values()) * 2
    more = lent_expert_bytes(info, plan) - dense
    assert more > 200e6
    assert not grouped["generation"].host_kv and not before["generation"].host_kv
    changed = {"generation"} | ({"evaluation"} if path == "plain" else set())
    for phase, peak in grouped.items():
        assert peak.allocated - before[phase].allocated == (more if phase in changed else 0), phase


@pytest.mark.parametrize("info", [GPT_OSS, QWEN3_MOE])
@pytest.mark.parametrize("experts_adapted", [False, True])
def test_grpo_sampling_counts_a_group_in_the_prefill_and_the_whole_layer_in_the_captured_step(
        info, experts_adapted: bool, monkeypatch) -> None:
    """GRPO's sampling: the eager prefill lends a group of experts (the whole layer twice over with
    expert adapters) where a dense model dequantizes one weight, and the captured decode step, which
    cannot run groups, keeps the whole layer (and PEFT's adapted copy) in its pool."""
    from studio.core.memory.expert_groups import captured_expert_bytes
    from studio.core.memory.result import GRPO_SAMPLING

    plan = Plan(weights="nf4", lora_r=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), micro_batch=4,
                seq_len=1024, path="fast", grpo_completion=256, lora_experts=experts_adapted)
    counted = estimate_plan(info, plan).phases[GRPO_SAMPLING].allocated
    monkeypatch.setattr("studio.core.memory.phases.lent_expert_bytes", lambda *_: 0)
    monkeypatch.setattr("studio.core.memory.phases.captured_expert_bytes", lambda *_: 0)
    dense_only = estimate_plan(info, plan).phases[GRPO_SAMPLING].allocated
    dense = max(a * b for a, b in info.linear_shapes().values()) * 2
    layer = info.experts * _expert(info)
    lent = 2 * layer if experts_adapted else experts_per_group(_expert(info)) * _expert(info)
    assert captured_expert_bytes(info, plan) == (2 if experts_adapted else 1) * layer
    assert counted - dense_only == (lent - dense) + ((2 if experts_adapted else 1) * layer - dense)
