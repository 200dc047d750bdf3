"""Handlers of the run commands: ``studio train --detach``, ``attach``, ``runs``, ``stop``, ``pause``,
``resume``. Each takes the parsed arguments and returns an exit code; a problem a person can fix
is one line on stderr, never a traceback.

No torch here: these talk to the worker through :mod:`studio.worker.client` and read run directories.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from studio.core import events as ev
from studio.core.config import ConfigError
from studio.core.report import describe, format_duration, shorten, step_line
from studio.core.runs import RunDir, create_run, find_run, list_runs, summarize
from studio.core.storage import LOW_SPACE_BYTES, disk_full_message, free_bytes
from studio.worker.client import (
    DeviceBusy,
    WorkerClient,
    WorkerStartError,
    WorkerUnavailable,
    claim_device,
    start_worker,
)

_LIVE_STATES = ("loading", "training", "paused")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _runs_root(args: argparse.Namespace) -> str:
    return getattr(args, "runs_dir", None) or "runs"


def _absolute_if_local(value: str | None) -> str | None:
    """A path that exists from here, made absolute so the run directory works from any folder."""
    if value and Path(value).exists():
        return str(Path(value).resolve())
    return value


# ---------------------------------------------------------------------------------- train --detach


def train_detached(args: argparse.Namespace) -> int:
    """``studio train CONFIG --detach`` (or ``--resume RUN --detach``): start the background worker,
    print the run id and return at once; the run survives this terminal."""
    from studio.core.multigpu import GpuCountError, plan_devices

    if getattr(args, "resume", None):
        run = find_run(args.resume, _runs_root(args))
        if getattr(args, "gpus", None):
            # On another number of GPUs: the run's saved config says how many (docs/multigpu.md).
            config = run.config()
            config.distributed.gpus = args.gpus
            try:
                plan_devices(config)
            except GpuCountError as exc:
                return _fail(str(exc))
            config.save(run.config_path)
        return _resume_run(run, getattr(args, "from_scratch", False))
    from studio.worker.cli_train import prepare_config

    config, _ = prepare_config(args)
    try:
        plan_devices(config)
    except GpuCountError as exc:
        return _fail(str(exc))
    config.model.base_model = _absolute_if_local(config.model.base_model) or config.model.base_model
    if config.data.path is None:
        return _fail(f"{args.config}: no dataset; set data.path in the config or pass --data PATH")
    try:
        claim_device()
    except DeviceBusy as exc:
        return _fail(str(exc))
    # --runs-dir when given, else the config's output_dir (the foreground `studio train` uses it too).
    root = args.runs_dir if getattr(args, "runs_dir", "runs") != "runs" else config.output_dir
    run = create_run(config, root)
    try:
        pid = start_worker(run, train=True)
    except WorkerStartError as exc:
        return _fail(str(exc))
    print(run.id)
    print(f"training in the background (worker pid {pid}); follow it with 'studio attach {run.ref}', "
          f"stop it with 'studio stop {run.ref}'", file=sys.stderr)
    return 0


def _resume_run(run: RunDir, from_scratch: bool = False) -> int:
    """Continue ``run`` from its latest checkpoint (a paused run: where it is), in its live worker or
    in a new one; ``from_scratch``: start a run that saved no checkpoint again from step 0."""
    from studio.worker.cli_train import resume_refusal

    summary = summarize(run)
    if summary.status == "finished":
        return _fail(f"run {run.id} already finished (step {summary.step}); nothing to resume")
    checkpoint = run.latest_checkpoint()
    if summary.status not in ("paused", "training"):  # those are served by their live worker
        try:
            from_scratch = resume_refusal(run, from_scratch)
        except ConfigError as exc:
            return _fail(str(exc))
    where = f"from {checkpoint.name}" if checkpoint else "from step 0 (--from-scratch)"
    client = WorkerClient(run)
    status = None
    if run.worker_pid() is not None:
        try:
            status = client.connect(5.0)
        except WorkerUnavailable:
            pass  # a worker killed a moment ago (its pid may linger as a zombie): start a new one
    if status is not None:
        if status.state == "paused":
            client.send(ev.Resume())
            print(f"resumed run {run.id} at step {status.step}")
            return 0
        if status.state in _LIVE_STATES:
            return _fail(f"run {run.id} is already {status.state} (step {status.step})")
        client.send(ev.StartTraining(resume=not from_scratch))
        client.close()
        print(f"resuming run {run.id} {where} in its worker")
        return 0
    try:
        claim_device(run)
    except DeviceBusy as exc:
        return _fail(str(exc))
    try:
        pid = start_worker(run, train=from_scratch, resume=not from_scratch)
    except WorkerStartError as exc:
        return _fail(str(exc))
    print(f"resuming run {run.id} {where} (worker pid {pid}); follow it with 'studio attach {run.ref}'")
    return 0


# ------------------------------------------------------------------------------------- attach


class _EventPrinter:
    """``studio attach``'s lines: each event's, with its time. A step's memory sample (logged just
    before the step) goes on the step's line, as ``studio train`` prints it, not on a line of its own
    that repeats the step; another GPU's sample of a data-parallel run keeps its own line."""

    def __init__(self) -> None:
        self.memory: ev.MemorySampled | None = None

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.MemorySampled) and event.rank == 0:
            self.memory = event
            return
        if isinstance(event, ev.StepLogged):
            memory = self.memory if self.memory is not None and self.memory.step == event.step else None
            line: str | None = step_line(event, memory)
        else:
            line = describe(event)
        if line is not None:
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            print(f"{stamp}  {line}", flush=True)


