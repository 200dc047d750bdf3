"""A command that meets a worker in its last seconds (no longer listening, its pid file still there
while it says goodbye to its clients) waits for it to exit and then says what the run's status is,
instead of a bare "no worker is running" (seen when `studio stop` came right after a stop)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from studio.cli import runs as run_commands
from studio.core.runs import RunDir


def _run_with_exiting_worker(tmp_path: Path, lives_s: float) -> tuple[RunDir, subprocess.Popen]:
    """A run folder whose pid file names a live process that listens on nothing (a worker closing)."""
    folder = tmp_path / "20261127-000000-closing"
    folder.mkdir()
    run = RunDir(folder)
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({lives_s})"])
    run.pid_path.write_text(f"{proc.pid}\n")
    return run, proc


def _reap_then_clear(run: RunDir, proc: subprocess.Popen) -> None:
    proc.wait()
    run.pid_path.unlink(missing_ok=True)  # as the worker's own close does


def test_a_worker_that_exits_while_refusing_gives_the_runs_status(tmp_path: Path) -> None:
    run, proc = _run_with_exiting_worker(tmp_path, 0.5)
    threading.Thread(target=_reap_then_clear, args=(run, proc), daemon=True).start()
    with pytest.raises(run_commands.RunCommandFailed) as failed:
        run_commands.stop_run(run)
    assert str(failed.value) == f"run {run.id} has no worker running (status: created, step 0)"


def test_a_worker_that_stays_up_without_listening_is_named_as_unreachable(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_commands, "WORKER_CLOSE_S", 0.3)
    run, proc = _run_with_exiting_worker(tmp_path, 30)
    try:
        with pytest.raises(run_commands.RunCommandFailed) as failed:
            run_commands.stop_run(run)
        assert str(failed.value) == f"run {run.id}: no worker is running"
    finally:
        proc.kill()
        proc.wait()
