"""The fast path's memory model where the family grid (bench/vram_measure.py --grid families) found it
wrong: the evaluation after the last step, which runs once the CUDA graphs' pools are given back, and
a GeGLU MLP's copies of gate and up where its activation runs outside Studio's kernel. Each
expectation is counted from tensor sizes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from studio.core.config import parse_config
from studio.core.memory import ALL_LINEAR, Plan, estimate_plan, fast, plan_for
from studio.core.memory.allocator import PAGE, SLACK_FLOOR
from studio.core.model.info import load_model_info
from studio.core.plan import graphs_for

SMOLLM3 = load_model_info("HuggingFaceTB/SmolLM3-3B")
GEMMA3 = load_model_info("google/gemma-3-4b-it")

LONG_ROW = Plan(weights="nf4", lora_r=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.0, micro_batch=1,
                seq_len=4096, path="fast", generate_new_tokens=64)
"""One 4096-token row a micro-batch, LoRA r8 on q and v: a CUDA graph, and an evaluation pass of a
whole row (a row longer than the evaluation's 512 tokens runs alone)."""


@pytest.mark.parametrize(("yaml", "between"), [
    ("trainer: {eval_interval: 0, max_steps: 5}\n", False),
    ("trainer: {eval_interval: 50, max_steps: 5}\n", False),   # the first interval is past the last step
    ("trainer: {eval_interval: 5, max_steps: 5}\n", False),    # ... or is the last step, after the pools go
    ("trainer: {eval_interval: 2, max_steps: 5}\n", True),
    ("trainer: {eval_interval: 50}\n", True),                  # the data decides the steps: it may come
])
def test_an_evaluation_between_steps_is_read_off_the_interval_and_the_steps(yaml: str, between: bool) -> None:
    assert plan_for(parse_config(yaml)).evaluates_between_steps is between


def test_the_last_evaluation_runs_after_the_graphs_pools_are_given_back() -> None:
    """engine/train.py gives the CUDA graphs and their private pools back before the evaluation that
    follows the last step, and the evaluation empties the allocator's cache first: that evaluation
    reserves what persists and its own pass, not the pool beside them. An evaluation between two
    steps still sits beside the pool. SmolLM3-3B at 4096 tokens: beside the pool its pass reserves
    more than the training step (the run's peak); after the last step the step sets the peak."""
    assert graphs_for(LONG_ROW.real_tokens, 0.0, cuda=True)
    pool = fast.graph_pool_bytes(SMOLLM3, 4096, 2, fast.gate_in_kernel(LONG_ROW))
    beside = estimate_plan(SMOLLM3, LONG_ROW)
    after = estimate_plan(SMOLLM3, replace(LONG_ROW, evaluates_between_steps=False))
    step = beside.phases["training step"]
    assert after.phases["training step"] == step
    evaluation = beside.phases["evaluation"]
    # between two steps the graphs' fixed gradient tensors are held too; after the last, not
    assert evaluation.gradients == beside.step_categories["gradients"] > 0 == after.phases["evaluation"].gradients
    assert after.phases["evaluation"].allocated == evaluation.allocated - evaluation.gradients
    # reserved: what the pass needs on top of what persists, pool or not, never below the step's own
    need = math.ceil((evaluation.allocated + pool + SLACK_FLOOR) / PAGE) * PAGE
    assert evaluation.reserved == need > step.reserved
    assert after.phases["evaluation"].reserved == max(
        step.reserved, math.ceil((after.phases["evaluation"].allocated + SLACK_FLOOR) / PAGE) * PAGE) == step.reserved
    assert beside.peak_phase == "evaluation" and after.peak_phase == "training step"
    assert after.peak_reserved == step.reserved < beside.peak_reserved


def test_without_graphs_there_is_no_pool_to_give_back() -> None:
    """An eager step (too many tokens for a graph) has no private pool: every evaluation is the same."""
    eager = replace(LONG_ROW, micro_batch=4)
    assert not graphs_for(eager.real_tokens, 0.0, cuda=True)
    assert estimate_plan(SMOLLM3, eager).phases == estimate_plan(
        SMOLLM3, replace(eager, evaluates_between_steps=False)).phases


def test_a_geglu_layer_copies_gate_and_up_only_where_its_activation_runs_outside_studio_s_kernel() -> None:
    """Gemma's MLP (GELU-tanh) runs in Studio's gated kernel (engine/fast/update.py) where gate or up
    has an adapter and the kernels are on: it reads gate/up's output where it is, as SwiGLU's does.
    Elsewhere (``trainer.fast_path.kernels: false``, or no adapter on gate and up) it goes through
    liger's GELU-and-multiply kernel, which takes gate and up contiguous: the recomputed layer copies
    both halves of gate/up's output, two ``tokens x intermediate`` tensors, while that output is
    alive. Gemma-3-4B (intermediate 10,240) at 4 x 1024 tokens in bf16: 2 x 4096 x 10,240 x 2 B =
    168 MB more in the step's working set, and in the graph's pool that holds it, than the same
    shape with SiLU."""
    assert GEMMA3.activation == "gelu_pytorch_tanh" and SMOLLM3.activation == "silu"
    assert fast.gelu_copies_per_token(GEMMA3, 2, gate_in_kernel=False) == 2 * 10240 * 2
    assert fast.gelu_copies_per_token(GEMMA3, 2, gate_in_kernel=True) == 0
    assert fast.gelu_copies_per_token(SMOLLM3, 2, gate_in_kernel=False) == 0
    silu = replace(GEMMA3, activation="silu")
    tokens = 4096
    copies = tokens * 2 * GEMMA3.intermediate * 2
    assert copies == 167_772_160
    for in_kernel, extra in ((False, copies), (True, 0)):
        assert fast.step_activations(GEMMA3, tokens, 2, in_kernel) - fast.step_activations(silu, tokens, 2,
                                                                                             in_kernel) == extra
        assert fast.graph_pool_bytes(GEMMA3, tokens, 2, in_kernel) - fast.graph_pool_bytes(silu, tokens, 2,
                                                                                            in_kernel) == extra
    plan = Plan(weights="nf4", lora_r=16, lora_targets=ALL_LINEAR, lora_dropout=0.0, micro_batch=4, seq_len=1024,
                path="fast")
    outside = (replace(plan, kernels=False), replace(plan, lora_targets=("q_proj", "v_proj")))
    assert fast.gate_in_kernel(plan) and not any(fast.gate_in_kernel(p) for p in outside)
    assert fast.gate_in_kernel(replace(plan, lora_targets=("up_proj",)))
    for each, extra in ((plan, 0), *((p, copies) for p in outside)):
        gelu_step, silu_step = estimate_plan(GEMMA3, each), estimate_plan(silu, each)
        assert gelu_step.peak_allocated - silu_step.peak_allocated == extra
        assert abs(gelu_step.phases["training step"].reserved - silu_step.phases["training step"].reserved
                   - extra) <= PAGE


def test_a_model_whose_every_mlp_is_a_mixture_of_experts_copies_nothing() -> None:
    """A sparse layer's experts run engine/fast/moe.py's own products, not the dense MLP's kernel."""
    moe = load_model_info("Qwen/Qwen3-30B-A3B")
    assert moe.sparse_layers == moe.layers
    assert fast.gelu_copies_per_token(replace(moe, activation="gelu_pytorch_tanh"), 2, gate_in_kernel=False) == 0


def test_a_mixture_of_experts_keeps_each_sparse_layer_s_routing_on_the_device() -> None:
    """The forward keeps each sparse layer's routing for its recomputation (engine/fast/routing.py's
    KeptRouting): Qwen3-30B-A3B's 48 layers, 8 copies a token, each a one-byte expert (128 of them)
    and an int32 place in the sort: 1,920 bytes a token on top of what a dense model keeps
    (3.9 MB at 2,048 tokens); none for a dense model."""
    moe = load_model_info("Qwen/Qwen3-30B-A3B")
    dense = replace(moe, sparse_layers=0)
    assert fast.saved_per_token(moe, 2) - fast.saved_per_token(dense, 2) == 48 * 8 * (1 + 4) == 1920
    assert fast.saved_per_token(replace(moe, experts=512), 2) - fast.saved_per_token(dense, 2) == 48 * 8 * (2 + 4)
    qkv = (SMOLLM3.heads + 2 * SMOLLM3.kv_heads) * SMOLLM3.head_width
    assert fast.saved_per_token(SMOLLM3, 2) == (2 * SMOLLM3.hidden + qkv) * 2
