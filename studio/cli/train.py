"""``studio train CONFIG`` in the foreground: the run's worker in this process, a console client
attached.

This process becomes the run's worker exactly as ``python -m studio.worker`` does (device lock,
socket, key, pid, ``events.jsonl``), without detaching: ``studio attach``, ``studio pause`` and the
TUI's chat reach it on its socket while it trains. A console client follows the run's events in a
thread and prints a line per log interval (plus a progress bar on a terminal). The worker exits
when the training ends. Ctrl-C stops after the current optimizer step with a checkpoint and the
adapter saved (continue with ``--resume``); a second Ctrl-C aborts at once.

With ``--gpus N`` (or ``distributed.gpus`` in the config) above 1, this process is the launcher
of studio/worker/multigpu.py instead: torchrun runs the ranks (rank 0 is the worker), and this
process follows the run's events and turns Ctrl-C into a stop with a checkpoint.

Plain Python here: the engine is imported by the worker only when it loads the model.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig, load_config
from studio.core.config.reader import error_lines
from studio.core.memory.multigpu import GpuCountError, plan_devices, requested_gpus
from studio.core.runs import RunDir, create_run, find_run, iter_events, report, summarize
from studio.core.runs.storage import DiskFull, is_disk_full
from studio.worker.client import WorkerClient, WorkerStartError, claim_device
from studio.worker.launch import become_worker


def prepare_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    """The config with the command line's overrides applied, the data path made absolute and, for
    data that brings its own prompt settings (TRL's preference shapes, raw text: core/data/shapes.py),
    those settings, so that the run's config.yaml says what trains."""
    from studio.core.data import resolve_path
    from studio.core.data.shapes import adapt_to_data

    config = load_config(args.config)
    base_dir = Path(args.config).resolve().parent
    if getattr(args, "data", None):
        config.data.path = args.data
        base_dir = None
    if getattr(args, "max_steps", None):
        if args.max_steps <= 0:
            raise ConfigError("--max-steps must be greater than 0")
        config.trainer.max_steps = args.max_steps
    if getattr(args, "model", None):
        config.model.base_model = args.model
    if getattr(args, "gpus", None):
        config.distributed.gpus = args.gpus
    if config.trainer.method == "grpo":
        from studio.core.grpo.rewards import resolve_paths

        resolve_paths(config, Path(args.config).resolve().parent)  # reward files, like the data
    if config.data.path:
        found = resolve_path(config.data.path, base_dir)
        if found is not None:
            # The run's saved config must work from any directory.
            config.data.path = str(found.resolve())
    # TRL's preference shapes and raw text bring their own prompt settings: the run records them.
    config = adapt_to_data(config, base_dir)
    return config, base_dir


class ConsolePrinter:
    """Turns events into the lines a person watches: one per log interval, plus a progress bar on a
    terminal."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        # Looked up now, not at import: sys.stdout may have been replaced since (tests, redirects).
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.bar = self.err.isatty()
        self.saw_disk_full = False
        """Whether the console showed the worker's disk-full failure."""
        self._bar_shown = False
        self._lines = report.StepLines()
        self._lock = threading.Lock()  # the console thread and Ctrl-C's message share the lines

    def line(self, text: str) -> None:
        """Print one line, clearing the progress bar first."""
        with self._lock:
            if self._bar_shown:
                self.err.write("\r\033[K")
                self._bar_shown = False
            print(text, file=self.out, flush=True)

    def draw_bar(self, step: int, total: int, eta: float) -> None:
        """Redraw the progress bar on stderr (a terminal only)."""
        if not self.bar or total <= 0:
            return
        width = 30
        filled = int(width * step / total)
        with self._lock:
            self.err.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{total}  "
                           f"eta {report.format_duration(eta)}")
            self.err.flush()
            self._bar_shown = True

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.MemorySampled):
            self._lines(event)  # rank 0's card goes on the next step's line
        elif isinstance(event, ev.StepLogged):
            self.line(self._lines(event) or "")
            self.draw_bar(event.step, event.total_steps, event.eta_s)
        elif not isinstance(event, (ev.TokenGenerated, ev.GenerationStarted, ev.GenerationFinished,
                                    ev.WorkerStarted, ev.WorkerStopped, ev.StatusReported)):
            line = self._lines(event)
            if isinstance(event, ev.WorkerFailed) and event.kind == "disk":
                self.saw_disk_full = True
            if line is not None:
                self.line(line)


