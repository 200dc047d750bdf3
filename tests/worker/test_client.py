"""The client's view of a run: the whole history once, in order, however late it joins, and the
event log's numbering across worker restarts. The worker runs in-process here (a thread) with the
torch-free FakeTrainer, which keeps these tests well under a second each."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.worker_fakes import FakeTrainer

from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig
from studio.core.data.load import DataError
from studio.core.runs import RunDir, create_run
from studio.worker.client import WorkerClient
from studio.worker.eventlog import EventLog
from studio.worker.launch import listen, write_key, write_pid
from studio.worker.server import Worker


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    config = RunConfig(name="client")
    config.trainer.max_steps = 150
    return create_run(config, tmp_path / "runs")


@pytest.fixture
def serving(run: RunDir, monkeypatch: pytest.MonkeyPatch) -> Iterator[Worker]:
    """A worker serving ``run`` in a thread, training fast; shut down at the end."""
    monkeypatch.setenv("FAKE_STEP_S", "0.004")
    worker = Worker(run, trainer_factory=FakeTrainer, linger_s=60)
    listener = listen(run, write_key(run))
    write_pid(run)  # this process: the client sees a live worker
    thread = threading.Thread(target=worker.serve, args=(listener, ev.StartTraining()), daemon=True)
    thread.start()
    yield worker
    worker.commands.put((None, ev.Shutdown()))
    thread.join(10)


def collect(client: WorkerClient, until: type[ev.Event], out: list[ev.Event]) -> None:
    for event in client.events(poll_s=0.1):
        out.append(event)
        if isinstance(event, until):
            client.close()


def test_clients_joining_at_any_moment_see_every_event_exactly_once(run: RunDir, serving: Worker) -> None:
    streams: list[list[ev.Event]] = []
    threads = []
    for delay in (0.0, 0.05, 0.2, 0.4):
        time.sleep(delay)
        streams.append([])
        client = WorkerClient(run)
        thread = threading.Thread(target=collect, args=(client, ev.TrainingFinished, streams[-1]))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(30)
    logged = run.events()
    finished = next(e for e in logged if isinstance(e, ev.TrainingFinished))
    expected = [e.seq for e in logged if e.seq <= finished.seq]
    assert expected == list(range(finished.seq + 1))
    for stream in streams:
        assert [e.seq for e in stream] == expected
        assert [e.step for e in stream if isinstance(e, ev.StepLogged)] == list(range(1, 151))


def test_a_client_without_a_worker_reads_the_log_and_tails_it(run: RunDir) -> None:
    log = EventLog(run.events_path)
    for step in (1, 2):
        log.append(ev.StepLogged(step=step))
    log.close()
    client = WorkerClient(run)
    assert [e.step for e in client.catch_up()] == [1, 2]
    assert not client.connected
    with open(run.events_path, "a") as handle:
        handle.write('{"type":"StepLogged","seq":2,"step":3}\n{"type":"StepLogged","seq":3,"st')
    assert [e.step for e in client.poll(0.1)] == [3]  # the half-written line waits
    with open(run.events_path, "a") as handle:
        handle.write('ep":4}\n')
    assert [e.step for e in client.poll(0.1)] == [4]


def test_the_log_continues_numbering_after_a_killed_worker(run: RunDir) -> None:
    killed = EventLog(run.events_path)
    for step in (1, 2, 3):
        killed.append(ev.StepLogged(step=step))
    with open(run.events_path, "a") as handle:
        handle.write('{"type":"StepLogged","seq":3,"st')  # SIGKILL mid-write
    log = EventLog(run.events_path)
    log.append(ev.RunStarted(resumed_from_step=3))
    log.close()
    logged = run.events()
    assert [e.seq for e in logged] == [0, 1, 2, 3]
    assert isinstance(logged[-1], ev.RunStarted)


def test_status_and_commands_that_make_no_sense_now_get_a_reply(run: RunDir, serving: Worker) -> None:
    client = WorkerClient(run)
    greeting = client.connect(5)
    assert greeting.run_id == run.id and greeting.seq == -1
    for event in client.events(poll_s=0.1):
        if isinstance(event, ev.TrainingFinished):
            break
    client.send(ev.Pause())
    reply = next(e for e in client.events(poll_s=0.1) if isinstance(e, ev.WorkerFailed))
    assert not reply.fatal and reply.request == "Pause" and "not training" in reply.message and reply.seq == -1
    status = client.request_status()
    assert (status.state, status.step, status.total_steps) == ("finished", 150, 150)
    assert not [e for e in run.events() if isinstance(e, ev.StatusReported)]  # replies are not logged
    client.close()


def _impostor() -> Exception:
    return type("DataError", (RuntimeError,), {})("named like a data error, and not one")


def _out_of_memory() -> Exception:
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(("error", "kind"), [
    (lambda: DataError("rows.jsonl line 3: no 'output' column"), "data"),
    (lambda: ConfigError("c.yaml line 4: 'trainer.learning_rate' is not a number"), "config"),
    (_out_of_memory, "oom"),
    (_impostor, "crash"),
    (lambda: ev.ReportedFailure("oom", "out of memory at step 3; lower data.max_seq_length"), "oom"),
])
def test_a_failure_is_reported_once_with_the_kind_of_its_type(tmp_path: Path, error, kind: str) -> None:
    raised = error()

    class Failing(FakeTrainer):
        def train(self, resume: bool = False) -> None:
            if isinstance(raised, ev.ReportedFailure):  # the engine says it itself, then raises
                self.emit(ev.WorkerFailed(kind=raised.kind, message=str(raised)))
            raise raised

    run = create_run(RunConfig(name="fails"), tmp_path / "runs")
    worker = Worker(run, trainer_factory=Failing, foreground=True)  # exits when its first command is done
    worker.serve(listen(run, write_key(run)), first=ev.StartTraining())
    failures = [e for e in run.events() if isinstance(e, ev.WorkerFailed)]
    assert [(f.kind, f.fatal) for f in failures] == [(kind, True)]
    assert str(raised) in failures[0].message and worker.state == ev.WorkerState.FAILED


def test_a_worker_that_hangs_up_during_the_handshake_is_no_worker(run: RunDir) -> None:
    """A worker killed while a client connects (its socket still takes the connection, then closes
    it before the key's challenge) reads as no worker, retried until the timeout: `studio train
    --resume` right after a SIGKILL got a bare EOFError from here (CI, 8021966)."""
    import socket

    from studio.worker.client import WorkerUnavailable

    write_key(run)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(run.socket_address())
    server.listen(8)
    hung_up: list[int] = []

    def hang_up() -> None:
        server.settimeout(5)
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()
            hung_up.append(1)

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        with pytest.raises(WorkerUnavailable, match="no worker is running"):
            WorkerClient(run).connect(timeout=0.5)
    finally:
        server.close()
        thread.join(10)
    assert len(hung_up) >= 2  # retried, not given up at the first hang-up