def _ends_follow(event: ev.Event) -> bool:
    return isinstance(event, (ev.TrainingFinished, ev.WorkerStopped)) or \
        (isinstance(event, ev.WorkerFailed) and event.fatal)


def attach(args: argparse.Namespace) -> int:
    """``studio attach [RUN]``: print the run's every event from the start, then follow it live
    until training ends (through the worker's socket; a foreground ``studio train`` is a worker too).
    Ctrl-C detaches; the run goes on."""
    run = find_run(getattr(args, "run", None), _runs_root(args))
    client = WorkerClient(run)
    show = _EventPrinter()
    try:
        print(f"run {run.id}  ({run.path})", flush=True)
        for event in client.catch_up():
            show(event)
        if client.status is not None and client.status.state not in _LIVE_STATES or \
                client.status is None and not _starting(run):
            client.close()
            return _explain_not_live(run)
        while True:
            for event in client.poll(1.0):
                show(event)
                if _ends_follow(event):
                    client.close()
                    return 1 if isinstance(event, ev.WorkerFailed) else 0
            if not client.connected and run.worker_pid() is None:
                client.close()
                for event in client.poll(0):
                    show(event)
                return _explain_not_live(run)
    except KeyboardInterrupt:
        client.close()
        print(f"\ndetached; run {run.id} goes on (studio attach {run.ref} to follow again)")
        return 0


def _starting(run: RunDir) -> bool:
    """A live process holds the run but its socket does not answer yet (a worker still starting,
    a foreground ``studio train`` included). Its events.jsonl is followed until it does."""
    return run.worker_pid() is not None and summarize(run).status in ("created", "training", "paused")


def _disk_full_now(run: RunDir, status: str) -> str | None:
    """The disk-full line for a run whose worker stopped for a full disk: the one it logged, or,
    when it could not log why it stopped, one made up while the run's disk is full now."""
    if status == "failed":
        fatal = [e for e in run.events() if isinstance(e, ev.WorkerFailed) and e.fatal]
        return fatal[-1].message if fatal and fatal[-1].kind == "disk" else None
    free = free_bytes(run.path)
    if status == "interrupted" and free is not None and free < LOW_SPACE_BYTES:
        return disk_full_message(run.path, run.id)
    return None


def _explain_not_live(run: RunDir) -> int:
    summary = summarize(run)
    if summary.status == "interrupted" and (full := _disk_full_now(run, summary.status)) is not None:
        print(full)  # the log could not say it (the run's own FAILED line is above otherwise)
        return 1
    if summary.status == "interrupted":
        print(f"run {run.id} was interrupted at step {summary.step} (no worker is running); "
              f"continue it with 'studio train --resume {run.ref} --detach'")
        return 1
    if summary.status == "failed":
        print(f"run {run.id} failed at step {summary.step}; the FAILED line above says why")
        return 1
    print(f"run {run.id} is {summary.status} (step {summary.step}/{summary.total_steps})")
    return 0


# --------------------------------------------------------------------------------------- runs


