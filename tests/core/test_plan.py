"""The training-path decision (studio/core/plan.py) that the estimator and the engine share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studio.core.decoder.spec import PROJECTIONS
from studio.core.paths import sample_data_dir
from studio.core.plan import (
    GRAPH_TOKEN_LIMIT,
    PathFacts,
    choose_path,
    graphs_for,
    lora_targets,
    model_blocker,
)

LLAMA = json.loads((sample_data_dir() / "model_configs/meta-llama/Llama-3.1-8B/config.json").read_text())
QWEN3 = json.loads((sample_data_dir() / "model_configs/Qwen/Qwen3-8B/config.json").read_text())


def _facts(**changes) -> PathFacts:
    base = dict(cuda=True, weights="nf4", lora_targets=PROJECTIONS, lora_dropout=0.0,
                model_blocker=model_blocker(LLAMA))
    return PathFacts(**{**base, **changes})


def test_a_llama_qlora_run_on_a_gpu_takes_the_fast_path_with_graphs() -> None:
    choice = choose_path(_facts())
    assert (choice.path, choice.cuda_graphs, choice.checkpointing) == ("fast", True, True)
    # adapter dropout keeps the graphs: its masks come from a seed each replay reads (fast/dropout.py)
    assert choose_path(_facts(lora_dropout=0.05)).cuda_graphs is True
    assert choose_path(_facts(lora_dropout=0.05)).path == "fast"


@pytest.mark.parametrize(("changes", "words"), [
    ({"cuda": False}, "CUDA"),
    ({"weights": "int8"}, "8-bit"),
    ({"lora_targets": ("q_proj", "lm_head")}, "lm_head"),
    ({"lora_targets": ()}, "no LoRA"),
    ({"env": "0"}, "STUDIO_FAST_PATH=0"),
    ({"method": "grpo"}, "trainer.method is grpo"),
    ({"dora": True}, "DoRA"),
    ({"model_blocker": model_blocker(dict(QWEN3, hidden_act="relu"))}, "relu-gated MLPs"),
    ({"model_blocker": model_blocker({"model_type": "gpt2", "activation_function": "gelu"})}, "gpt2"),
])
def test_what_rules_the_fast_path_out_is_named(changes: dict, words: str) -> None:
    choice = choose_path(_facts(**changes))
    assert choice.path == "plain" and words in choice.reason


def test_preference_runs_take_the_fast_path_and_say_how() -> None:
    """DPO and ORPO train on the fast path (their per-answer log-probs from the fused loss); DPO's
    reason names its reference pass, ORPO (no reference) does not; SFT's names its loss."""
    dpo, orpo, sft = (choose_path(_facts(method=m)) for m in ("dpo", "orpo", "sft"))
    assert (dpo.path, orpo.path, dpo.cuda_graphs) == ("fast", "fast", True)
    assert "log-prob from the fused cross-entropy" in dpo.reason and "reference pass" in dpo.reason
    assert "log-prob" in orpo.reason and "reference" not in orpo.reason
    assert sft.reason.endswith("fused cross-entropy") and "log-prob" not in sft.reason


def test_the_fast_path_settings_reach_the_decision() -> None:
    """trainer.fast_path's cuda_graphs and host_offload (PathFacts.from_config) turn those parts off
    in the plan the estimator and the engine share, and in what it says; the path stays fast."""
    from studio.core.config import RunConfig

    config = RunConfig()
    config.trainer.fast_path.cuda_graphs = False
    facts = PathFacts.from_config(config, cuda=True, weights="nf4", model_blocker="")
    assert (facts.cuda_graphs, facts.host_offload) == (False, True)
    choice = choose_path(facts)
    assert (choice.path, choice.cuda_graphs, choice.host_offload) == ("fast", False, True)
    assert "CUDA graphs" not in choice.reason and "host memory" in choice.reason
    choice = choose_path(_facts(host_offload=False))
    assert (choice.cuda_graphs, choice.host_offload) == (True, False) and "host memory" not in choice.reason
    assert choice.to_json_dict()["host_offload"] is False


def test_the_environment_forces_the_fast_path_on_a_cpu() -> None:
    assert choose_path(_facts(cuda=False, env="1")).path == "fast"
    assert choose_path(_facts(cuda=False, env="1")).cuda_graphs is False


def test_all_linear_means_the_seven_projections() -> None:
    assert lora_targets("all-linear") == PROJECTIONS
    assert lora_targets(["q_proj", "v_proj"]) == ("q_proj", "v_proj")


def test_the_engine_reads_the_same_facts_off_the_loaded_model(tiny_model: Path, monkeypatch) -> None:
    """The live model and its config files lead to the same decision."""
    monkeypatch.delenv("STUDIO_FAST_PATH", raising=False)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from studio.engine.fast.build import path_facts

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    live = path_facts(model, torch.device("cuda"))
    config = json.loads((tiny_model / "config.json").read_text())
    from_files = PathFacts(cuda=True, weights="bf16", lora_targets=("q_proj", "v_proj"), lora_dropout=0.1,
                           model_blocker=model_blocker(config))
    assert live == from_files
    assert choose_path(live) == choose_path(from_files)


def test_cuda_graphs_only_for_micro_batches_where_the_host_dominates() -> None:
    assert graphs_for(512, 0.0, cuda=True) and graphs_for(GRAPH_TOKEN_LIMIT, 0.0, cuda=True)
    assert not graphs_for(GRAPH_TOKEN_LIMIT + 1, 0.0, cuda=True)  # 16 x 512 tokens: eager
    assert graphs_for(512, 0.05, cuda=True) and not graphs_for(512, 0.0, cuda=False)
