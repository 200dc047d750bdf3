"""The worker process itself, driven as a user would: started detached, spoken to over its socket.

These use the torch-free FakeTrainer (tests/helpers/worker_fakes.py) so that they test the worker's own
machinery in seconds; tests/e2e/test_worker_cli.py runs the real Trainer end to end.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest
from helpers.worker import make_run, wait_for
from helpers.worker_fakes import fake_loss

from studio.core import events as ev
from studio.worker.client import WorkerClient, WorkerRefused, WorkerStartError, start_worker
from studio.worker.launch import GpuLock


def test_socket_and_key_are_private_and_a_wrong_key_is_refused(tmp_path: Path, fake_worker_env: list) -> None:
    run = make_run(tmp_path / "runs")
    fake_worker_env.append(run)
    pid = start_worker(run)
    assert pid == run.worker_pid()
    assert stat.S_IMODE(os.stat(run.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(run.key_path).st_mode) == 0o600

    with pytest.raises(AuthenticationError):
        Client(run.socket_address(), family="AF_UNIX", authkey=b"not-the-key")
    real_key = run.key_path.read_bytes()
    run.key_path.write_bytes(b"guessed")
    with pytest.raises(WorkerRefused, match="refused the key"):
        WorkerClient(run).connect(timeout=2)

    # Refused clients do not take the worker down: the real key still works.
    run.key_path.write_bytes(real_key)
    assert WorkerClient(run).connect(timeout=2).state == "idle"
    assert run.worker_pid() == pid


def test_second_worker_on_a_busy_gpu_is_refused_naming_the_holder(tmp_path: Path, fake_worker_env: list) -> None:
    first, second = make_run(tmp_path / "runs", name="first"), make_run(tmp_path / "runs", name="second")
    fake_worker_env.extend([first, second])
    pid = start_worker(first)
    with pytest.raises(WorkerStartError, match=f"{re.escape(GpuLock().label)} is busy: run {first.id}"):
        start_worker(second)
    assert second.worker_pid() is None

    # The lock dies with its holder, even by SIGKILL: the GPU is free again at once.
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while GpuLock().busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_worker(second) == second.worker_pid()


def test_generate_pause_resume_and_stop_while_training(tmp_path: Path, fake_worker_env: list) -> None:
    run = make_run(tmp_path / "runs", steps=400)
    fake_worker_env.append(run)
    start_worker(run, train=True)
    client = WorkerClient(run)
    seen: list[ev.Event] = []
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 3, seen=seen)

    # Generation is answered between optimizer steps, by the adapter being trained.
    client.send(ev.Generate(request_id="during", prompt="olleh", adapter=True))
    answer = wait_for(client, lambda e: isinstance(e, ev.GenerationFinished), seen=seen)
    assert answer.request_id == "during" and answer.text.startswith("adapter@") and answer.text.endswith("hello")
    pieces = [e.text for e in seen if isinstance(e, ev.TokenGenerated) and e.request_id == "during"]
    assert "".join(pieces) == answer.text

    client.send(ev.Pause())
    paused = wait_for(client, lambda e: isinstance(e, ev.TrainingPaused), seen=seen)
    assert client.request_status().state == "paused"
    # Paused: no steps, but generation (base model too) still works.
    client.send(ev.Generate(request_id="paused", prompt="x", adapter=False))
    answer = wait_for(client, lambda e: isinstance(e, ev.GenerationFinished), seen=seen)
    assert answer.text == f"base@{paused.step}:x"
    time.sleep(0.3)
    assert not [e for e in client.poll(0.1) if isinstance(e, ev.StepLogged)]
    assert client.request_status().step == paused.step

    client.send(ev.Resume())
    after = wait_for(client, lambda e: isinstance(e, ev.StepLogged), seen=seen)
    assert after.step == paused.step + 1
    assert after.loss == fake_loss(paused.step + 1)

    client.send(ev.Stop())
    finished = wait_for(client, lambda e: isinstance(e, ev.TrainingFinished), seen=seen)
    assert finished.stopped and finished.step < 400
    assert run.latest_checkpoint() == run.checkpoints_dir / f"step-{finished.step}"
    assert (run.adapter_dir / "adapter_config.json").exists()
    steps = [e.step for e in run.events() if isinstance(e, ev.StepLogged)]
    assert steps == list(range(1, finished.step + 1))
    # Stopped, the worker stays up for chat while a client is connected.
    assert client.request_status().state == "stopped"
    client.close()


def test_sigkill_mid_run_then_resume_continues_the_same_log(tmp_path: Path, fake_worker_env: list,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path / "runs", steps=30)
    fake_worker_env.append(run)
    pid = start_worker(run, train=True)
    follower = WorkerClient(run)  # follows across the restart
    seen: list[ev.Event] = []
    wait_for(follower, lambda e: isinstance(e, ev.StepLogged) and e.step >= 7, seen=seen)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while GpuLock().busy() and time.monotonic() < deadline:  # free once the process is gone
        time.sleep(0.05)
    killed_at = max(e.step for e in run.events() if isinstance(e, ev.StepLogged))
    assert killed_at < 30

    start_worker(run, resume=True)
    wait_for(follower, lambda e: isinstance(e, ev.TrainingFinished), seen=seen)
    restarted = [e for e in seen if isinstance(e, ev.RunStarted)][-1]
    checkpoint = 5 * (killed_at // 5)
    assert restarted.resumed_from_step == checkpoint

    logged = run.events()
    assert [e.seq for e in logged] == list(range(len(logged)))
    assert [e.seq for e in seen] == [e.seq for e in logged]  # the follower missed nothing, twice nothing
    after = [(e.step, e.loss) for e in logged if isinstance(e, ev.StepLogged) and e.seq > restarted.seq]
    assert after == [(s, fake_loss(s)) for s in range(checkpoint + 1, 31)]
    follower.close()


def test_a_crash_is_reported_and_the_worker_stays_up_for_generation(tmp_path: Path, fake_worker_env: list,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_FAIL_AT_STEP", "4")
    run = make_run(tmp_path / "runs")
    fake_worker_env.append(run)
    start_worker(run, train=True)
    client = WorkerClient(run)
    failed = wait_for(client, lambda e: isinstance(e, ev.WorkerFailed), seen=[])
    assert failed.kind == "crash" and failed.fatal
    assert "fake failure at step 4" in failed.message and str(run.log_path) in failed.message
    assert client.request_status().state == "failed"
    client.send(ev.Generate(request_id="after", prompt="ab"))
    assert wait_for(client, lambda e: isinstance(e, ev.GenerationFinished)).text == "adapter@3:ba"
    client.close()


def test_sigterm_checkpoints_and_exits(tmp_path: Path, fake_worker_env: list) -> None:
    run = make_run(tmp_path / "runs", steps=400)
    fake_worker_env.append(run)
    pid = start_worker(run, train=True)
    client = WorkerClient(run)
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 3, seen=[])
    os.kill(pid, signal.SIGTERM)  # what a shutting-down machine sends
    finished = wait_for(client, lambda e: isinstance(e, ev.TrainingFinished))
    assert finished.stopped and (run.checkpoints_dir / f"step-{finished.step}").is_dir()
    assert "SIGTERM" in wait_for(client, lambda e: isinstance(e, ev.WorkerStopped)).reason
    client.close()
    deadline = time.monotonic() + 10
    while GpuLock().busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.worker_pid() is None and not run.socket_path.exists()
