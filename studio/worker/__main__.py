"""``python -m studio.worker RUN_DIR [--train | --resume]``: the background worker of one run.

Detaches from the terminal (it survives the UI, the SSH link and the launching shell), takes the
GPU lock, listens on ``RUN_DIR/worker.sock``, and exits 0 once it is listening (printing its pid) or
1 with the reason it cannot start. See docs/worker.md.

A run whose ``distributed.gpus`` is above 1 makes this process the launcher instead
(studio/worker/multigpu.py): it locks the GPUs and starts torchrun, which runs this module again
once per GPU; there rank 0 is the worker and the other ranks follow it (docs/multigpu.md).
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
    parser.add_argument("--exit-when-done", action="store_true",
                        help="exit once the first training ends (rank 0 of a foreground 'studio train --gpus N')")
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
    first = ev.StartTraining(resume=args.resume) if (args.train or args.resume) else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _rank(run, args, first)
    keys = _devices(run)
    if keys is None:
        return 1
    report = (lambda line: print(line)) if args.foreground else detach(run)
    if keys:
        from studio.worker.multigpu import serve_detached

        return serve_detached(run, keys, _worker_args(args), report)
    try:
        _lock, listener = become_worker(run)
    except (WorkerStartError, OSError) as exc:
        report(f"error {exc}")
        return 1
    report(f"ok {os.getpid()}")
    return _serve(run, args, listener, first)


def _devices(run: RunDir) -> list[str] | None:
    """The device lock keys of a multi-GPU run's processes, [] for a one-GPU run, None after printing
    why the machine cannot run it."""
    from studio.core.memory.multigpu import GpuCountError, plan_devices, requested_gpus

    config = run.config()
    if requested_gpus(config) <= 1:
        return []
    try:
        return plan_devices(config)
    except GpuCountError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The arguments each rank gets from torchrun."""
    flags = ["--resume"] if args.resume else ["--train"] if args.train else []
    if args.exit_when_done:
        flags.append("--exit-when-done")
    return [*flags, "--linger", str(args.linger)]


def _serve(run: RunDir, args: argparse.Namespace, listener: object, first: ev.Command | None) -> int:
    from studio.worker.server import Worker

    try:
        worker = Worker(run, linger_s=args.linger, foreground=args.exit_when_done)
        reason = worker.serve(listener, first=first)  # type: ignore[arg-type]
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

def _rank(run: RunDir, args: argparse.Namespace, first: ev.Command | None) -> int:
    """One of torchrun's processes: rank 0 is the run's worker (its launcher holds the locks),
    the others follow it until it exits. A problem forming the group (no NCCL) is one "error:" line
    in worker.log, which the launcher shows."""
    from studio.engine import distributed
    from studio.engine.session import follow
    from studio.worker.launch import GpuLock

    try:
        group = distributed.current()
    except distributed.DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if group.rank != 0:
        follow(run)
        return 0
    try:
        try:
            _unheld, listener = become_worker(run, lock=GpuLock())
        except (WorkerStartError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        return _serve(run, args, listener, first)
    finally:
        group.instruct({"do": "exit"})
        group.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # daemon threads may still hold a client connection; do not wait for them
