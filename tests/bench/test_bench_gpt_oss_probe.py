"""bench/gpt_oss_probe.py on the CPU, as far as it goes there: a tiny gpt-oss with MXFP4 experts, the
fast path's loss and LoRA gradients against transformers + PEFT's (fp32: equal to rounding), the
JSON a GPU call commits. The real shapes, the timing and the memory need the GPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO


@pytest.mark.parametrize("experts", [True, False])
def test_the_tiny_probe_agrees_with_transformers(tmp_path: Path, experts: bool, studio_env: dict,
                                                 python: str) -> None:
    out = tmp_path / "probe.json"
    command = [python, str(REPO / "bench" / "gpt_oss_probe.py"), "--tiny", "--out", str(out)]
    done = subprocess.run(command + ([] if experts else ["--no-experts"]), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=studio_env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["command"] and report["versions"]["transformers"] and report["experts_adapted"] == experts
    assert report["loss"]["relative_difference"] < 1e-5
    grads = report["gradients"]
    assert grads["adapters"] == 2 * 2 * (4 + (2 if experts else 0))  # A and B, 2 layers
    assert grads["worst_relative_error"] < 1e-4 and abs(grads["norm_ratio"] - 1) < 1e-5
