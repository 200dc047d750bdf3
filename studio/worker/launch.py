"""Starting the worker: the per-GPU lock, the detach from the terminal, the socket and its key.

Plain Python (no torch): ``python -m studio.worker`` runs all of this before the engine is imported,
so the process that launched it gets its answer (ready, or refused with a reason) in well under a
second.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path

from studio.core.paths import cache_dir
from studio.core.runs import RunDir
from studio.core.runs.storage import FILE_MODE, PRIVATE_UMASK, DiskFull, is_disk_full


class WorkerStartError(RuntimeError):
    """The worker cannot start; the message says why and what to do."""


def lock_dir() -> Path:
    """Where the per-GPU lock files live: $STUDIO_LOCK_DIR, else the cache's ``locks`` folder."""
    path = Path(os.environ.get("STUDIO_LOCK_DIR") or cache_dir() / "locks")
    path.mkdir(parents=True, exist_ok=True)
    return path


def cuda_present() -> bool:
    """Whether this process can see an NVIDIA GPU, judged without torch (it takes seconds to
    import): the driver's files exist and CUDA_VISIBLE_DEVICES does not hide every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def device_key() -> str:
    """The device this process will use, as a lock name: the first of CUDA_VISIBLE_DEVICES (0 when
    unset) on a CUDA machine, else "cpu" (one worker per machine there, which is what its cores can
    take anyway)."""
    if not cuda_present():
        return "cpu"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def device_label(key: str) -> str:
    """How a person calls the device behind lock ``key``: "GPU 0", or "this machine's CPU"."""
    return "this machine's CPU" if key == "cpu" else f"GPU {key}"


class GpuLock:
    """An exclusive ``flock`` on ``lock_dir()/gpu-<key>.lock`` (``cpu.lock`` without CUDA), held
    for the life of the process.

    The kernel drops a flock when its holder dies, even by SIGKILL, so a crashed worker never leaves
    the GPU locked. The file records who holds it, for the refusal message.
    """

    def __init__(self, key: str | None = None):
        self.key = key if key is not None else device_key()
        self.label = device_label(self.key)
        self.path = lock_dir() / ("cpu.lock" if self.key == "cpu" else f"gpu-{self.key}.lock")
        self._fd: int | None = None

    def acquire(self, run: RunDir) -> None:
        """Take the lock for ``run``, or raise WorkerStartError naming the run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkerStartError(self.holder_message()) from None
        os.ftruncate(fd, 0)
        record = {"run_id": run.id, "run_dir": str(run.path), "pid": os.getpid()}
        os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        self._fd = fd

    def busy(self) -> bool:
        """Whether a worker holds the lock now (tried and given straight back, nothing written)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def holder(self) -> dict[str, object]:
        """What the lock file says about its holder (empty while a new holder is still writing it)."""
        try:
            return dict(json.loads(self.path.read_text() or "{}"))
        except (OSError, ValueError):
            return {}

    def holder_message(self) -> str:
        """The refusal a person reads: which run holds the device, and how to free it."""
        held = self.holder()
        who = f"run {held['run_id']} (worker pid {held.get('pid')}, {held.get('run_dir')})" if held \
            else "another worker"
        ref = held.get("run_id", "RUN")
        return (f"{self.label} is busy: {who} holds it (lock {self.path}). Wait for it to finish, "
                f"or stop it with 'studio stop {ref}'.")

    def fileno(self) -> int:
        """The locked file's descriptor (a child process given it keeps the lock while it lives)."""
        assert self._fd is not None, "the lock is not held"
        return self._fd

    def release(self) -> None:
        """Give the lock back (exiting does the same)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_key(run: RunDir) -> bytes:
    """A fresh random auth key in ``RUN_DIR/worker.key``, readable by its owner only (0600)."""
    key = secrets.token_hex(32).encode()
    tmp = run.key_path.with_name(run.key_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(key)
        tmp.replace(run.key_path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no empty key file left behind
        raise
    return key


def check_no_other_worker(run: RunDir) -> None:
    """Refuse to start a second worker on the same run (it would write the same event log)."""
    pid = run.worker_pid()
    if pid is None or pid == os.getpid():
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b"studio"  # no /proc: trust the pid file
    # A worker, or `studio train` in the foreground (which records its pid too); another program
    # means the pid was reused after the run's process died.
    if b"studio" in cmdline:
        raise WorkerStartError(f"run {run.id} already has a worker (pid {pid}); "
                               f"follow it with 'studio attach {run.id}'")


HANDSHAKE_TIMEOUT_S = 5.0
"""How long a new connection has to answer the key challenge before it is hung up on."""


class WorkerListener(Listener):
    """The worker's socket. :meth:`accept` returns a connection that has not authenticated yet;
    :meth:`authenticate` does the key handshake with a time limit.

    ``multiprocessing.connection.Listener`` does the handshake inside ``accept()``, so one client
    that connects and sends nothing would block every later one behind it. The worker accepts in
    one thread and authenticates each connection in its own.
    """

    def __init__(self, address: str, key: bytes):
        super().__init__(address, family="AF_UNIX", backlog=16)  # no authkey: accept() returns at once
        self.key = key

    def authenticate(self, conn: Connection, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Challenge ``conn`` and answer its challenge; raises AuthenticationError on a wrong key,
        OSError or EOFError when the peer hangs up or stays silent past ``timeout`` seconds."""
        done = threading.Event()

        def hang_up() -> None:
            if done.is_set():
                return
            try:
                # shutdown wakes the recv blocked in the handshake (it reads end of file).
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        timer = threading.Timer(timeout, hang_up)
        timer.daemon = True
        timer.start()
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        finally:
            done.set()
            timer.cancel()


