"""bench/profile_gpu_bound.py's trace arithmetic, on a hand-made trace: what issue 13's notes
conclude from a profile (where the GPU waits, and on what) must be computed right."""

from __future__ import annotations

import json
from pathlib import Path

from bench.profile_gpu_bound import idle_by_phase, schedule


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_idle_time_between_kernels_goes_to_the_host_phase_running_meanwhile(tmp_path: Path) -> None:
    events = [
        # GPU (microseconds): busy 0-1000 on two overlapping streams, idle 1000-3000, busy 3000-4000,
        # idle 4000-4500, a copy 4500-5000
        _x("kernel", "gemm", 0, 800), _x("kernel", "rope", 500, 500),
        _x("kernel", "gemm", 3000, 1000), _x("gpu_memcpy", "Memcpy HtoD", 4500, 500),
        # host: the figures are read 900-1500, a memory sample 1500-2500; nothing labelled after
        _x("user_annotation", "studio.read_figures", 900, 600),
        _x("user_annotation", "studio.memory_sample", 1500, 1000),
        _x("user_annotation", "other.label", 1000, 3000),  # not one of the Trainer's: ignored
        _x("cpu_op", "aten::mm", 1000, 10),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = idle_by_phase(trace, steps=1)
    assert got["idle_ms_per_step"] == 2.5  # 1000-3000 and 4000-4500
    assert got["idle_by_phase_ms_per_step"] == {"studio.memory_sample": 1.0, "unlabelled": 1.0,
                                                "studio.read_figures": 0.5}
    assert got["largest_gaps_ms"] == [(2.0, "studio.memory_sample"), (0.5, "unlabelled")]
    halved = idle_by_phase(trace, steps=2)
    assert halved["idle_ms_per_step"] == 1.25


def test_repeated_levers_run_interleaved_after_one_warm_up_run_that_is_not_kept() -> None:
    assert schedule(["all", "a", "b"], 2) == [(-1, "all"), (0, "all"), (0, "a"), (0, "b"),
                                              (1, "all"), (1, "a"), (1, "b")]
    assert schedule(["all", "a"], 1) == [(0, "all"), (0, "a")]  # one run each: nothing to warm up for
