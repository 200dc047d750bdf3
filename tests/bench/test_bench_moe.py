"""The mixture-of-experts benchmarks on the CPU, as far as they go there (issue 42): the real shapes and
their layer subsets (bench/moe_shapes.py, bench/make_random_model.py), Studio against the HF loop on
tiny shapes of each row (bench/moe.py --tiny), the bar's arithmetic, and the emulated-card cases
through the product with what a subset's fit means (bench/card_moe.py). Unsloth and the card's
holder need a GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

from bench import make_random_model as mrm
from bench.card_moe import case_config, fit_report
from bench.moe import judge
from bench.moe_shapes import MOE_MODELS, layer_subset, tiny
from studio.core.decoder import describe_decoder


def test_the_shapes_are_the_published_models_and_gpt_oss_is_not_its_config_class_defaults() -> None:
    """A shape that lost a key falls back to transformers' defaults (GptOssConfig's are gpt-oss-120b's:
    36 layers of 128 experts) and the benchmark would measure another model."""
    sized = {name: mrm.sizes(shape) for name, shape in MOE_MODELS.items()}
    billions = {name: round(s["total_bytes"] / 2 / 1e9, 1) for name, s in sized.items()}
    assert billions == {"qwen3-30b-a3b": 30.5, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8, "mixtral-8x7b": 46.7,
                        "olmoe-1b-7b": 6.9}
    gpt_oss = mrm.hf_config(MOE_MODELS["gpt-oss-20b"])
    assert (gpt_oss.num_hidden_layers, gpt_oss.num_local_experts, gpt_oss.num_experts_per_tok) == (24, 32, 4)
    qwen = describe_decoder(mrm.hf_config(MOE_MODELS["qwen3-30b-a3b"]).to_dict())
    assert (qwen.sparse_layers, qwen.moe.experts, qwen.moe.top_k, qwen.moe.intermediate) == (48, 128, 8, 768)
    assert (qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.hidden) == (32, 4, 128, 2048)
    # the box's 64 GB disk: Qwen3-30B-A3B (61 GB) leaves no room; each layer is the same 1.25 GB
    assert mrm.layers_that_fit(sized["qwen3-30b-a3b"], 40 * 10**9) == 29
    assert mrm.layers_that_fit(sized["olmoe-1b-7b"], 40 * 10**9) == 16


def test_a_subset_keeps_each_layers_shape_and_its_build_says_what_it_is(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    shape = dict(tiny(MOE_MODELS["gpt-oss-20b"]), num_hidden_layers=4)
    assert layer_subset(shape, 3)["num_hidden_layers"] == 3
    with pytest.raises(ValueError, match="choose 1 to 4"):
        layer_subset(shape, 5)
    folder = mrm.build_model("gpt-oss-20b-tiny", shape, tmp_path / "m", layers=2)
    built = mrm.read_build(folder)
    assert (built["layers_built"], built["layers_real"], built["full_model"]) == (2, 4, False)
    assert "first 2 of gpt-oss-20b-tiny's 4 layers" in built["meaning"] and "not the whole model's" in built["meaning"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 2
    assert model.config.layer_types == ["sliding_attention", "full_attention"]  # the real model's first two
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 64, 64)
    # the same build is reused; another one in its folder is refused, not mixed in
    assert mrm.build_model("gpt-oss-20b-tiny", shape, folder, layers=2) == folder
    with pytest.raises(SystemExit, match="holds another build"):
        mrm.build_model("gpt-oss-20b-tiny", shape, folder, layers=3)


def test_a_build_the_disk_cannot_hold_is_refused_before_anything_is_built(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mrm, "free_bytes", lambda folder: 40 * 10**9)
    out = tmp_path / "qwen3"
    with pytest.raises(SystemExit) as refused:
        mrm.build("qwen3-30b-a3b", out)
    message = str(refused.value)
    assert "the whole model in bf16 needs 61.1 GB" in message and "40.0 GB is free" in message
    assert "--layers 29 or fewer" in message and "/dev/shm" in message
    assert not out.exists()
    with pytest.raises(SystemExit, match="20 of its 32 layers in bf16 needs 58.6 GB.*--layers 12 or fewer"):
        mrm.main(["--arch", "mixtral-8x7b", "--layers", "20", "--out", str(out)])


def test_the_bar_needs_the_speed_the_memory_and_the_baseline_and_says_when_a_side_has_no_number() -> None:
    good = {"studio_vs_unsloth": 1.2, "studio_vs_baseline": 3.5, "studio_peak_reserved_gib": 9.0,
            "unsloth_peak_reserved_gib": 9.5}
    assert judge(good) == {"vs_unsloth": True, "memory_vs_unsloth": True, "vs_baseline": True, "all": True}
    assert judge({**good, "studio_peak_reserved_gib": 9.6})["all"] is False
    assert judge({**good, "studio_vs_baseline": 2.9})["all"] is False
    unmeasured = judge({**good, "studio_vs_unsloth": None, "unsloth_peak_reserved_gib": None})
    assert unmeasured == {"vs_unsloth": None, "memory_vs_unsloth": None, "vs_baseline": True, "all": None}


@pytest.mark.slow
def test_studio_and_the_hf_loop_train_both_rows_alike_on_a_tiny_mixture(tmp_path: Path, studio_env: dict,
                                                                          python: str) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([python, str(REPO / "bench" / "moe.py"), "--tiny", "--model", "olmoe-1b-7b", "--steps", "5",
                           "--warmup", "2", "--models-dir", str(tmp_path / "models"), "--out", str(out)],
                          cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["command"].startswith("python3 bench/moe.py --tiny") and result["versions"]["torch"]
    summary = result["summary"]["olmoe-1b-7b"]
    assert summary["layers"] == "2 of 2"
    for row in ("attn", "experts"):
        entry = summary[row]
        assert entry["studio_path"] == "fast" and entry["losses_within_1pct"], entry
        assert entry["studio_tokens_per_s"] and entry["baseline_tokens_per_s"] and entry["unsloth_tokens_per_s"] is None
        assert entry["meets_bar"]["vs_unsloth"] is None and entry["meets_bar"]["all"] is None
    model = result["models"]["olmoe-1b-7b"]
    assert model["unsloth"]["attn"] == {"skipped": "--tiny: Unsloth needs a GPU"}
    assert model["baseline"]["experts"]["init"] == "Studio's"  # the HF loop started from Studio's adapters
    attn, experts = model["studio"]["attn"]["losses"], model["studio"]["experts"]["losses"]
    assert attn[0] == pytest.approx(experts[0]) and attn[1:] != experts[1:]  # the expert adapters trained


@pytest.mark.slow
def test_a_family_the_fast_path_does_not_run_is_measured_on_the_path_it_takes(tmp_path: Path, studio_env: dict,
                                                                             python: str) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run([python, str(REPO / "bench" / "moe.py"), "--tiny", "--model", "gpt-oss-20b", "--variants",
                           "attn", "--steps", "4", "--warmup", "2", "--models-dir", str(tmp_path / "models"),
                           "--out", str(out)], cwd=tmp_path, env=studio_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads(out.read_text())["summary"]["gpt-oss-20b"]["attn"]
    assert entry["studio_path"] in ("fast", "plain") and entry["studio_path_reason"]
    if entry["studio_path"] == "plain":  # until the fast path describes gpt-oss
        assert "gpt_oss" in entry["studio_path_reason"]
    assert entry["losses_within_1pct"]


def test_a_subsets_fit_is_told_apart_from_the_whole_models(tmp_path: Path) -> None:
    """The card's use of 12 of Qwen3-30B-A3B's 48 layers is not the whole model's fit: the report says so
    and extrapolates the whole model's with the estimate's error on the subset."""
    import yaml

    folder = tmp_path / "qwen3-30b-a3b-l12"
    folder.mkdir()
    shape = MOE_MODELS["qwen3-30b-a3b"]
    (folder / "config.json").write_text(json.dumps(mrm.hf_config(layer_subset(shape, 12)).to_dict()))
    sized = mrm.sizes(shape)
    (folder / mrm.BUILD_FILE).write_text(json.dumps({
        "arch": "qwen3-30b-a3b", "layers_built": 12, "layers_real": 48, "full_model": False,
        "full_model_bytes_bf16": sized["total_bytes"], "free_bytes_before": 50 * 10**9}))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(case_config(folder, tmp_path / "d.jsonl", tmp_path / "runs", 3, 2048)))
    card = 24 * 2**30
    fit = fit_report("qwen3-30b-a3b", folder, config, card, {"load": 5 * 10**9, "steps": 8 * 10**9})
    assert fit["layers"] == "12 of 48" and fit["full_model"] is False
    assert fit["estimate_full_bytes"] > 2 * fit["estimate_built_bytes"]
    assert fit["extrapolated_full_bytes"] == round(fit["estimate_full_bytes"] * 8e9 / fit["estimate_built_bytes"])
    assert fit["extrapolated_full_fits"] == (fit["extrapolated_full_bytes"] <= card)
    assert fit["full_model_checkable_on_this_disk"] is False
    assert "a 12-layer model's, not the whole model's" in fit["meaning"]
    assert "cannot be checked on this disk" in fit["meaning"]


@pytest.mark.slow
def test_a_card_case_runs_every_phase_through_the_cli(tmp_path: Path, studio_env: dict, python: str) -> None:
    out = tmp_path / "card_moe.json"
    done = subprocess.run([python, str(REPO / "bench" / "card_moe.py"), "--cpu", "--only", "qwen3-moe", "--steps", "2",
                           "--out", str(out)], cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    case = json.loads(out.read_text())["cases"]["qwen3-moe"]
    assert case["every_phase_finished"], case
    assert case["steps"] == 2 and case["evaluations"] >= 2 and case["answer"]["rows"] == 1
    assert case["answer_by_the_training_worker"] and case["card_bytes"] == 24 * 2**30
    assert case["config"]["trainer"]["micro_batch_size"] == 1 and case["config"]["data"]["max_seq_length"] == 64
    assert case["fit"]["full_model"] and case["fit"]["layers"] == "2 of 2"
