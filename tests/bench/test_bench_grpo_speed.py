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
    assert "skipped" in report["unsloth"] and "skipped" in report["trl"]


def test_phase_peaks_attribute_the_run_s_peak_to_the_phase_that_set_it() -> None:
    """Studio's side folds the peaks into the phase they belong to at each phase's end and at each
    reset the Trainer makes (a new window every logged step): the run's peak is the largest over
    the whole run, not the last window's, and each phase keeps its own largest."""
    from types import SimpleNamespace

    from bench.grpo_speed import PhasePeaks

    # each window's (allocated, reserved) peaks: the first is before the run and is not read
    readings = [(0, 0), (7e9, 8e9), (9e9, 9.5e9), (6e9, 7e9), (7.5e9, 8.5e9), (8e9, 9e9)]
    window = [0]

    def reset(*args) -> None:
        window[0] += 1

    torch = SimpleNamespace(cuda=SimpleNamespace(max_memory_allocated=lambda: readings[window[0]][0],
                                                 max_memory_reserved=lambda: readings[window[0]][1],
                                                 reset_peak_memory_stats=reset))
    phases = PhasePeaks(torch, "scored")
    phases.close("sampling", then="scored")
    torch.cuda.reset_peak_memory_stats("cuda")  # the Trainer, at the next step's start
    phases.close("scored", then="sampling")
    phases.close("sampling", then="scored")
    phases.close("scored", then="scored")
    report = phases.report()
    assert report["peak_allocated_gb"] == 9.0 and report["peak_reserved_gb"] == 9.5
    assert report["phase_peaks_gb"] == {"sampling": {"allocated": 7.5, "reserved": 8.5},
                                        "scored": {"allocated": 9.0, "reserved": 9.5}}
