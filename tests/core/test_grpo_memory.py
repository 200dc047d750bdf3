"""GRPO in the estimate and the automatic plan: the sampling phase (the group's KV cache), the scored
pass over the group (logits of the completion positions only, a chunk of completions at a time), and
an 8B QLoRA GRPO run at the defaults that fits a 16 GB card in every phase."""

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


def _scored_pass_plan():
    """The estimate of one prompt's group of 8 x 512-token rows scored in one pass."""
    from studio.core.memory import estimate_plan

    grpo = parse_config(GRPO.replace("trainer: {method: grpo}", "trainer: {method: grpo, micro_batch_size: 1, "
                                     "gradient_checkpointing: true}"))
    g = estimate_plan(LLAMA3_8B, replace(estimate(grpo, LLAMA3_8B).plan, grpo_scored_rows=0))
    assert g.plan.path == "plain" and g.plan.tokens == 8 * 512 and not g.plan.upcast
    return g


def test_the_scored_pass_holds_no_logits_and_keeps_the_base_in_bf16() -> None:
    """GRPO's scored pass over 8 x 512-token rows goes through the output head a chunk of tokens at
    a time (engine/chunked_head.py): its loss holds neither the 8 x 257 completion positions' bf16
    logits nor their gradient (2 x 0.53 GB), which it does where the head trains (a full fine-tune
    takes the model's own logits), and the step peaks in a layer's backward, not at the loss. A GRPO
    base is not upcast to fp32 by PEFT's k-bit preparation (embeddings and head stay bf16:
    engine/model.py)."""
    from studio.core.memory import estimate_plan
    from studio.core.memory.plain import grpo_loss_bytes, moments

    g = _scored_pass_plan()
    logits = 8 * 257 * LLAMA3_8B.vocab * 2  # bf16
    chunked = grpo_loss_bytes(LLAMA3_8B, g.plan)
    assert grpo_loss_bytes(LLAMA3_8B, replace(g.plan, lora_r=None)) - chunked > 2 * logits
    assert chunked < logits / 2
    step = moments(LLAMA3_8B, g.plan, g.categories["gradients"])
    assert step.layer_backward > step.loss
    assert g.phases["training step"].allocated == g.peak_allocated
    every_logit = estimate_plan(LLAMA3_8B, replace(g.plan, grpo_completion=0))  # SFT's loss: fp32, every position
    assert g.phases["training step"].allocated < every_logit.phases["training step"].allocated - 4e9
    upcast = estimate_plan(LLAMA3_8B, replace(g.plan, kbit_upcast=True))
    assert g.categories["weights"] < upcast.categories["weights"] - 1.5e9  # 128k x 4096 embeddings and head


def test_lora_reads_a_k_bit_base_s_bf16_stream_as_it_is() -> None:
    """PEFT's bitsandbytes LoRA layers do not cast their input to the adapters' fp32 under autocast
    (its plain LoRA layers over a bf16 base do): on GRPO's k-bit base q, k and v keep their input
    once, gate and up theirs once, so a layer keeps two hidden-width bf16 copies a token fewer
    than over a bf16 base, and three fewer than with the stream upcast to fp32."""
    from studio.core.memory.plain import layer_activation_bytes

    plan = _scored_pass_plan().plan
    nf4 = layer_activation_bytes(LLAMA3_8B, plan)
    bf16_base = layer_activation_bytes(LLAMA3_8B, replace(plan, weights="bf16"))
    assert bf16_base - nf4 == 3 * 2 * LLAMA3_8B.hidden


BENCH = """
model: {base_model: meta-llama/Meta-Llama-3-8B}
data: {path: prompts.jsonl, max_seq_length: 400}
lora: {r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
trainer: {method: grpo, micro_batch_size: 1, effective_batch_size: 1, gradient_checkpointing: true}
grpo: {num_generations: 8, max_completion_length: 256, beta: 0.0, rewards: [{name: exact_match, column: answer}]}
"""
"""bench/grpo_speed.py's Studio run: one 128-token prompt a step, 8 completions of 256 tokens."""


