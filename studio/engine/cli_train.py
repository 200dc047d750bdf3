"""``studio train CONFIG`` in the foreground: progress bar, a line per log interval, a run directory.

Every event the trainer emits is numbered and appended to ``runs/<id>/events.jsonl`` (the same log
the worker writes, so ``studio attach`` and the TUI read foreground runs too) and printed. Ctrl-C
asks the trainer to stop after the current optimizer step: it saves a checkpoint and the adapter,
and the run can be continued with ``--resume``. A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig, load_config
from studio.core.runs import RunDir, append_event, create_run, find_run, iter_events
from studio.core.trackers import start_trackers


class EventLog:
    """Numbers events (continuing an existing log's sequence), appends them to events.jsonl, and
    passes them on to ``listeners``. Thread-safe: generation may emit from another thread."""

    def __init__(self, run: RunDir, *listeners: Any):
        self.path = run.events_path
        self.listeners = list(listeners)
        self._lock = threading.Lock()
        self.seq = max((e.seq for e in iter_events(self.path)), default=-1) + 1

    def __call__(self, event: ev.Event) -> ev.Event:
        with self._lock:
            numbered = ev.with_seq(event, self.seq)
            self.seq += 1
            append_event(self.path, numbered)
        for listener in self.listeners:
            listener(numbered)
        return numbered


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ConsolePrinter:
    """Turns events into the lines a person watches: one per log interval, plus a progress bar on a
    terminal."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None):
        # Looked up now, not at import: sys.stdout may have been replaced since (tests, redirects).
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.bar = self.err.isatty()
        self.memory: ev.MemorySampled | None = None
        self._bar_shown = False

    def line(self, text: str) -> None:
        if self._bar_shown:
            self.err.write("\r\033[K")
            self._bar_shown = False
        print(text, file=self.out, flush=True)

    def draw_bar(self, step: int, total: int, eta: float) -> None:
        if not self.bar or total <= 0:
            return
        width = 30
        filled = int(width * step / total)
        self.err.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{total}  eta {_duration(eta)}")
        self.err.flush()
        self._bar_shown = True

    def memory_text(self) -> str:
        m = self.memory
        if m is None:
            return ""
        if m.capacity:
            return f"mem {_gb(m.allocated)} (peak {_gb(m.peak_allocated)} of {_gb(m.capacity)})"
        return f"mem {_gb(m.allocated)}"

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.ModelLoading):
            self.line(f"loading: {event.stage}")
        elif isinstance(event, ev.ModelLoaded):
            self.line(f"model {event.base_model} on {event.device} ({event.quantization}), "
                      f"{event.trainable_params:,} trainable of {event.total_params:,} parameters, "
                      f"loaded in {event.load_seconds:.1f} s")
        elif isinstance(event, ev.RunStarted):
            start = f", resuming after step {event.resumed_from_step}" if event.resumed_from_step else ""
            self.line(f"run {event.run_id}: {event.total_steps} steps, {event.train_rows} training rows, "
                      f"{event.eval_rows} validation rows, micro-batch {event.micro_batch_size} x "
                      f"{event.gradient_accumulation_steps} accumulation{start}")
        elif isinstance(event, ev.MemorySampled):
            self.memory = event
        elif isinstance(event, ev.StepLogged):
            self.line(f"step {event.step}/{event.total_steps}  loss {event.loss:.4f}  "
                      f"lr {event.learning_rate:.2e}  {event.tokens_per_s:,.0f} tok/s  {self.memory_text()}"
                      f"  eta {_duration(event.eta_s)}")
            self.draw_bar(event.step, event.total_steps, event.eta_s)
        elif isinstance(event, ev.EvalLogged):
            self.line(f"eval at step {event.step}: loss {event.loss:.4f}  perplexity {event.perplexity:.2f}  "
                      f"token accuracy {event.token_accuracy:.1%} ({event.rows} rows)")
        elif isinstance(event, ev.CheckpointSaved):
            self.line(f"checkpoint saved: {event.path}")
        elif isinstance(event, ev.BatchSizeReduced):
            self.line(f"warning: {event.message}")
        elif isinstance(event, ev.WorkerFailed):
            self.line(f"{'error' if event.fatal else 'warning'} ({event.kind}): {event.message}")
        elif isinstance(event, ev.TrainingFinished):
            how = "stopped" if event.stopped else "finished"
            best = f", best eval loss {event.best_eval_loss:.4f}" if event.best_eval_loss is not None else ""
            self.line(f"{how} at step {event.step} in {_duration(event.elapsed_s)}{best}; "
                      f"adapter: {event.adapter_path}")