def _open_run(args: argparse.Namespace) -> tuple[RunDir, bool]:
    """The run to train (a new one from the config, or ``--resume RUN``) and whether it resumes."""
    if getattr(args, "resume", None):
        run = find_run(args.resume, getattr(args, "runs_dir", None) or "runs")
        from_scratch = resume_refusal(run, getattr(args, "from_scratch", False))
        if getattr(args, "max_steps", None) or getattr(args, "gpus", None):
            if getattr(args, "max_steps", None) is not None and args.max_steps <= 0:
                raise ConfigError("--max-steps must be greater than 0")
            # The worker trains from the run's saved config: the new length (or GPU count) goes there.
            config = run.config()
            config.trainer.max_steps = getattr(args, "max_steps", None) or config.trainer.max_steps
            config.distributed.gpus = getattr(args, "gpus", None) or config.distributed.gpus
            plan_devices(config)  # more GPUs than present: refused before the run's config changes
            try:
                config.save(run.config_path)
            except OSError as exc:
                run.config_path.with_name(run.config_path.name + ".tmp").unlink(missing_ok=True)
                if is_disk_full(exc, run.path):
                    raise DiskFull(run.config_path, run.id) from exc
                raise
        return run, not from_scratch
    config, _ = prepare_config(args)
    plan_devices(config)  # more GPUs than present: refused before a run directory is made
    # --runs-dir when given, else the config's output_dir (as `studio train --detach` does).
    given = getattr(args, "runs_dir", None)
    return create_run(config, given if given not in (None, "runs") else None), False


def resume_refusal(run: RunDir, from_scratch: bool) -> bool:
    """Check a ``--resume RUN [--from-scratch]``; returns whether it starts from step 0. A run that
    saved no checkpoint is started again only when asked (``--from-scratch``), and one that saved
    checkpoints is never silently restarted: ConfigError says what to type instead."""
    latest = run.latest_checkpoint()
    if latest is None and not from_scratch:
        raise ConfigError(f"run {run.id} has no checkpoint to resume from; start it again from step 0 "
                          f"with 'studio train --resume {run.ref} --from-scratch'")
    if latest is not None and from_scratch:
        raise ConfigError(f"--from-scratch: run {run.id} has checkpoints (newest {latest.name}); continue it "
                          f"with 'studio train --resume {run.ref}', or start a new run with "
                          f"'studio train {run.config_path}'")
    return from_scratch


def _follow(client: WorkerClient, printer: ConsolePrinter) -> None:
    """The console client: print the run's new events until its worker stops."""
    for event in client.events(poll_s=0.2):
        printer(event)
        # Unnumbered (seq -1) when the disk was too full to log it: it ends the console too.
        if isinstance(event, ev.WorkerStopped):
            break
    client.close()


def _console(run: RunDir, after_seq: int, where: str = "") -> tuple[ConsolePrinter, threading.Thread]:
    """Say where the run is, then follow its events after ``after_seq`` in a thread (join it at the end)."""
    printer = ConsolePrinter()
    print(f"run directory: {run.path}{where}", flush=True)
    console = threading.Thread(target=_follow, name="studio-console", daemon=True,
                               args=(WorkerClient(run, after_seq=after_seq), printer))
    console.start()
    return printer, console


def _stop_on_ctrl_c(printer: ConsolePrinter, stop: Callable[[], None],
                    can_stop: Callable[[], bool] = lambda: True) -> Any:
    """Make Ctrl-C call ``stop`` (the run stops after this step with a checkpoint and the adapter),
    and a second one abort; while ``can_stop`` is false (still loading: nothing to save yet) the
    first aborts. Returns the handler it replaced."""

    def on_interrupt(_signum: int, _frame: Any) -> None:
        if not can_stop():
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts
        printer.line("stopping after this step: saving a checkpoint and the adapter (Ctrl-C again to abort)")
        stop()

    return signal.signal(signal.SIGINT, on_interrupt)


