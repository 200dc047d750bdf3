"""bench/isolated.py: a GPU benchmark's sections in child processes. A section whose process dies (a
CUDA fault aborts it: rc 134 on the GPU box, issue 42's MoE layer profile), hangs, or never begins
becomes an error record that says how the process ended and what it printed last, the sections
after it run in a fresh child, and a section that ends in a CUDA error hands the rest to a fresh
child too; CUDA_LAUNCH_BLOCKING reaches the sections asked for, alone, and no other. Children here
are small scripts that log sections as the benchmark's do."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import REPO

from bench.isolated import run_sections

CHILD = """
import os, sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from bench.isolated import SectionLog
log = SectionLog(Path(sys.argv[2]))
for section in sys.argv[1].split(","):
    log.start(section)
    if section == "abort":
        print("CUDA error: an illegal memory access was encountered", file=sys.stderr)
        os.abort()
    if section == "hang":
        time.sleep(60)
    result = {{"pid": os.getpid(), "blocking": os.environ.get("CUDA_LAUNCH_BLOCKING")}}
    if section == "fault":
        result["cuda_error"] = True
    log.done(section, result)
    if result.get("cuda_error"):
        break
log.leave()
"""


def _command(batch: list[str], log: Path) -> list[str]:
    return [sys.executable, "-c", CHILD.format(repo=str(REPO)), ",".join(batch), str(log)]


def test_a_section_whose_process_aborts_is_recorded_and_the_rest_run_in_fresh_processes(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    reported = []
    found = run_sections(_command, ["a", "abort", "b", "fault", "c", "d"], 60, {"c"},
                         lambda section, result: reported.append(section))
    assert reported == ["a", "abort", "b", "fault", "c", "d"] == list(found)
    assert "SIGABRT" in found["abort"]["error"] and "before it ended the section" in found["abort"]["error"]
    assert "illegal memory access" in found["abort"]["stderr_tail"]
    # a new process after the abort; another after the CUDA error; c alone, with launch blocking
    pids = {s: found[s]["pid"] for s in ("a", "b", "fault", "c", "d")}
    assert pids["a"] != pids["b"] == pids["fault"] != pids["c"] != pids["d"], pids
    assert found["c"]["blocking"] == "1" and {found[s]["blocking"] for s in ("a", "b", "fault", "d")} == {None}


def test_a_hung_section_is_killed_and_the_next_one_runs() -> None:
    found = run_sections(_command, ["hang", "b"], 2)
    assert "stalled" in found["hang"]["error"] and "killed" in found["hang"]["error"], found
    assert found["b"]["pid"]


def test_a_child_that_never_begins_costs_each_section_one_error_and_ends() -> None:
    def broken(batch: list[str], log: Path) -> list[str]:
        return [sys.executable, "-c", "import sys; print('ImportError: no module named torch', file=sys.stderr); "
                                      "raise SystemExit(1)"]

    found = run_sections(broken, ["a", "b"], 60)
    assert list(found) == ["a", "b"]
    for result in found.values():
        assert "exited with rc 1" in result["error"] and "no module named torch" in result["stderr_tail"]
