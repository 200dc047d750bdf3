"""`studio train --detach`, `attach`, `runs`, `pause`, `resume`, `stop`, as a user types them.

The first tests use the torch-free FakeTrainer (fast); the last ones run the real Trainer on the tiny
model through the real worker: the done-when tests of issue 3.
"""

from __future__ import annotations

import json
import math
import os
import pty
import re
import select
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import REPO, TESTS
from helpers.cli import studio_command
from helpers.worker import wait_for

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.runs import find_run, list_runs
from studio.worker.client import WorkerClient
from studio.worker.launch import GpuLock


def test_train_detach_survives_its_terminal_hanging_up(fake_cli: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    # A shell on a real terminal (a pty) runs `studio train --detach`, then lingers like a user would.
    command = shlex.join(studio_command("train", fake_cli, "--detach", "--max-steps", "60")) + "; sleep 60"
    started = time.monotonic()
    shell, terminal = pty.fork()
    if shell == 0:
        os.chdir(tmp_path)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]])
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
    assert re.findall(r":\d\d  step +(\d+)/60", printed) == [str(s) for s in range(1, 61)]
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
    assert err.count("\n") == 1 and f"{GpuLock().label} is busy: run {holder}" in err
    assert len(list_runs("runs")) == 1  # the refused start left no empty run behind
    assert studio(["attach", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run matching 'no-such-run'" in err
    assert studio(["stop", holder]) == 0


# ------------------------------------------------------------------ the real Trainer, tiny model


@pytest.fixture
def real_cli(tiny_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The tiny config as a YAML file, for the real Trainer in real detached workers (a private GPU
    lock, a small dataset so that loading is quick); leftover workers are killed at the end."""
    from studio.engine.tiny import reverse_word_rows

    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "5")
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "reverse.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in reverse_word_rows(400, seed=0)))
    tiny_config.data.path = str(rows)
    tiny_config.trainer.eval_max_rows = 16
    path = tmp_path / "tiny.yaml"
    tiny_config.save(path)
    yield path
    for run in list_runs(tmp_path / "runs"):
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)


ROW = {"instruction": "Reverse the letters of the word.", "input": "s-t-o-n-e"}


@pytest.mark.slow
def test_real_worker_outlives_its_terminal_answers_while_training_and_resumes_exactly(
        real_cli: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # 1. `studio train --detach` from a terminal that then hangs up (an SSH drop).
    shell, terminal = pty.fork()
    if shell == 0:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        os.execv("/bin/sh", ["/bin/sh", "-c", shlex.join(studio_command("train", real_cli, "--detach")) + "; sleep 60"])
    output = b""
    while b"studio attach" not in output and select.select([terminal], [], [], 30)[0]:
        output += os.read(terminal, 4096)
    os.close(terminal)
    os.killpg(shell, signal.SIGKILL)
    os.waitpid(shell, 0)
    run = find_run(re.search(rb"^(\d{8}-\d{6}-\S+)\r?$", output, re.M).group(1).decode(), tmp_path / "runs")

    # 2. Generation is answered while it trains.
    client = WorkerClient(run)
    seen: list[ev.Event] = []
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 3, timeout=180, seen=seen)
    client.send(ev.Generate(request_id="during", row=ROW))
    during = wait_for(client, lambda e: isinstance(e, ev.GenerationFinished), timeout=60, seen=seen)
    step_after = wait_for(client, lambda e: isinstance(e, ev.StepLogged), timeout=60, seen=seen)
    assert during.new_tokens > 0 and step_after.seq > during.seq  # training went on after it

    # 3. SIGKILL after the step-10 checkpoint; `studio train --resume RUN --detach` continues it.
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 12, timeout=120, seen=seen)
    os.kill(run.worker_pid(), signal.SIGKILL)
    assert studio(["train", "--resume", run.id, "--detach", "--runs-dir", str(tmp_path / "runs")]) == 0
    assert "from step-10" in capsys.readouterr().out
    restarted = wait_for(client, lambda e: isinstance(e, ev.RunStarted) and e.resumed_from_step > 0,
                         timeout=180, seen=seen)
    assert restarted.resumed_from_step == 10
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.seq > restarted.seq and e.step >= 14,
             timeout=120, seen=seen)

    # 4. Stop: checkpoint + adapter; the worker stays up for chat, where base and adapter now differ.
    client.send(ev.Stop())
    stopped = wait_for(client, lambda e: isinstance(e, ev.TrainingFinished), timeout=120, seen=seen)
    assert stopped.stopped and (run.checkpoints_dir / f"step-{stopped.step}").is_dir()
    for request, adapter in (("base", False), ("tuned", True)):
        client.send(ev.Generate(request_id=request, row=ROW, adapter=adapter))
    answers: dict[str, str] = {}
    while len(answers) < 2:
        answer = wait_for(client, lambda e: isinstance(e, ev.GenerationFinished), timeout=60, seen=seen)
        answers[answer.request_id] = answer.text
    assert answers["base"] != answers["tuned"]
    client.close()
    logged = run.events()
    assert [e.seq for e in seen] == [e.seq for e in logged[: len(seen)]]  # one follower, both workers
    assert [e.seq for e in logged] == list(range(len(logged)))
    assert studio(["attach", run.id]) == 0  # finished: prints the history and returns
    printed = capsys.readouterr().out
    killed_at = max(e.step for e in logged if isinstance(e, ev.StepLogged) and e.seq < restarted.seq)
    expected_steps = list(range(1, killed_at + 1)) + list(range(11, stopped.step + 1))
    assert [int(s) for s in re.findall(r":\d\d  step +(\d+)/20", printed)] == expected_steps
    assert studio(["stop", run.id]) == 0

    # 5. The loss after the resume point equals an uninterrupted run's (same config, in-process).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from studio.core.runs import create_run
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    reference: dict[int, float] = {}

    def record(event: ev.Event) -> None:
        if isinstance(event, ev.StepLogged):
            reference[event.step] = event.loss

    config = run.config()
    Trainer(Session(config, create_run(config, tmp_path / "reference"), record),
            between_steps=lambda t: "stop" if t.step >= stopped.step else None).train()
    resumed = {e.step: e.loss for e in logged if isinstance(e, ev.StepLogged) and e.seq > restarted.seq}
    assert sorted(resumed) == list(range(11, stopped.step + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step

    # 6. The stopped run's adapter loads with peft and is trained (non-zero B matrices).
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config.model.base_model),
                                      str(run.adapter_dir))
    assert any("lora_B" in name and bool(p.abs().sum() > 0) for name, p in tuned.named_parameters())


@pytest.mark.slow
def test_real_worker_halves_the_micro_batch_on_oom_and_pauses_without_losing_steps(
        real_cli: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("STUDIO_INJECT_OOM_AT_STEP", "2")
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.oom_injection:OomInjectingSession")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    assert studio(["train", str(real_cli), "--detach", "--max-steps", "8"]) == 0
    run = find_run(capsys.readouterr().out.strip(), tmp_path / "runs")
    client = WorkerClient(run)
    seen: list[ev.Event] = []
    reduced = wait_for(client, lambda e: isinstance(e, ev.BatchSizeReduced), timeout=120, seen=seen)
    assert (reduced.old_micro_batch_size, reduced.micro_batch_size, reduced.gradient_accumulation_steps) == (8, 4, 2)
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 3, timeout=60, seen=seen)
    client.send(ev.Pause())
    paused = wait_for(client, lambda e: isinstance(e, ev.TrainingPaused), timeout=60, seen=seen)
    time.sleep(1.0)
    assert client.request_status().step == paused.step  # no step while paused
    client.send(ev.Resume())
    finished = wait_for(client, lambda e: isinstance(e, ev.TrainingFinished), timeout=120, seen=seen)
    assert not finished.stopped and finished.step == 8
    steps = [e for e in seen if isinstance(e, ev.StepLogged)]
    assert [e.step for e in steps] == list(range(1, 9))
    assert all(math.isfinite(e.loss) and e.loss < steps[0].loss + 1 for e in steps)
    assert not [e for e in seen if isinstance(e, ev.WorkerFailed) and e.fatal]
    client.close()
