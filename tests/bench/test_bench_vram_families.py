"""bench/vram_measure.py's family grid (issue 39): three rows a family with a third out of sample,
predictions committed for exactly its rows, committed predictions scored against a measured file
by label, and a row of it through Studio's Trainer on the CPU."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from helpers import REPO

from bench.family_shapes import FAMILY_MODELS
from bench.vram_measure import FAMILY_ROWS, ROWS, score_committed


def test_every_family_has_three_rows_one_out_of_sample_and_the_default_grid_is_unchanged() -> None:
    per_family = Counter(row.model for row in FAMILY_ROWS)
    assert set(per_family) == set(FAMILY_MODELS) and min(per_family.values()) >= 3
    for family in FAMILY_MODELS:
        marks = [row.out_of_sample for row in FAMILY_ROWS if row.model == family]
        assert 3 * sum(marks) >= len(marks) and not all(marks), family
    labels = [row.label for row in FAMILY_ROWS]
    assert len(set(labels)) == len(labels)
    assert not {row.model for row in ROWS} & set(FAMILY_MODELS)
    # The pinned measurement is keyed by the default grid's labels; its out-of-sample third is every third row.
    assert len(ROWS) == 24 and [row.out_of_sample for row in ROWS] == [i % 3 == 2 for i in range(24)]


def test_the_committed_predictions_are_the_family_grids_rows() -> None:
    """A change to the family grid needs its predictions committed again before the GPU run."""
    rows = [(row.label, row.out_of_sample) for row in FAMILY_ROWS]
    files = [json.loads(p.read_text()) for p in (REPO / "bench" / "predictions").glob("vram_families_*.json")]
    matching = [f for f in files if [(r["label"], r["out_of_sample"]) for r in f["rows"]] == rows]
    assert matching, "bench/vram_measure.py --grid families --dry-run --json bench/predictions/vram_families_<commit>.json"
    for committed in matching:
        assert {r["predicted"]["path"] for r in committed["rows"]} == {"fast"}
        assert set(committed["models"]) == set(FAMILY_MODELS)


def test_committed_predictions_are_scored_against_the_measured_rows_by_label() -> None:
    predictions = {"rows": [
        {"label": "a", "out_of_sample": False, "predicted": {"path": "fast", "peak_reserved": 102}},
        {"label": "b", "out_of_sample": True, "predicted": {"path": "fast", "peak_reserved": 90}},
        {"label": "c", "out_of_sample": False, "predicted": {"path": "fast", "peak_reserved": 50}},
    ]}
    measured = {"rows": [
        {"label": "b", "measured": {"path": "plain", "peak_reserved": 100}},
        {"label": "a", "measured": {"path": "fast", "peak_reserved": 100}},
        {"label": "c", "measured": {"error": "OutOfMemoryError"}},
    ]}
    scored = score_committed(predictions, measured)
    assert [(r["label"], round(r["reserved_error"], 3), r["path_agrees"]) for r in scored["rows"]] == \
        [("a", 0.02, True), ("b", -0.1, False)]
    summary = scored["summary"]
    assert summary["rows"] == 2 and summary["of"] == 3 and summary["paths_agree"] == 1
    assert summary["out_of_sample"] == {"median_abs_error": 0.1, "worst_abs_error": 0.1, "meets_bar": False}


@pytest.mark.slow
def test_a_family_row_runs_through_the_trainer_on_the_cpu(tmp_path: Path, studio_env: dict, python: str) -> None:
    out = tmp_path / "families.json"
    done = subprocess.run([python, str(REPO / "bench" / "vram_measure.py"), "--grid", "families", "--cpu",
                           "--only", "qwen2 ", "--parallel", "1", "--out", str(out)],
                          cwd=tmp_path, env=studio_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["grid"] == "families" and result["cpu_only"]
    (row,) = result["rows"]
    assert row["model"] == "qwen2" and result["models"]["qwen2"]["model_type"] == "qwen2"
    measured = row["measured"]
    assert measured["path"] == "fast" and measured["steps"] == 5 and measured["generate_new_tokens"] == 64
