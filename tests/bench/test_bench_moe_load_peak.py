"""bench/moe_load_peak.py on the CPU (``--tiny --cpu``): it builds the random Qwen3-MoE (or gpt-oss), loads it in
a fresh process once packing on load and once packing after it, and reports what a GPU run reports
less the allocator's numbers: the same packed model both ways, one projection's expert weights
unpacked at most during the load against every layer's after it, with command, commit and versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.moe_load_peak import main

pytest.importorskip("bitsandbytes")


def test_the_cpu_run_reports_one_layer_at_most_during_the_load_and_every_layer_after_it(tmp_path: Path) -> None:
    out = tmp_path / "moe_load_peak.json"
    assert main(["--tiny", "--cpu", "--layers", "3", "--model-dir", str(tmp_path / "model"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/moe_load_peak.py --tiny --cpu")
    assert report["commit"] and report["gpu"]["name"] == "cpu"
    assert {"torch", "transformers", "bitsandbytes"} <= set(report["versions"])
    assert report["model"]["layers"] == 3 and report["load_dtype"] == "float32"
    one_layer, every_layer = report["one_layer_experts_bytes"], report["model_experts_bytes"]
    assert every_layer == 3 * one_layer

    during, after = report["runs"]["during"], report["runs"]["after"]
    assert during["quantization"] == after["quantization"] == "nf4"
    assert during["warnings"] == [] and "after the load" in after["warnings"][0]
    assert during["packed_experts_bytes"] == after["packed_experts_bytes"] > 0
    assert during["weights_bytes"] == after["weights_bytes"]
    assert during["probe_samples"] == after["probe_samples"] == 6
    assert 0 < during["probe_peak_expert_bytes"] <= one_layer
    assert after["probe_peak_expert_bytes"] >= every_layer
    assert during["host_peak_rss_bytes"] >= during["host_peak_rss_before_load_bytes"] > 0
    assert report["full_model_estimate"] is None  # only the real shapes are carried to 48 layers


def test_the_gpt_oss_cpu_run_reports_no_expert_weight_dequantized_during_the_load(tmp_path: Path) -> None:
    """``--shape gpt-oss-20b --tiny``: a checkpoint shipping MXFP4 experts, sharded a layer a file; the
    load keeps them as they arrive (no expert weight in floating point at any keeping) where the old
    loader held every layer's initialized in fp32, and both end with the same model."""
    out = tmp_path / "gpt_oss_load_peak.json"
    assert main(["--shape", "gpt-oss-20b", "--tiny", "--cpu", "--layers", "3", "--model-dir", str(tmp_path / "model"),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["shape"] == "gpt-oss-20b" and report["model"]["tiny"]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert len(list((tmp_path / "model").glob("model-layer-*.safetensors"))) == 3
    during, after = report["runs"]["during"], report["runs"]["after"]
    assert during["quantization"] == after["quantization"] == "nf4"
    assert during["warnings"] == [] and "after the load" in after["warnings"][0]
    assert during["packed_experts_bytes"] == after["packed_experts_bytes"] > 0
    assert during["weights_bytes"] == after["weights_bytes"]
    assert during["probe_samples"] == after["probe_samples"] == 6
    assert during["probe_peak_expert_bytes"] == 0
    assert after["probe_peak_expert_bytes"] >= report["model_experts_bytes"]
    assert report["full_model_estimate"] is None