def listen(run: RunDir, key: bytes) -> WorkerListener:
    """Listen on ``RUN_DIR/worker.sock`` with mode 0600 from the first moment (umask), replacing a
    socket file that a killed worker left behind."""
    address = run.socket_address()
    Path(address).unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        listener = WorkerListener(address, key)
    finally:
        os.umask(old)
    os.chmod(address, 0o600)
    return listener


def write_pid(run: RunDir) -> None:
    """Record this process as the run's worker."""
    tmp = run.pid_path.with_name(run.pid_path.name + ".tmp")
    try:
        tmp.write_text(f"{os.getpid()}\n")
        tmp.replace(run.pid_path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def become_worker(run: RunDir, lock: GpuLock | None = None) -> tuple[GpuLock, WorkerListener]:
    """Make this process ``run``'s worker: take the device lock, make sure no other worker serves
    the run, write a fresh key, listen, record the pid. Raises WorkerStartError with the reason
    (:class:`~studio.core.runs.storage.DiskFull` when the disk is full; another OSError as it is);
    release the returned lock when the worker is done (exiting does it too). Rank 0 of a
    multi-GPU run passes an unacquired ``lock``: its launcher holds the devices' locks.

    From here on the process creates files for its owner only (umask 077): the run directory holds
    prompts, answers and data excerpts.
    """
    os.umask(PRIVATE_UMASK)
    if lock is None:
        lock = GpuLock()
        lock.acquire(run)
    listener = None
    try:
        check_no_other_worker(run)
        listener = listen(run, write_key(run))
        write_pid(run)
    except BaseException as exc:
        if listener is not None:
            listener.close()
            Path(run.socket_address()).unlink(missing_ok=True)
        if not (run.pid_path.exists() and run.worker_pid() not in (None, os.getpid())):
            run.key_path.unlink(missing_ok=True)  # ours, unless another worker serves the run
        lock.release()
        if isinstance(exc, OSError) and is_disk_full(exc, run.path):
            raise DiskFull(run.path, run.id) from exc
        raise
    return lock, listener


def detach(run: RunDir) -> Callable[[str], None]:
    """Turn this process into a daemon (double fork, new session, stdin from /dev/null, output to
    ``RUN_DIR/worker.log``); the original process waits and exits with the daemon's verdict.

    Returns ``report(line)`` for the daemon: call it once with ``"ok <pid>"`` when it is listening,
    or ``"error <message>"``. The original process prints the message and exits 0 or 1, so whoever
    ran ``python -m studio.worker`` learns whether the worker is up without polling for files. If the
    daemon dies before reporting, the pipe closes empty and the launcher points at the log.
    """
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 4096):
            chunks.append(chunk)
        answer = b"".join(chunks).decode(errors="replace").strip()
        status, _, text = answer.partition(" ")
        if status == "ok":
            print(f"worker pid {text} for run {run.id}")
            os._exit(0)
        message = text if status == "error" else \
            f"the worker for run {run.id} died while starting; see {run.log_path}"
        print(message, file=sys.stderr)
        os._exit(1)
    os.close(read_end)
    os.setsid()  # a new session: no controlling terminal, so the terminal's SIGHUP never reaches us
    if os.fork() > 0:
        os._exit(0)  # the session leader exits; its child can never reacquire a terminal

    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(run.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # lives as long as we do
    sys.stderr = open(2, "w", buffering=1, closefd=False)

    def report(line: str) -> None:
        nonlocal write_end
        if write_end < 0:
            return
        os.write(write_end, line.encode() + b"\n")
        os.close(write_end)
        write_end = -1

    return report
