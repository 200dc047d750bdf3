"""The fast path's memory model where the family grid (bench/vram_measure.py --grid families) found it
wrong: the evaluation after the last step, which runs once the CUDA graphs' pools are given back.
Each expectation is counted from tensor sizes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from studio.core.config import parse_config
from studio.core.memory import Plan, estimate_plan, fast, plan_for
from studio.core.memory.allocator import PAGE, SLACK_FLOOR
from studio.core.model.info import load_model_info
from studio.core.plan import graphs_for

SMOLLM3 = load_model_info("HuggingFaceTB/SmolLM3-3B")

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
    pool = fast.graph_pool_bytes(SMOLLM3, 4096, 2)
    beside = estimate_plan(SMOLLM3, LONG_ROW)
    after = estimate_plan(SMOLLM3, replace(LONG_ROW, evaluates_between_steps=False))
    step = beside.phases["training step"]
    assert after.phases["training step"] == step
    evaluation = beside.phases["evaluation"]
    assert after.phases["evaluation"].allocated == evaluation.allocated
    # reserved: what the pass needs on top of what persists, pool or not, never below the step's own
    need = math.ceil((evaluation.allocated + pool + SLACK_FLOOR) / PAGE) * PAGE
    assert evaluation.reserved == need > step.reserved
    assert after.phases["evaluation"].reserved == max(
        step.reserved, math.ceil((evaluation.allocated + SLACK_FLOOR) / PAGE) * PAGE) == step.reserved
    assert beside.peak_phase == "evaluation" and after.peak_phase == "training step"
    assert after.peak_reserved == step.reserved < beside.peak_reserved


def test_without_graphs_there_is_no_pool_to_give_back() -> None:
    """An eager step (too many tokens for a graph) has no private pool: every evaluation is the same."""
    eager = replace(LONG_ROW, micro_batch=4)
    assert not graphs_for(eager.real_tokens, 0.0, cuda=True)
    assert estimate_plan(SMOLLM3, eager).phases == estimate_plan(
        SMOLLM3, replace(eager, evaluates_between_steps=False)).phases