def runs(args: argparse.Namespace) -> int:
    """``studio runs``: a table of runs, newest first."""
    root = _runs_root(args)
    found = list_runs(root)
    if not found:
        print(f"no runs in {root}/ yet; start one with 'studio train CONFIG --detach'")
        return 0
    rows = [("ID", "MODEL", "STATUS", "STEP", "BEST EVAL", "AGE")]
    now = time.time()
    for run in found:
        s = summarize(run)
        step = f"{s.step}/{s.total_steps}" if s.total_steps else str(s.step)
        best = f"{s.best_eval_loss:.4f}" if s.best_eval_loss is not None else "-"
        rows.append((run.id, shorten(s.model.rstrip("/").split("/")[-1], 32), s.status, step, best,
                     format_duration(now - s.started)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


# ---------------------------------------------------------------------------- stop, pause, resume


def _live_client(run: RunDir) -> WorkerClient | None:
    """A connected client, or None after printing why there is no worker to talk to."""
    client = WorkerClient(run)
    if run.worker_pid() is not None:
        try:
            client.connect(5.0)
            return client
        except WorkerUnavailable as exc:
            _fail(str(exc))
            return None
    summary = summarize(run)
    _fail(_disk_full_now(run, summary.status) or
          f"run {run.id} has no worker running (status: {summary.status}, step {summary.step})")
    return None


def _wait_for(client: WorkerClient, done: Callable[[ev.Event], bool], timeout: float) -> ev.Event | None:
    """The first live event for which ``done`` holds, or None at timeout / when the worker exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in client.poll(0.5):
            if done(event):
                return event
        if not client.connected:
            return None
    return None


def _reply_failure(event: ev.Event) -> bool:
    """A failure the worker sent to this client only: the command could not be served."""
    return isinstance(event, ev.WorkerFailed) and event.seq < 0


def stop(args: argparse.Namespace) -> int:
    """``studio stop [RUN]``: checkpoint, save the adapter, and shut the worker down."""
    run = find_run(getattr(args, "run", None), _runs_root(args))
    client = _live_client(run)
    if client is None:
        return 1
    assert client.status is not None
    training = client.status.state in _LIVE_STATES
    if training:
        print(f"stopping run {run.id} after step {client.status.step}: saving a checkpoint and the adapter…",
              flush=True)
    client.send(ev.Shutdown())
    try:
        finished = _wait_for(client, lambda e: isinstance(e, (ev.TrainingFinished, ev.WorkerStopped)), 3600)
        if training and isinstance(finished, ev.TrainingFinished):
            print(f"stopped at step {finished.step}; adapter in {finished.adapter_path}; continue with "
                  f"'studio train --resume {run.ref} --detach'")
            _wait_for(client, lambda e: isinstance(e, ev.WorkerStopped), 30)
        elif finished is None and client.connected:
            return _fail(f"run {run.id}: the worker has not stopped yet; see {run.log_path}")
        else:
            print(f"worker of run {run.id} shut down")
    finally:
        client.close()
    return 0


def pause(args: argparse.Namespace) -> int:
    """``studio pause [RUN]``: pause after the current step; the model stays loaded for chat."""
    run = find_run(getattr(args, "run", None), _runs_root(args))
    client = _live_client(run)
    if client is None:
        return 1
    try:
        assert client.status is not None
        if client.status.state == "paused":
            print(f"run {run.id} is already paused at step {client.status.step}")
            return 0
        if client.status.state not in _LIVE_STATES:
            return _fail(f"run {run.id} is not training (state: {client.status.state})")
        client.send(ev.Pause())
        print(f"pausing run {run.id} after the current step…", flush=True)
        paused = _wait_for(client, lambda e: isinstance(e, (ev.TrainingPaused, ev.TrainingFinished)) or
                           _reply_failure(e), 3600)
        if isinstance(paused, ev.WorkerFailed):
            return _fail(paused.message)
        if not isinstance(paused, ev.TrainingPaused):
            return _fail(f"run {run.id} did not pause (it may have finished); see 'studio attach {run.ref}'")
        print(f"paused run {run.id} after step {paused.step}; 'studio resume {run.ref}' continues it")
        return 0
    finally:
        client.close()


def resume(args: argparse.Namespace) -> int:
    """``studio resume [RUN]``: continue a paused run, or restart an interrupted or stopped one from
    its latest checkpoint."""
    return _resume_run(find_run(getattr(args, "run", None), _runs_root(args)))
