"""Faults a careful user or a hostile local process can cause (issue 19, its runtime half): a silent
connection, loose file modes, a full disk, out-of-memory outside forward/backward, a damaged
checkpoint. Disk-full tests are in tests/e2e/test_disk_full.py."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest
import torch
from helpers.worker import wait_for

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.runs import create_run, find_run
from studio.worker.client import WorkerClient, connect_or_start


def test_a_silent_connection_does_not_block_pause(fake_cli: Path,  # noqa: F811
                                                  capsys: pytest.CaptureFixture) -> None:
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "400"]) == 0
    run = find_run(capsys.readouterr().out.strip())
    client = WorkerClient(run)
    wait_for(client, lambda e: isinstance(e, ev.StepLogged) and e.step >= 2, seen=[])

    # Opens the socket and never answers the key challenge.
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    for sock in silent:
        sock.connect(run.socket_address())
    started = time.monotonic()
    assert studio(["pause", run.id]) == 0
    assert time.monotonic() - started < 10
    assert "paused run" in capsys.readouterr().out

    # The silent ones are hung up on once the handshake time is over.
    for sock in silent:
        sock.settimeout(15)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk  # the challenge, then end of file
        assert data.startswith(b"\x00\x00\x00")  # the length-prefixed challenge it never answered
        sock.close()
    assert studio(["stop", run.id]) == 0
    client.close()


# ------------------------------------------------------------------------------- private run folders


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_run_folders_are_private_and_loose_ones_are_tightened_with_a_note(
        fake_cli: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "12"]) == 0
    run = find_run(capsys.readouterr().out.strip())
    assert studio(["attach", run.id]) == 0
    deadline = time.monotonic() + 20
    while run.worker_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    made = [p for p in run.path.rglob("*")] + [run.path]
    assert {_mode(p) for p in made if p.is_dir()} == {0o700}
    assert {_mode(p) for p in made if p.is_file()} == {0o600}
    assert {p.name for p in made} >= {"config.yaml", "events.jsonl", "worker.log", "step-12", "state.json"}

    # A run folder from an older Studio, readable by everyone: the next worker tightens it.
    for path in made:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    client = connect_or_start(run)
    try:
        note = wait_for(client, lambda e: isinstance(e, ev.WarningRaised) and "private" in e.message, seen=[])
    finally:
        client.send(ev.Shutdown())
        client.close()
    assert note.message.startswith(f"note: {run.path.resolve()} was readable by other users")
    assert {_mode(p) for p in made if p.is_dir()} == {0o700}
    assert {_mode(p) for p in made if p.is_file()} == {0o600}


def test_rewriting_a_run_config_keeps_it_private(tmp_path: Path) -> None:
    """`studio train --resume RUN --max-steps N` rewrites the run's config: it stays 0600, and a
    user's own config file keeps whatever mode it had."""
    from studio.core.config import RunConfig
    from studio.core.runs import create_run

    run = create_run(RunConfig(), tmp_path / "runs")
    assert _mode(run.config_path) == 0o600
    config = run.config()
    config.trainer.max_steps = 7
    config.save(run.config_path)
    assert _mode(run.config_path) == 0o600 and run.config().trainer.max_steps == 7
    mine = tmp_path / "mine.yaml"
    mine.write_text("{}\n")
    os.chmod(mine, 0o644)
    config.save(mine)
    assert _mode(mine) == 0o644


# --------------------------------------------------------------------------- out of memory everywhere


