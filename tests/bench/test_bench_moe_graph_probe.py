"""bench/moe_graph_probe.py on the CPU, as far as it goes there (no CUDA graphs: the plumbing): each
case in its own process, its steps logged as they finish, the monkeypatched cases really changed,
a process that dies mid-case recorded with the steps it finished, and the losses compared with the
eager case's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from helpers import REPO


def test_the_tiny_probe_runs_its_cases_apart_and_records_one_that_dies(tmp_path: Path, studio_env: dict,
                                                                        python: str) -> None:
    out = tmp_path / "probe.json"
    cases = "graphs,eager,pre_quick_wins,no_kept_routing,recompute_reads"
    done = subprocess.run([python, str(REPO / "bench" / "moe_graph_probe.py"), "--tiny", "--tokens", "32",
                           "--small-tokens", "16", "--steps", "2", "--jobs", "2", "--cases", cases,
                           "--abort-at-step", "1", "--abort-case", "recompute_reads", "--commit", "abc123",
                           "--out", str(out)], cwd=tmp_path, env=studio_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["commit"] == "abc123" and report["versions"]["torch"] and set(report["cases"]) == set(cases.split(","))
    got = report["cases"]
    eager = got["eager"]
    assert eager["outcome"] == "ok" and [(s["tokens"], s["step"]) for s in eager["steps"]] == [
        (32, 1), (32, 2), (16, 1), (16, 2)]
    assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in eager["steps"])
    # one sort a step where the recomputation takes the forward's routing, two where it does not
    assert eager["sorts"] == 4 and got["graphs"]["sorts"] == 2
    assert got["no_kept_routing"]["sorts"] == got["pre_quick_wins"]["sorts"] == 4
    assert got["pre_quick_wins"]["patch"] == ["no_kept_routing", "recompute_reads", "no_moe_kernels"]
    for case in ("graphs", "pre_quick_wins", "no_kept_routing"):
        result = got[case]
        assert result["outcome"] == "ok" and result["steps_done"] == 2 and result["phase"] == "finished", result
        assert not result["captured"] and result["device"] == "cpu"  # no graphs on the CPU
        assert [r["step"] for r in result["against_eager"]] == [1, 2]
        for row in result["against_eager"]:  # fp32 on the CPU: the same step as the eager one
            assert row["loss_diff"] < 1e-5 and row["grad_norm_rel_diff"] < 1e-4 and row["expert_tokens_equal"]
    died = got["recompute_reads"]
    assert died["steps_done"] == 1 and "SIGABRT" in died["outcome"] and "step 1: done" in died["outcome"]
    assert died["stderr_tail"] is not None and died["against_eager"][0]["loss_diff"] < 1e-5
