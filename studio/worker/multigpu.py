"""A run on several GPUs: the device locks, then torchrun starting one worker process a GPU.

``distributed.gpus`` (or ``studio train --gpus N``) above 1 turns ``python -m studio.worker RUN_DIR``
into this launcher. It takes the lock of every GPU the run will use (a refusal names the busy one),
starts ``python -m torch.distributed.run --standalone --nproc-per-node N -m studio.worker RUN_DIR``
with ``CUDA_VISIBLE_DEVICES`` narrowed to those GPUs, waits until rank 0 listens on the run's socket,
and then lives as long as torchrun does, holding the locks. Rank 0 is the run's worker as on one GPU
(socket, events, checkpoints, adapter); the other ranks follow it (studio/engine/session.py:follow).

torchrun inherits the lock files, so the GPUs stay locked while any rank lives, even if this
launcher is killed. torchrun runs in a session of its own: a terminal's Ctrl-C reaches only this
launcher, which turns it into a Stop for rank 0 (a checkpoint, then every rank exits).

Plain Python (no torch): the ranks import it, not the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import RunDir, iter_events
from studio.worker.launch import GpuLock, WorkerStartError, check_no_other_worker

READY_TIMEOUT_S = 120.0
"""How long rank 0 may take to listen (torchrun and the ranks import torch first)."""


class Launch:
    """torchrun running ``run``'s ranks on ``keys`` (one device lock key per rank), with the locks."""

    def __init__(self, run: RunDir, keys: list[str], locks: list[GpuLock], process: subprocess.Popen,
                 rank0_pid: int):
        self.run = run
        self.keys = keys
        self.locks = locks
        self.process = process
        self.rank0_pid = rank0_pid

    def wait(self) -> int:
        """Wait for every rank to exit; returns torchrun's exit code. A failure that left no
        WorkerStopped in the log gets one line there (with where the traceback is)."""
        code = self.process.wait()
        if code != 0 and not _ended_cleanly(self.run):
            from studio.worker.eventlog import EventLog

            log = EventLog(self.run.events_path)
            log.append(ev.WorkerFailed(kind="crash", fatal=True, message=(
                f"a training process of run {self.run.id} failed (torchrun exit {code}) and every rank "
                f"stopped; the traceback is in {self.run.log_path}; continue with "
                f"'studio train --resume {self.run.id}'")))
            log.append(ev.WorkerStopped(reason=f"a rank failed (exit {code})"))
            log.close()
        for lock in self.locks:
            lock.release()
        return code

    def stop_rank0(self, signum: int = signal.SIGTERM) -> None:
        """Ask rank 0 to stop with a checkpoint (SIGTERM, as ``studio stop`` would); it tells the others."""
        try:
            os.kill(self.rank0_pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """End every rank now (a second Ctrl-C)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _first_error(run: RunDir, offset: int) -> str | None:
    """The last "error: ..." line a rank printed into worker.log after ``offset`` (their one-line
    refusals)."""
    try:
        with open(run.log_path, "rb") as handle:
            handle.seek(offset)
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    found = [line.removeprefix("error: ").strip() for line in text.splitlines() if line.startswith("error: ")]
    return found[-1] if found else None


def _ended_cleanly(run: RunDir) -> bool:
    """Whether the run's log ends with its worker's WorkerStopped."""
    events = list(iter_events(run.events_path))
    return bool(events) and isinstance(events[-1], ev.WorkerStopped)


def lock_devices(run: RunDir, keys: list[str]) -> list[GpuLock]:
    """Take the lock of every device in ``keys`` for ``run`` (idle holders are asked to make room
    first); raises WorkerStartError naming the first busy one."""
    from studio.worker.client import claim_device

    locks: list[GpuLock] = []
    try:
        for key in dict.fromkeys(keys):
            claim_device(run, key=key)
            lock = GpuLock(key)
            lock.acquire(run)
            locks.append(lock)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def torchrun_command(run: RunDir, processes: int, worker_args: list[str]) -> list[str]:
    """The torchrun command line that starts the run's ranks (one host; a free port of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "studio.worker", str(run.path.resolve()), *worker_args]


def start(run: RunDir, keys: list[str], worker_args: list[str]) -> Launch:
    """Lock the devices, start torchrun, and return once rank 0 listens. Raises WorkerStartError
    (busy device, another worker on the run, a rank that died while starting)."""
    check_no_other_worker(run)
    locks = lock_devices(run, keys)
    env = dict(os.environ)
    if keys[0] != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(keys)  # local rank i is keys[i]
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                     env.get("PYTHONPATH")) if p)
    stale = run.pid_path.read_text().strip() if run.pid_path.exists() else ""
    log_start = run.log_path.stat().st_size if run.log_path.exists() else 0
    log = open(run.log_path, "ab")
    try:
        process = subprocess.Popen(torchrun_command(run, len(keys), worker_args), stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   pass_fds=[lock.fileno() for lock in locks])
    finally:
        log.close()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        pid = run.worker_pid()
        if pid is not None and str(pid) != stale and run.key_path.exists():
            return Launch(run, keys, locks, process, pid)
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            for lock in locks:
                lock.release()
            raise WorkerStartError(_first_error(run, log_start) or f"the training processes of run {run.id} did not "
                                   f"start; the reason is at the end of {run.log_path}")
        time.sleep(0.1)


def serve_detached(run: RunDir, keys: list[str], worker_args: list[str], report: object) -> int:
    """The launcher as a daemon (``python -m studio.worker RUN_DIR`` of a multi-GPU run): start the
    ranks, report rank 0's pid to whoever started us, then wait; SIGTERM becomes rank 0's."""
    try:
        launch = start(run, keys, worker_args)
    except (WorkerStartError, OSError) as exc:
        report(f"error {exc}")  # type: ignore[operator]
        return 1
    signal.signal(signal.SIGTERM, lambda *_: launch.stop_rank0())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    report(f"ok {launch.rank0_pid}")  # type: ignore[operator]
    code = launch.wait()
    print(f"launcher exiting: torchrun exit {code}", flush=True)
    return code