def test_out_of_memory_in_every_phase_is_caught_where_it_happens(tiny_config, monkeypatch) -> None:
    """A (simulated) OOM in a training step, the evaluation, the optimizer step, a checkpoint save
    and a chat answer: each is retried or skipped with a warning that says so; the run finishes."""
    from helpers.oom_injection import inject_oom

    from studio.engine import checkpoint
    from studio.engine import generate as gen
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    tiny_config.trainer.max_steps = 6
    tiny_config.trainer.eval_interval = 3
    tiny_config.trainer.checkpoint_interval = 3
    run = create_run(tiny_config)
    events: list[ev.Event] = []
    session = Session(tiny_config, run, events.append)
    trainer = Trainer(session)
    inject_oom(trainer, at_step=2)  # forward/backward: the micro-batch is halved, 8 -> 4

    def once(real, phase: str, when=lambda *a, **k: True):
        armed = True

        def failing(*args, **kwargs):
            nonlocal armed
            if armed and when(*args, **kwargs):
                armed = False
                raise torch.OutOfMemoryError(f"simulated out of memory in {phase}")
            return real(*args, **kwargs)
        return failing

    # At step 3's evaluation (step 0's is the base model's, before training)
    trainer.forward = once(trainer.forward, "evaluation",
                           lambda batch: not torch.is_grad_enabled() and trainer.step == 3)
    trainer.update = once(trainer.update, "the optimizer step", lambda params: trainer.step + 1 == 4)
    monkeypatch.setattr(checkpoint, "save", once(checkpoint.save, "a checkpoint save"))
    finished = trainer.train()
    monkeypatch.setattr(gen, "generate", once(gen.generate, "generation"))
    answer = session.generate("reverse: cat")

    assert finished.step == 6 and not finished.stopped
    warnings = [e.message for e in events if isinstance(e, ev.WarningRaised)]
    assert not any(isinstance(e, ev.WorkerFailed) for e in events)
    assert [e.micro_batch_size for e in events if isinstance(e, ev.BatchSizeReduced)] == [4]
    assert any("evaluating at step 3 in batches of 4 rows: retrying in batches of 2" in m for m in warnings)
    assert [e.step for e in events if isinstance(e, ev.EvalLogged)] == [0, 3, 6]
    assert any("optimizer step at step 4" in m and "retried" in m for m in warnings)
    assert any("saving the checkpoint at step 3: freed memory, saving it again" in m for m in warnings)
    assert [e.step for e in events if isinstance(e, ev.CheckpointSaved)] == [3, 6]
    assert [e.step for e in events if isinstance(e, ev.StepLogged)] == [1, 2, 3, 4, 5, 6]
    assert any("answering a prompt" in m and "answering again" in m for m in warnings)
    assert answer.new_tokens > 0


# ------------------------------------------------------------------------------------------ resume


