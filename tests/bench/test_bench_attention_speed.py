"""bench/attention_speed.py on the CPU, as far as it goes there (``--tiny``: small shapes under Triton's
interpreter): both attentions run for every shape and layout, the fused one no further from the
eager one than bf16's rounding, and the JSON carries what a GPU result must (command, commit,
versions, the tiles)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

pytest.importorskip("triton")


def test_the_attention_bench_times_both_attentions_on_the_same_inputs(tmp_path: Path, studio_env: dict,
                                                                     python: str) -> None:
    out = tmp_path / "attention.json"
    done = subprocess.run([python, str(REPO / "bench" / "attention_speed.py"), "--tiny", "--out", str(out),
                           "--commit", "abc123"], cwd=tmp_path, env=studio_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["commit"] == "abc123" and report["command"].endswith("--commit abc123")
    assert report["versions"]["triton"] and set(report["tiles"]) == {"forward", "dq", "dkdv"}
    rows = {(r["shape"], r["layout"]): r for r in report["rows"]}
    assert set(rows) == {(s, lay) for s in ("gemma-2-9b", "gpt-oss-20b_window") for lay in ("row", "packed")}
    for row in rows.values():
        assert row["eager"]["ms"] > 0 and row["fused"]["ms"] > 0
        assert all(err < 0.03 for err in row["fused_vs_eager_rel"].values()), row
    assert rows["gemma-2-9b", "row"]["softcap"] and rows["gpt-oss-20b_window", "packed"]["sinks"]
