"""bench/grpo_speed.py on the CPU, as far as it goes there: Studio's side of the GRPO speed comparison
runs on the tiny model and the JSON carries the command, the commit, the versions and the settings
(TRL's side needs Triton and Unsloth's a GPU: the GPU box runs those)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO


@pytest.mark.slow
def test_grpo_speed_tiny_runs_studios_side(tmp_path: Path, studio_env: dict, python: str, tiny_model: Path) -> None:
    out = tmp_path / "grpo.json"
    done = subprocess.run([python, str(REPO / "bench" / "grpo_speed.py"), "--tiny", "--out", str(out), "--steps", "2",
                           "--warmup", "1", "--prompt", "24", "--completion", "16", "--sides", "studio,trl,unsloth"],
                          cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith("--sides studio,trl,unsloth")
    assert len(report["commit"]) == 40 or report["commit"] == "unknown"
    assert {"torch", "transformers", "peft", "trl"} <= set(report["versions"])
    assert report["settings"]["generations"] == 8 and report["settings"]["max_completion_tokens"] == 16
    studio = report["studio"]
    assert studio["steps_per_s"] > 0 and len(studio["mean_completion_length"]) == 3
    assert all(0 < n <= 16 for n in studio["mean_completion_length"])
    assert "skipped" in report["unsloth"] and ("skipped" in report["trl"] or "steps_per_s" in report["trl"])