def test_the_scored_pass_goes_in_chunks_until_the_sampling_holds_as_much() -> None:
    """bench/grpo_speed.py's run (one prompt, 8 completions, set explicitly): the scored pass of 8 x
    400-token rows would be the run's largest phase by over a GB; halved to 4 completions a pass it
    still is, at 2 the sampling (every row's KV cache) holds as much, and there it stops: 4 passes.
    The run's peak (every phase) comes down by over a GB, and no lower chunk is taken for the
    allocator's rounding."""
    from studio.core.memory import estimate_plan
    from studio.core.memory.estimate import grpo_scored_rows

    result = estimate(parse_config(BENCH), LLAMA3_8B)
    plan = result.plan
    assert (plan.rows, plan.grpo_scored_rows, plan.passes, plan.tokens) == (8, 2, 4, 2 * 400)
    assert grpo_scored_rows(LLAMA3_8B, plan) == 2

    def at(rows: int):
        return estimate_plan(LLAMA3_8B, replace(plan, grpo_scored_rows=rows)).phases

    for rows in (8, 4):  # the scored pass is the largest phase: halving it lowers the run's peak
        assert at(rows)["training step"].allocated > at(rows)[GRPO_SAMPLING].allocated
        assert at(rows // 2)["training step"].allocated < at(rows)["training step"].allocated
    assert at(2)["training step"].allocated <= at(2)[GRPO_SAMPLING].allocated
    assert at(2)[GRPO_SAMPLING] == replace(at(8)[GRPO_SAMPLING], reserved=at(2)[GRPO_SAMPLING].reserved)
    whole = estimate_plan(LLAMA3_8B, replace(plan, grpo_scored_rows=0))
    assert whole.plan.passes == 1 and whole.peak_reserved - result.peak_reserved > 1.0e9
    assert result.peak_reserved == max(p.reserved for p in result.phases.values())
    assert any("2 at a time (4 forward and backward passes)" in note for note in result.notes)


def test_earlier_chunks_gradients_are_alive_through_the_later_ones() -> None:
    """One micro-batch a step, so no accumulation: yet a chunked scored pass's later chunks run
    beside the earlier chunks' LoRA gradients, which the loss moment counts (and a single pass does
    not)."""
    from studio.core.memory.plain import moments

    plan = estimate(parse_config(BENCH), LLAMA3_8B).plan
    assert plan.accumulation == 1 and plan.passes > 1
    grads = 2**27
    chunked = moments(LLAMA3_8B, plan, grads)
    alone = moments(LLAMA3_8B, replace(plan, grpo_scored_rows=plan.rows, micro_batch=plan.micro_batch), grads)
    one_pass_same_size = moments(LLAMA3_8B, replace(plan, micro_batch=1, sequences_per_example=plan.pass_rows,
                                                    grpo_scored_rows=0), grads)
    assert alone.loss > chunked.loss  # the whole group's activations outweigh the gradients
    assert chunked.loss - one_pass_same_size.loss == grads


def test_the_plan_weighs_the_passes_of_a_chunked_scored_pass() -> None:
    """The automatic plan's speed proxy charges each forward and backward pass its fixed cost: a
    micro-batch that needs more passes is slower than one of as many tokens in fewer. On a 16 GB
    card the defaults sample 8 prompts' 64 completions at once (what makes sampling fast), scored a
    chunk at a time, every phase within the card less headroom (the first test)."""
    from studio.core.memory.autoplan import relative_speed

    assert relative_speed(8192, True, passes=4) < relative_speed(8192, True, passes=1)
    planned = plan_or_smallest(parse_config(GRPO), LLAMA3_8B, T4)
    assert planned.plan is not None
    chosen = estimate(planned.config, LLAMA3_8B).plan
    assert chosen.micro_batch == 8 and chosen.checkpointing and chosen.passes == 4
    recomputed_not = [c for c in planned.plan.rejected if not c.checkpointing]  # a row or two a pass
    assert recomputed_not and all(c.speed < planned.plan.chosen.speed for c in recomputed_not)