def prepare_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    """The config with the command line's overrides applied and the data path made absolute."""
    from studio.core.data import resolve_path

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
    if config.data.path:
        found = resolve_path(config.data.path, base_dir)
        if found is not None:
            # The run's saved config must work from any directory.
            config.data.path = str(found.resolve())
    return config, base_dir


def main(args: argparse.Namespace) -> int:
    """``studio train CONFIG [--data PATH] [--max-steps N] [--model M] [--resume RUN] [--run-dir DIR]``."""
    from studio.engine.train import Trainer

    try:
        if getattr(args, "resume", None):
            run = find_run(args.resume, getattr(args, "runs_dir", None) or "runs")
            config = run.config()
            if getattr(args, "max_steps", None):
                config.trainer.max_steps = args.max_steps
        else:
            config, _ = prepare_config(args)
            # --runs-dir when given, else the config's output_dir (as `studio train --detach` does).
            given = getattr(args, "runs_dir", None)
            run = create_run(config, given if given not in (None, "runs") else None)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if (pid := run.worker_pid()) is not None and pid != os.getpid():
        print(f"error: run {run.id} is already being trained by process {pid}; follow it with "
              f"'studio attach {run.id}'", file=sys.stderr)
        return 2
    printer = ConsolePrinter()
    log = EventLog(run, printer)
    trackers = start_trackers(run, log)  # report_to: metrics also go to TensorBoard / W&B / MLflow
    if trackers is not None:
        log.listeners.append(trackers.offer)
    trainer = Trainer(config, run, log)
    print(f"run directory: {run.path}", flush=True)
    try:
        with _recorded_pid(run):
            return _train(run, trainer, printer, resume=bool(getattr(args, "resume", None)))
    finally:
        if trackers is not None:
            trackers.close()


@contextlib.contextmanager
def _recorded_pid(run: RunDir) -> Iterator[None]:
    """This process is the run's trainer while inside: ``worker.pid`` names it, so ``studio runs``
    says "training" (not "interrupted") and ``studio attach`` follows the log live."""
    tmp = run.pid_path.with_name(f"{run.pid_path.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(run.pid_path)
    try:
        yield
    finally:
        try:
            if run.pid_path.read_text().strip() == str(os.getpid()):
                run.pid_path.unlink()
        except OSError:
            pass


def _train(run: RunDir, trainer: Any, printer: ConsolePrinter, resume: bool) -> int:
    """Train with Ctrl-C as a stop request; the exit code of ``studio train``."""
    from studio.engine.train import TrainingError

    def on_interrupt(_signum: int, _frame: Any) -> None:
        if trainer.state != "training":
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts
        printer.line("stopping after this step: saving a checkpoint and the adapter "
                     "(Ctrl-C again to abort)")
        trainer.request_stop()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        finished = trainer.train(resume=resume)
    except TrainingError:
        return 1  # the printer already showed the WorkerFailed message
    except KeyboardInterrupt:
        print(f"\naborted; continue with: studio train --resume {run.id}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    if finished.stopped:
        print(f"continue with: studio train --resume {run.id}")
    else:
        print(f"compare base and fine-tuned answers with: studio eval {run.id}")
    return 0