def _aborted(run: RunDir) -> int:
    print(f"\naborted; continue with: studio train --resume {run.ref}", file=sys.stderr)
    return 130


def _what_next(run: RunDir, stopped: bool) -> int:
    """The last line of a training that did not fail: how to go on from here."""
    if stopped:
        print(f"continue with: studio train --resume {run.ref}")
    else:
        print(f"compare base and fine-tuned answers with: studio eval {run.ref}")
    return 0


def main(args: argparse.Namespace) -> int:
    """``studio train CONFIG [--data PATH] [--max-steps N] [--model M] [--resume RUN] [--runs-dir DIR]``."""
    from studio.worker.server import Worker

    try:
        run, resume = _open_run(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(error_lines(exc), file=sys.stderr)  # every mistake in the config, one line each
        return 2
    except DiskFull as exc:  # other OSErrors are worded by studio.cli (a folder under a file, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except GpuCountError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if requested_gpus(run.config()) > 1:
        return _train_on_gpus(run, resume)
    try:
        claim_device()  # an idle worker (a finished run kept up for chat) makes room
        lock, listener = become_worker(run)
    except (WorkerStartError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        worker = Worker(run, foreground=True)
    except OSError as exc:  # the event log cannot be opened: nothing of this worker may stay
        listener.close()
        for path in (Path(run.socket_address()), run.key_path, run.pid_path):
            path.unlink(missing_ok=True)
        lock.release()
        print(f"error: {DiskFull(run.events_path, run.id) if is_disk_full(exc, run.path) else exc}",
              file=sys.stderr)
        return 1
    printer, console = _console(run, worker.log.next_seq - 1)

    def stop() -> None:
        worker.stop_requested = True

    previous = _stop_on_ctrl_c(printer, stop, lambda: worker.state in (ev.WorkerState.TRAINING, ev.WorkerState.PAUSED))
    aborted = False
    try:
        worker.serve(listener, first=ev.StartTraining(resume=resume))
    except KeyboardInterrupt:
        aborted = True
    finally:
        signal.signal(signal.SIGINT, previous)
        lock.release()
        console.join(timeout=30)
    if aborted:
        return _aborted(run)
    if worker.disk_failure is not None and not printer.saw_disk_full:
        # Full before the console connected (at a resume's first event): said here instead.
        print(f"error: {worker.disk_failure}", file=sys.stderr)
    if worker.state == ev.WorkerState.FAILED:
        return 1  # the console already showed the failure
    return _what_next(run, stopped=worker.state == ev.WorkerState.STOPPED)


def _train_on_gpus(run: RunDir, resume: bool) -> int:
    """``studio train --gpus N``: lock the GPUs, start torchrun (rank 0 is the run's worker, and
    exits when the training ends), follow its events here. Ctrl-C: rank 0 stops after the current
    step with a checkpoint and the adapter, and every rank exits; a second Ctrl-C ends them at once."""
    from studio.worker import multigpu

    after = max((event.seq for event in iter_events(run.events_path)), default=-1)
    try:
        launch = multigpu.start(run, plan_devices(run.config()),
                                ["--resume" if resume else "--train", "--exit-when-done"])
    except (WorkerStartError, GpuCountError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    printer, console = _console(run, after, f" ({len(launch.keys)} processes; their output: {run.log_path})")
    previous = _stop_on_ctrl_c(printer, launch.stop_rank0)
    try:
        code = launch.wait()
    except KeyboardInterrupt:
        launch.kill()
        launch.wait()
        return _aborted(run)
    finally:
        signal.signal(signal.SIGINT, previous)
        console.join(timeout=30)
    status = summarize(run).status
    if code != 0 or status == "failed":
        return 1
    return _what_next(run, stopped=status == "stopped")
