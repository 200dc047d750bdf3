"""`studio train --detach`, `attach`, `runs`, `pause`, `resume`, `stop`, as a user types them.

The first tests use the torch-free FakeTrainer (fast); the last ones run the real Trainer on the tiny
model through the real worker: the done-when tests of issue 3.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_worker import TESTS, wait_for

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.runs import find_run, list_runs
from studio.ui.client import WorkerClient

PROJECT = TESTS.parent


@pytest.fixture
def fake_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A config for the FakeTrainer, a private GPU lock, and cleanup of leftover workers."""
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "worker_fakes:FakeTrainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "2")
    monkeypatch.setenv("FAKE_STEP_S", "0.03")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    config = tmp_path / "fake.yaml"
    config.write_text("model:\n  base_model: fake-model\ndata:\n  path: rows.jsonl\n")
    yield config
    for run in list_runs(tmp_path / "runs"):
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)


def test_train_detach_survives_its_terminal_hanging_up(fake_cli: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    # A shell on a real terminal (a pty) runs `studio train --detach`, then lingers like a user would.
    command = (f"{sys.executable} -m studio.cli train {fake_cli} --detach --max-steps 60; sleep 60")
    started = time.monotonic()
    shell, terminal = pty.fork()
    if shell == 0:
        os.chdir(tmp_path)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PROJECT), os.environ["PYTHONPATH"]])
        os.execv("/bin/sh", ["/bin/sh", "-c", command])
    output = b""
    while b"studio attach" not in output and time.monotonic() - started < 30:
        if select.select([terminal], [], [], 1)[0]:
            output += os.read(terminal, 4096)
    returned_after = time.monotonic() - started
    run_id = re.search(rb"^(\d{8}-\d{6}-\S+)\r?$", output, re.M)
    assert run_id, output
    run = find_run(run_id.group(1).decode(), tmp_path / "runs")
    assert returned_after < 15  # at once: the worker trains in the background

    # The terminal goes away (SSH drop): its session gets SIGHUP; then the shell is killed outright.
    os.close(terminal)
    try:
        os.killpg(shell, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(shell, 0)
    assert run.worker_pid() is not None

    capsys.readouterr()
    assert studio(["attach", run.id, "--runs-dir", str(tmp_path / "runs")]) == 0
    printed = capsys.readouterr().out
    assert re.findall(r"step +(\d+)/60", printed) == [str(s) for s in range(1, 61)]
    assert "training finished at step 60" in printed
    logged = run.events()
    assert [e.seq for e in logged] == list(range(len(logged)))


def test_pause_resume_stop_and_runs_from_the_command_line(fake_cli: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "150"]) == 0
    run_id = capsys.readouterr().out.strip()
    run = find_run(run_id)
    client = WorkerClient(run)
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 2, seen=[])

    assert studio(["pause", run_id]) == 0
    paused_at = int(re.search(r"after step (\d+)", capsys.readouterr().out).group(1))
    assert studio(["runs"]) == 0
    listing = capsys.readouterr().out
    assert re.search(rf"{run_id} +fake-model +paused +{paused_at}/150 ", listing), listing
    assert studio(["resume", run_id]) == 0
    assert wait_for(client, lambda e: isinstance(e, ev.TrainingResumed)).step == paused_at
    assert wait_for(client, lambda e: isinstance(e, ev.StepLogged)).step == paused_at + 1

    assert studio(["stop", run_id]) == 0
    stopped_at = int(re.search(r"stopped at step (\d+)", capsys.readouterr().out).group(1))
    assert stopped_at > paused_at
    assert (run.checkpoints_dir / f"step-{stopped_at}").is_dir()
    client.close()
    deadline = time.monotonic() + 10
    while run.worker_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.worker_pid() is None  # stop frees the GPU

    assert studio(["stop", run_id]) == 1
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback

    # `studio resume` on a stopped run restarts its worker from the latest checkpoint.
    assert studio(["resume", run_id]) == 0
    assert f"from step-{stopped_at}" in capsys.readouterr().out
    assert studio(["attach", run_id]) == 0
    assert "training finished at step 150" in capsys.readouterr().out
    assert studio(["runs"]) == 0
    assert re.search(rf"{run_id} +fake-model +finished +150/150 ", capsys.readouterr().out)


def test_a_busy_gpu_and_a_missing_run_are_one_line_errors(fake_cli: Path, capsys: pytest.CaptureFixture) -> None:
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "400"]) == 0
    holder = capsys.readouterr().out.strip()
    assert studio(["train", str(fake_cli), "--detach"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"GPU 0 is busy: run {holder}" in err
    assert len(list_runs("runs")) == 1  # the refused start left no empty run behind
    assert studio(["attach", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run matching 'no-such-run'" in err
    assert studio(["stop", holder]) == 0
