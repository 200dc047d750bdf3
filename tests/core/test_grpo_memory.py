"""GRPO in the estimate and the automatic plan: the sampling phase (the group's KV cache) and the
scored pass over the group (logits of the completion positions only), and an 8B QLoRA GRPO run at the
defaults that fits a 16 GB card in every phase."""

from __future__ import annotations

from dataclasses import replace

from studio.core.config import parse_config
from studio.core.memory import CUDA_CONTEXT_BYTES, PHASES, estimate
from studio.core.memory.autoplan import plan_or_smallest
from studio.core.memory.result import GRPO_SAMPLING
from studio.core.model.info import KNOWN_MODELS

LLAMA3_8B = KNOWN_MODELS["meta-llama/Meta-Llama-3-8B"]
T4 = 15_360 * 2**20
"""A 16 GB card as CUDA reports it (a T4: 15,360 MiB)."""

GRPO = """
model: {base_model: meta-llama/Meta-Llama-3-8B}
data: {path: prompts.jsonl}
trainer: {method: grpo}
grpo: {rewards: [{name: exact_match, column: answer}]}
"""


def test_an_8b_grpo_run_at_the_defaults_fits_16_gb_in_every_phase() -> None:
    config = parse_config(GRPO)  # NF4, r16 on every projection, 8 completions of 256 tokens, 512-token rows
    planned = plan_or_smallest(config, LLAMA3_8B, T4)
    assert planned.plan is not None, planned.lines()
    chosen = planned.config.trainer
    assert chosen.effective_batch() == 16  # prompts a step, kept through accumulation
    result = estimate(planned.config, LLAMA3_8B)
    assert set(result.phases) == {*PHASES, GRPO_SAMPLING}
    budget = T4 - planned.plan.headroom
    for name, phase in result.phases.items():
        assert phase.reserved + CUDA_CONTEXT_BYTES <= budget, (name, phase)
    sampling = result.phases[GRPO_SAMPLING]
    rows = chosen.micro_batch() * 8
    kv = LLAMA3_8B.layers * 2 * LLAMA3_8B.kv_heads * LLAMA3_8B.head_width * rows * 512 * 2  # bf16
    assert f"KV cache of {rows} rows x 512 slots ({kv / 1e9:.2f} GB)" in sampling.held
    assert sampling.allocated > kv + result.categories["weights"]


def test_the_sampling_phase_grows_with_the_group_and_the_completion() -> None:
    config = parse_config(GRPO.replace("trainer: {method: grpo}", "trainer: {method: grpo, micro_batch_size: 1, "
                                       "gradient_checkpointing: true}"))
    base = estimate(config, LLAMA3_8B)
    config.grpo.num_generations = 16
    bigger_group = estimate(config, LLAMA3_8B)
    config.grpo.num_generations, config.data.max_seq_length, config.grpo.max_completion_length = 8, 1024, 768
    longer = estimate(config, LLAMA3_8B)
    for grown in (bigger_group, longer):
        assert grown.phases[GRPO_SAMPLING].allocated > base.phases[GRPO_SAMPLING].allocated
        assert grown.phases["training step"].allocated > base.phases["training step"].allocated
    sft = estimate(parse_config(GRPO.replace("method: grpo", "method: sft")), LLAMA3_8B)
    assert GRPO_SAMPLING not in sft.phases


def test_the_scored_pass_takes_logits_of_the_completion_only_and_keeps_the_base_in_bf16() -> None:
    """GRPO's scored pass over 8 x 512-token rows keeps bf16 logits of 257 positions a row where the
    plain path's SFT loss takes fp32 logits of all 512; and a GRPO base is not upcast to fp32 by
    PEFT's k-bit preparation (embeddings and head stay bf16: engine/model.py)."""
    from studio.core.memory import estimate_plan

    grpo = parse_config(GRPO.replace("trainer: {method: grpo}", "trainer: {method: grpo, micro_batch_size: 1, "
                                     "gradient_checkpointing: true}"))
    g = estimate(grpo, LLAMA3_8B)
    assert g.plan.path == "plain" and g.plan.tokens == 8 * 512 and not g.plan.upcast
    every_logit = estimate_plan(LLAMA3_8B, replace(g.plan, grpo_completion=0))
    assert g.phases["training step"].allocated < every_logit.phases["training step"].allocated - 4e9
    upcast = estimate_plan(LLAMA3_8B, replace(g.plan, kbit_upcast=True))
    assert g.categories["weights"] < upcast.categories["weights"] - 1.5e9  # 128k x 4096 embeddings and head
