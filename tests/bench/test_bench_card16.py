"""bench/card16.py on the CPU, as far as it goes there: both cases run through the product
(``studio train --detach``, ``studio attach``, ``studio eval``) on the tiny model, and the answer
after training comes from the worker that trained. The holder that makes a 16 GB card needs a GPU;
how its samples are read into phases is checked on made-up samples."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

from bench.card16 import card_phases


@pytest.mark.slow
def test_both_cases_finish_every_phase_through_the_cli(tmp_path: Path, studio_env: dict, python: str,
                                                        tiny_model: Path) -> None:
    out = tmp_path / "card16.json"
    done = subprocess.run([python, str(REPO / "bench" / "card16.py"), "--cpu", "--out", str(out), "--sft-steps", "2",
                           "--grpo-steps", "1"], cwd=tmp_path, env=studio_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith("--grpo-steps 1") and report["commit"] and report["versions"]["torch"]
    sft, grpo = report["cases"]["sft"], report["cases"]["grpo"]
    for case, steps in ((sft, 2), (grpo, 1)):
        assert case["every_phase_finished"], case
        assert case["steps"] == steps and case["finished"] and case["answer_by_the_training_worker"]
        assert case["answer"]["rows"] == 1 and case["answer"]["tuned_answer_chars"] > 0
        assert case["attach_exit"] == 0 and case["eval_exit"] == 0
    assert sft["evaluations"] >= 2  # the base model's and the last step's
    assert grpo["config"]["trainer"]["method"] == "grpo" and grpo["evaluations"] >= 1
    assert grpo["path_reason"]  # the run says which path it trained on and why


def test_card_samples_are_read_into_the_phases_the_run_was_in(tmp_path: Path) -> None:
    """A sample belongs to the phase the next event closes (loading, a step, an evaluation, the save);
    the answer is the ``studio eval`` span; what was used is free at the start less the least free."""
    samples = tmp_path / "samples.txt"
    free = 16 * 10**9
    used = {1.0: 1, 2.0: 5, 2.5: 9, 3.0: 7, 4.0: 8, 6.0: 10, 9.0: 0}  # GB used at each time
    samples.write_text("".join(f"{t} {free - u * 10**9}\n" for t, u in used.items()))
    marks = [(1.5, "load"), (2.6, "steps"), (3.5, "evaluation"), (4.5, "save")]
    phases = card_phases(samples, marks, answer=(5.0, 7.0), window=(0.5, 8.0), free_at_start=free)
    assert phases == {"load": 10**9, "steps": 9 * 10**9, "evaluation": 7 * 10**9, "save": 8 * 10**9,
                      "answer": 10 * 10**9}
