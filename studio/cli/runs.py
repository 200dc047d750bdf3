"""Handlers of the run commands: ``studio train --detach``, ``attach``, ``runs``, ``stop``, ``pause``,
``resume``. Each takes the parsed arguments and returns an exit code; a problem a person can fix
is one line on stderr, never a traceback.

The commands that act on a run (start detached, pause, resume, stop) are functions that return an
:class:`Outcome` or raise :class:`RunCommandFailed`, so every front end (these handlers, the MCP
server) does the same thing and says it in the same words.

No torch here: these talk to the worker through :mod:`studio.worker.client` and read run directories.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from studio.core import events as ev
from studio.core.config import ConfigError
from studio.core.runs import RunDir, create_run, find_run, list_runs, summarize
from studio.core.runs.cells import cell
from studio.core.runs.report import StepLines, describe, format_duration
from studio.core.runs.storage import LOW_SPACE_BYTES, disk_full_message, free_bytes
from studio.worker.client import (
    DeviceBusy,
    WorkerClient,
    WorkerStartError,
    WorkerUnavailable,
    claim_device,
    start_worker,
)


class RunCommandFailed(Exception):
    """A run command that could not be done; the message is the one line a person reads."""


@dataclass(frozen=True)
class Outcome:
    """What a run command did: the line that says so, and where it left the run."""

    run: RunDir
    message: str
    """The line ``studio pause`` / ``resume`` / ``stop`` / ``train --detach`` prints."""
    step: int | None = None
    """The step the run was paused, resumed or stopped at, where the command knows it."""
    adapter: str | None = None
    """The adapter a stop saved."""
    worker_pid: int | None = None
    """The worker a start (or a resume in a new worker) started."""


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _say(text: str) -> None:
    print(text, flush=True)


def _quiet(_text: str) -> None:
    """A front end that shows no progress line (the MCP server answers once, at the end)."""


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
    if getattr(args, "resume", None):
        from studio.core.memory.multigpu import GpuCountError, plan_devices

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
        return _print_outcome(lambda: resume_run(run, getattr(args, "from_scratch", False)))
    # --runs-dir when given, else the config's output_dir (the foreground `studio train` uses it too).
    root = args.runs_dir if getattr(args, "runs_dir", "runs") != "runs" else None
    try:
        outcome = start_detached(args.config, root, data=getattr(args, "data", None),
                                 model=getattr(args, "model", None), max_steps=getattr(args, "max_steps", None),
                                 gpus=getattr(args, "gpus", None))
    except RunCommandFailed as exc:
        return _fail(str(exc))
    print(outcome.run.id)
    print(outcome.message, file=sys.stderr)
    return 0


def start_detached(config_path: str, runs_dir: str | Path | None = None, *, data: str | None = None,
                   model: str | None = None, max_steps: int | None = None,
                   gpus: int | str | None = None) -> Outcome:
    """Start a new run of the config at ``config_path`` in a background worker that trains at once
    and outlives the caller; returns when the worker listens. ``runs_dir``: where the run folder
    goes (default: the config's ``output_dir``); the rest override the config as ``studio train``'s
    options do. Raises ConfigError for the config, RunCommandFailed for the rest (no dataset, the
    device busy, the worker not starting); a busy device refuses before any run folder is made."""
    from studio.cli.train import prepare_config
    from studio.core.memory.multigpu import GpuCountError, plan_devices

    overrides = argparse.Namespace(config=config_path, data=data, model=model, max_steps=max_steps, gpus=gpus)
    config, _ = prepare_config(overrides)
    try:
        plan_devices(config)
    except GpuCountError as exc:
        raise RunCommandFailed(str(exc)) from None
    config.model.base_model = _absolute_if_local(config.model.base_model) or config.model.base_model
    if config.data.path is None:
        raise RunCommandFailed(f"{config_path}: no dataset; set data.path in the config or pass --data PATH")
    try:
        claim_device()
    except DeviceBusy as exc:
        raise RunCommandFailed(str(exc)) from None
    run = create_run(config, runs_dir)
    try:
        pid = start_worker(run, train=True)
    except WorkerStartError as exc:
        raise RunCommandFailed(str(exc)) from None
    return Outcome(run, f"training in the background (worker pid {pid}); follow it with 'studio attach {run.ref}', "
                        f"stop it with 'studio stop {run.ref}'", worker_pid=pid)


def _print_outcome(command: Callable[[], Outcome]) -> int:
    """Run a run command for the CLI: its line on stdout (0), or its failure on stderr (1)."""
    try:
        outcome = command()
    except RunCommandFailed as exc:
        return _fail(str(exc))
    print(outcome.message)
    return 0


def resume_run(run: RunDir, from_scratch: bool = False) -> Outcome:
    """Continue ``run`` from its latest checkpoint (a paused run: where it is), in its live worker or
    in a new one; ``from_scratch``: start a run that saved no checkpoint again from step 0."""
    from studio.cli.train import resume_refusal

    summary = summarize(run)
    if summary.status == "finished":
        raise RunCommandFailed(f"run {run.id} already finished (step {summary.step}); nothing to resume")
    checkpoint = run.latest_checkpoint()
    if summary.status not in ("paused", "training"):  # those are served by their live worker
        try:
            from_scratch = resume_refusal(run, from_scratch)
        except ConfigError as exc:
            raise RunCommandFailed(str(exc)) from None
    where = f"from {checkpoint.name}" if checkpoint else "from step 0 (--from-scratch)"
    client = WorkerClient(run)
    status = None
    if run.worker_pid() is not None:
        try:
            status = client.connect(5.0)
        except WorkerUnavailable:
            pass  # a worker killed a moment ago (its pid may linger as a zombie): start a new one
    if status is not None:
        try:
            if status.state == ev.WorkerState.PAUSED:
                client.send(ev.Resume())
                return Outcome(run, f"resumed run {run.id} at step {status.step}", step=status.step)
            if status.state.in_training:
                raise RunCommandFailed(f"run {run.id} is already {status.state} (step {status.step})")
            client.send(ev.StartTraining(resume=not from_scratch))
            return Outcome(run, f"resuming run {run.id} {where} in its worker")
        finally:
            client.close()
    try:
        claim_device(run)
    except DeviceBusy as exc:
        raise RunCommandFailed(str(exc)) from None
    try:
        pid = start_worker(run, train=from_scratch, resume=not from_scratch)
    except WorkerStartError as exc:
        raise RunCommandFailed(str(exc)) from None
    return Outcome(run, f"resuming run {run.id} {where} (worker pid {pid}); follow it with 'studio attach {run.ref}'",
                   worker_pid=pid)


# ------------------------------------------------------------------------------------- attach


def _print_event(event: ev.Event, lines: Callable[[ev.Event], str | None] = describe) -> None:
    line = lines(event)
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
    lines = StepLines()  # a step's memory and GRPO metrics join its step line
    try:
        print(f"run {run.id}  ({run.path})", flush=True)
        for event in client.catch_up():
            _print_event(event, lines)
        if client.status is not None and not client.status.state.in_training or \
                client.status is None and not _starting(run):
            client.close()
            return _explain_not_live(run)
        while True:
            for event in client.poll(1.0):
                _print_event(event, lines)
                if _ends_follow(event):
                    client.close()
                    return 1 if isinstance(event, ev.WorkerFailed) else 0
            if not client.connected and run.worker_pid() is None:
                client.close()
                for event in client.poll(0):
                    _print_event(event, lines)
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
        rows.append((run.id, cell(s.model.rstrip("/").split("/")[-1], 32), s.status, step, best,
                     format_duration(now - s.started)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


# ---------------------------------------------------------------------------- stop, pause, resume


def _live_client(run: RunDir) -> WorkerClient:
    """A client connected to the run's worker; RunCommandFailed says why there is none to talk to."""
    client = WorkerClient(run)
    if run.worker_pid() is not None:
        try:
            client.connect(5.0)
            return client
        except WorkerUnavailable as exc:
            # A worker that is closing has stopped listening but keeps its pid file while it says
            # goodbye to its clients (up to 2 s): once it is gone, the run's status says more.
            if not _gone(run, WORKER_CLOSE_S):
                raise RunCommandFailed(str(exc)) from None
    summary = summarize(run)
    raise RunCommandFailed(_disk_full_now(run, summary.status) or
                           f"run {run.id} has no worker running (status: {summary.status}, step {summary.step})")


WORKER_CLOSE_S = 3.0
"""How long a command waits for a worker that refused its connection to finish exiting."""


def _gone(run: RunDir, timeout: float) -> bool:
    """Whether the run's worker has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while run.worker_pid() is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


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
    return _print_outcome(lambda: stop_run(run, say=_say))


def stop_run(run: RunDir, say: Callable[[str], None] = _quiet) -> Outcome:
    """Shut ``run``'s worker down; a training run saves a checkpoint and the adapter first (``say``
    gets the line that says so while it saves). Returns once the worker has stopped."""
    client = _live_client(run)
    assert client.status is not None
    training = client.status.state.in_training
    if training:
        say(f"stopping run {run.id} after step {client.status.step}: saving a checkpoint and the adapter…")
    try:
        client.send(ev.Shutdown())
        finished = _wait_for(client, lambda e: isinstance(e, (ev.TrainingFinished, ev.WorkerStopped)), 3600)
        if training and isinstance(finished, ev.TrainingFinished):
            _wait_for(client, lambda e: isinstance(e, ev.WorkerStopped), 30)
            outcome = Outcome(run, f"stopped at step {finished.step}; adapter in {finished.adapter_path}; continue "
                                   f"with 'studio train --resume {run.ref} --detach'",
                              step=finished.step, adapter=finished.adapter_path)
        elif finished is None and client.connected:
            raise RunCommandFailed(f"run {run.id}: the worker has not stopped yet; see {run.log_path}")
        else:
            outcome = Outcome(run, f"worker of run {run.id} shut down")
    finally:
        client.close()
    # The worker says goodbye to its other clients, then exits: once this returns, the next command
    # (a second stop, a resume) finds no worker rather than one in its last seconds.
    _gone(run, WORKER_CLOSE_S)
    return outcome


def pause(args: argparse.Namespace) -> int:
    """``studio pause [RUN]``: pause after the current step; the model stays loaded for chat."""
    run = find_run(getattr(args, "run", None), _runs_root(args))
    return _print_outcome(lambda: pause_run(run, say=_say))


def pause_run(run: RunDir, say: Callable[[str], None] = _quiet) -> Outcome:
    """Pause ``run`` after its current step and return once it has paused (``say`` gets the line
    that says it is waiting for that step); the model stays loaded for chat."""
    client = _live_client(run)
    try:
        assert client.status is not None
        if client.status.state == ev.WorkerState.PAUSED:
            return Outcome(run, f"run {run.id} is already paused at step {client.status.step}",
                           step=client.status.step)
        if not client.status.state.in_training:
            raise RunCommandFailed(f"run {run.id} is not training (state: {client.status.state})")
        client.send(ev.Pause())
        say(f"pausing run {run.id} after the current step…")
        paused = _wait_for(client, lambda e: isinstance(e, (ev.TrainingPaused, ev.TrainingFinished)) or
                           _reply_failure(e), 3600)
        if isinstance(paused, ev.WorkerFailed):
            raise RunCommandFailed(paused.message)
        if not isinstance(paused, ev.TrainingPaused):
            raise RunCommandFailed(f"run {run.id} did not pause (it may have finished); see 'studio attach {run.ref}'")
        return Outcome(run, f"paused run {run.id} after step {paused.step}; 'studio resume {run.ref}' continues it",
                       step=paused.step)
    finally:
        client.close()


def resume(args: argparse.Namespace) -> int:
    """``studio resume [RUN]``: continue a paused run, or restart an interrupted or stopped one from
    its latest checkpoint."""
    run = find_run(getattr(args, "run", None), _runs_root(args))
    return _print_outcome(lambda: resume_run(run))
