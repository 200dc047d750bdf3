"""``python -m studio.worker RUN_DIR [--train | --resume]``: the background worker of one run.

Detaches from the terminal (it survives the UI, the SSH link and the launching shell), takes the
GPU lock, listens on ``RUN_DIR/worker.sock``, and exits 0 once it is listening (printing its pid) or
1 with the reason it cannot start. See docs/worker.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import RunDir
from studio.worker.launch import WorkerStartError, become_worker, detach


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m studio.worker", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory (made by 'studio train' or the TUI)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--train", action="store_true", help="start training at once")
    what.add_argument("--resume", action="store_true", help="resume training from the latest checkpoint")
    parser.add_argument("--foreground", action="store_true", help="stay attached to this terminal")
    parser.add_argument("--linger", type=float, default=float(os.environ.get("STUDIO_WORKER_LINGER", 60)),
                        help="seconds an idle worker with no client waits before exiting (default 60)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Start the worker; returns the exit code (the detached daemon never returns here)."""
    args = _parser().parse_args(argv)
    run = RunDir(Path(args.run_dir).resolve())
    if not run.config_path.exists():
        print(f"{run.path}: not a run directory (no config.yaml); create one with 'studio train CONFIG'",
              file=sys.stderr)
        return 1
    report = (lambda line: print(line)) if args.foreground else detach(run)
    try:
        _lock, listener = become_worker(run)
    except (WorkerStartError, OSError) as exc:
        report(f"error {exc}")
        return 1
    report(f"ok {os.getpid()}")

    from studio.worker.server import Worker

    first = ev.StartTraining(resume=args.resume) if (args.train or args.resume) else None
    try:
        reason = Worker(run, linger_s=args.linger).serve(listener, first=first)
    except Exception:  # the log is the only place a daemon can say what happened
        _quietly(traceback.print_exc)
        for path in (Path(run.socket_address()), run.key_path, run.pid_path):
            path.unlink(missing_ok=True)
        return 1
    _quietly(lambda: print(f"worker exiting: {reason}", flush=True))
    return 0


def _quietly(write: Callable[[], object]) -> None:
    """Write to worker.log unless it cannot take it (a full disk): the exit must not fail on that."""
    try:
        write()
    except OSError:
        pass

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # daemon threads may still hold a client connection; do not wait for them