def test_resume_skips_a_checkpoint_that_does_not_load_and_refuses_without_one(
        tiny_config, capsys: pytest.CaptureFixture) -> None:
    from studio.engine.session import Session
    from studio.engine.train import Trainer, TrainingError

    tiny_config.trainer.max_steps = 6
    tiny_config.trainer.checkpoint_interval = 2
    tiny_config.trainer.keep_checkpoints = 3
    tiny_config.trainer.eval_interval = 0
    run = create_run(tiny_config)
    Trainer(Session(tiny_config, run, lambda e: None)).train()
    assert [p.name for p in run.checkpoints()] == ["step-2", "step-4", "step-6"]
    optimizer = run.checkpoints_dir / "step-6" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # a truncated file

    events: list[ev.Event] = []
    Trainer(Session(tiny_config, run, events.append)).train(resume=True)
    started = [e for e in events if isinstance(e, ev.RunStarted)]
    assert [e.resumed_from_step for e in started] == [4]
    notes = [e.message for e in events if isinstance(e, ev.WarningRaised)]
    assert any("step-6 does not load" in m for m in notes)
    assert any(m.startswith("resuming from step-4 (step 4); skipped step-6: ") for m in notes)

    # No checkpoint at all: one line, and only --from-scratch starts it again from step 0.
    empty = create_run(tiny_config)
    with pytest.raises(TrainingError, match="--from-scratch"):
        Trainer(Session(tiny_config, empty, lambda e: None)).train(resume=True)
    capsys.readouterr()  # the model loads' progress bars
    assert studio(["train", "--resume", str(empty.path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no checkpoint to resume from" in err and "--from-scratch" in err
    assert studio(["train", "--resume", str(run.path), "--from-scratch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has checkpoints (newest step-6)" in err


# ------------------------------------------------------------------------------------- the event log


def test_readers_skip_or_repair_a_cut_off_line_and_writers_start_on_a_new_one(tmp_path: Path) -> None:
    from studio.core.runs import iter_events
    from studio.worker.eventlog import EventLog

    log = tmp_path / "events.jsonl"
    first = ev.to_json(ev.with_seq(ev.StepLogged(step=1), 0))
    second = ev.to_json(ev.with_seq(ev.StepLogged(step=2), 1))
    # An older Studio appended onto a torn line; the log then ends in another torn line.
    log.write_text(first + "\n" + '{"type":"StepLo' + second + "\n" + '{"type":"Step')
    assert [e.step for e in iter_events(log)] == [1, 2]

    events = EventLog(log)
    assert events.next_seq == 2
    events.append(ev.StepLogged(step=3))
    events.close()
    for step in (4, 5):
        with open(log, "a") as handle:
            handle.write('{"type":"Ste')  # cut off again by a kill: the next writer cuts it away first
        again = EventLog(log)
        again.append(ev.StepLogged(step=step))
        again.close()
    assert [e.step for e in iter_events(log)] == [1, 2, 3, 4, 5]
    assert log.read_text().endswith("\n") and log.read_text().count("\n") == 5


def test_cached_memory_is_given_back_around_evaluations_and_answers(tiny_config, monkeypatch) -> None:
    """The training step's cached blocks are given back before an evaluation or an answer, and
    theirs before the next step (so the reserved peak is the larger phase's, as the estimate's
    phases assume): every evaluation pass and every answer sits between two releases."""
    from studio.engine import generate as gen
    from studio.engine import oom
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    tiny_config.trainer.max_steps = 2
    tiny_config.trainer.eval_interval = 2
    calls: list[str] = []
    monkeypatch.setattr(oom, "between_phases", lambda device: calls.append("release"))
    session = Session(tiny_config, create_run(tiny_config), lambda event: None)
    trainer = Trainer(session)
    real_pass, real_generate = trainer._eval_pass, gen.generate

    def eval_pass(*args, **kwargs):
        calls.append("evaluation")
        return real_pass(*args, **kwargs)

    def generate(*args, **kwargs):
        calls.append("answer")
        return real_generate(*args, **kwargs)

    trainer._eval_pass = eval_pass
    monkeypatch.setattr(gen, "generate", generate)
    trainer.train()
    session.generate("reverse: cat")
    # the two evaluations (step 0's and the last step's), the end of training (the optimizer and the
    # graphs are given back), then the answer
    assert calls == ["release", "evaluation", "release"] * 2 + ["release"] + ["release", "answer", "release"]


def test_a_failed_graph_capture_is_reported_once_and_training_goes_on(tiny_config, monkeypatch) -> None:
    """A CUDA graph capture that fails leaves every later step eager: correct but slower. The user
    hears it once, as a warning naming the cause, and the run still finishes."""
    from studio.engine.fast.model import FastModel
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    monkeypatch.setenv("STUDIO_FAST_PATH", "1")  # the fast path on the CPU, standing in for CUDA
    monkeypatch.setattr(FastModel, "graphs_failed",
                        property(lambda self: "AcceleratorError: cudaErrorStreamCaptureInvalidated"))
    tiny_config.trainer.max_steps = 3
    events: list[ev.Event] = []
    trainer = Trainer(Session(tiny_config, create_run(tiny_config), events.append))
    trainer.train()
    assert trainer.session.fast is not None
    assert not any(isinstance(e, ev.WorkerFailed) for e in events)
    warnings = [e for e in events if isinstance(e, ev.WarningRaised)]
    assert len(warnings) == 1, warnings
    assert "CUDA graph" in warnings[0].message and "cudaErrorStreamCaptureInvalidated" in warnings[0].detail
    assert isinstance(events[-1], ev.TrainingFinished) and events[-1].step == 3


def test_the_graphs_are_given_back_before_the_final_evaluation(tiny_config, monkeypatch) -> None:
    """No step follows the last one: the CUDA graphs' pools are released before the final evaluation
    (its eager passes would sit on top of them), not only when training ends."""
    from studio.engine.fast.model import FastModel
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    monkeypatch.setenv("STUDIO_FAST_PATH", "1")  # the fast path on the CPU, standing in for CUDA
    calls: list[str] = []
    real_release = FastModel.release_graphs
    monkeypatch.setattr(FastModel, "release_graphs",
                        lambda self: (calls.append("release graphs"), real_release(self)))
    tiny_config.trainer.max_steps = 2
    tiny_config.trainer.eval_interval = 1
    trainer = Trainer(Session(tiny_config, create_run(tiny_config), lambda event: None))
    real_pass = trainer._eval_pass

    def eval_pass(*args, **kwargs):
        calls.append(f"evaluation at step {trainer.step}")
        return real_pass(*args, **kwargs)

    trainer._eval_pass = eval_pass
    trainer.train()
    # step 0 (the base) and step 1 evaluate with the graphs kept; the last one after their release
    # (and the end of training releases them again, a no-op by then)
    assert calls == ["evaluation at step 0", "evaluation at step 1", "release graphs",
                     "evaluation at step 2", "release graphs"], calls
