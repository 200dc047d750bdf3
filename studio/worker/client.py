"""The session client every front end uses (the TUI, ``studio train``, ``studio eval``, ``attach``):
start-or-connect under the device lock, commands over the worker's socket, events from its log and
its live stream.

Plain Python (no torch, no textual): the TUI and the CLI import this.

The event stream a client sees is the run's whole history without gaps or repeats: it subscribes on
the socket first (the worker greets it only once it is registered for broadcast), then reads
``events.jsonl``, then takes the live events, dropping any whose ``seq`` it has already seen. When
the worker goes away it tails the file and reconnects as soon as a worker listens again (a resume
starts a new worker process on the same run directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import RunDir
from studio.worker.launch import GpuLock, WorkerStartError

_RECONNECT_EVERY_S = 1.0

class WorkerUnavailable(ConnectionError):
    """No worker answers for this run (not running, still starting, or the key does not match)."""


class WorkerRefused(WorkerUnavailable):
    """The worker refused this client's key."""


class DeviceBusy(WorkerStartError):
    """The device's lock is held by a worker that is working (or that this user cannot reach)."""


def claim_device(run: RunDir | None = None, timeout: float = 30.0, key: str | None = None) -> None:
    """Make the device (``key``, a device lock name; default this process's first) free for a new
    worker of ``run``.

    A worker that only idles there (its run finished, stopped or failed; kept up for chat) is asked
    to shut down, and this waits until its lock is released. Returns at once when the device is free
    or when its holder serves ``run`` itself (connect to that one). Raises DeviceBusy, naming the
    holder and how to stop it, when the holder is loading, training, paused, exporting or scoring.
    """
    lock = GpuLock(key)
    if not lock.busy():
        return
    held = lock.holder()
    held_dir = Path(str(held.get("run_dir") or ""))
    if run is not None and held_dir == run.path.resolve():
        return
    if held.get("run_dir") and held_dir.is_dir():
        client = WorkerClient(RunDir(held_dir))
        try:
            if not client.connect(5.0).state.busy:
                client.send(ev.Shutdown())
                deadline = time.monotonic() + timeout
                while lock.busy() and time.monotonic() < deadline:
                    client.poll(0.2)
        except WorkerUnavailable:
            # Exiting (its socket already gone), still starting, or another user's: an exiting
            # one lets go in a moment; otherwise the message says whose it is.
            deadline = time.monotonic() + 3.0
            while lock.busy() and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            client.close()
    if lock.busy():
        raise DeviceBusy(lock.holder_message())


def connect_or_start(run: RunDir, timeout: float = 30.0) -> WorkerClient:
    """A client connected to ``run``'s worker, starting one when none runs.

    The one start-or-connect of every front end: a live worker of the run is reused; otherwise the
    device is claimed (an idle worker of another run is shut down, a busy one refuses with
    DeviceBusy) and a new worker started. Raises WorkerStartError or WorkerUnavailable.
    """
    client = WorkerClient(run)
    if run.worker_pid() is not None:
        try:
            client.connect(5.0)
            return client
        except WorkerRefused:
            raise
        except WorkerUnavailable:
            pass  # a worker killed a moment ago (its pid file lingers): start a new one
    claim_device(timeout=timeout)  # this run's own worker, if it holds the device, is exiting
    start_worker(run, timeout=timeout)
    client.connect(timeout)
    return client


def start_worker(run: RunDir, train: bool = False, resume: bool = False, timeout: float = 60.0) -> int:
    """Start the run's background worker (detached; it outlives this process) and return its pid.

    Returns once the worker listens on its socket. ``train`` starts training at once, ``resume``
    continues from the latest checkpoint. Raises WorkerStartError with the worker's reason.
    """
    from studio.core.config import ConfigError
    from studio.core.memory.multigpu import requested_gpus

    try:
        if requested_gpus(run.config()) > 1:
            timeout = max(timeout, 150.0)  # torchrun's ranks import torch and form their group first
    except (ConfigError, OSError):
        pass  # the worker itself says what is wrong with the config
    command = [sys.executable, "-m", "studio.worker", str(run.path.resolve())]
    if resume:
        command.append("--resume")
    elif train:
        command.append("--train")
    env = dict(os.environ)
    # The worker must import this same studio package, whether installed or run from a checkout.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise WorkerStartError(f"the worker for run {run.id} did not start within {timeout:g} s; "
                               f"see {run.log_path}") from None
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise WorkerStartError(reason[-1] if reason else f"the worker failed; see {run.log_path}")
    words = done.stdout.split()
    return int(words[2]) if len(words) > 2 and words[2].isdigit() else run.worker_pid() or 0


class WorkerClient:
    """One client of one run's worker. Use from one thread, except :meth:`send` and :meth:`close`,
    which any thread may call."""

    def __init__(self, run: RunDir, after_seq: int = -1):
        """``after_seq``: events numbered up to it are skipped (a console that shows only what
        happens from now on); -1 sees the run's whole history."""
        self.run = run
        self.status: ev.StatusReported | None = None
        """The worker's state as of the greeting or the latest StatusReported."""
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._last_seq = after_seq
        self._offset = 0
        self._pending: deque[ev.Event] = deque()
        self._next_attempt = 0.0
        self._closed = threading.Event()
        self._resync = False

    # ---------------------------------------------------------------------------- connection

    @property
    def connected(self) -> bool:
        """Whether a worker connection is open now."""
        return self._conn is not None

    def connect(self, timeout: float = 5.0) -> ev.StatusReported:
        """Connect and wait for the worker's greeting; retried for ``timeout`` seconds while the
        worker starts. Raises WorkerUnavailable."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._connect_once(max(0.5, deadline - time.monotonic()))
            except WorkerRefused:
                raise
            except WorkerUnavailable:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    def _connect_once(self, greeting_timeout: float) -> ev.StatusReported:
        try:
            key = self.run.key_path.read_bytes()
        except FileNotFoundError:
            raise WorkerUnavailable(f"run {self.run.id}: no worker is running") from None
        try:
            conn = Client(self.run.socket_address(), family="AF_UNIX", authkey=key)
        except AuthenticationError:
            raise WorkerRefused(f"run {self.run.id}: the worker refused the key in "
                                    f"{self.run.key_path}") from None
        except (OSError, EOFError):
            # EOFError: a dying worker's socket took the connection and closed it mid-handshake
            raise WorkerUnavailable(f"run {self.run.id}: no worker is running") from None
        try:
            if not conn.poll(greeting_timeout):
                raise WorkerUnavailable(f"run {self.run.id}: the worker did not answer")
            greeting = ev.from_json(conn.recv_bytes().decode())
        except (EOFError, OSError, ValueError):
            conn.close()
            raise WorkerUnavailable(f"run {self.run.id}: the worker hung up") from None
        except WorkerUnavailable:
            conn.close()
            raise
        if not isinstance(greeting, ev.StatusReported):
            conn.close()
            raise WorkerUnavailable(f"run {self.run.id}: unexpected greeting {type(greeting).__name__}")
        self._conn, self.status = conn, greeting
        return greeting

    def send(self, command: ev.Command) -> None:
        """Send one command. Raises WorkerUnavailable when no worker is connected.

        A client that only sends and never reads events is dropped by the worker once it is far
        behind; its next send then reconnects once and sends again.
        """
        if self._conn is None:
            raise WorkerUnavailable(f"run {self.run.id}: not connected to a worker")
        data = ev.to_json(command).encode()
        with self._send_lock:
            for attempt in (1, 2):
                conn = self._conn
                try:
                    if conn is None:
                        self._connect_once(5.0)
                        self._resync = True  # events logged meanwhile come from the file
                        conn = self._conn
                    assert conn is not None
                    conn.send_bytes(data)
                    return
                except OSError:
                    self._drop()
                    if attempt == 2:
                        raise WorkerUnavailable(f"run {self.run.id}: the worker hung up") from None

    def close(self) -> None:
        """Disconnect (the worker goes on) and end :meth:`events`."""
        self._closed.set()
        self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._next_attempt = time.monotonic() + _RECONNECT_EVERY_S
        if conn is not None:
            conn.close()

    # ------------------------------------------------------------------------------ events

    def catch_up(self, connect_timeout: float = 1.0) -> list[ev.Event]:
        """Subscribe (if a worker runs), then return every logged event not yet seen."""
        if self._conn is None and self.run.worker_pid() is not None:
            try:
                self.connect(connect_timeout)
            except WorkerUnavailable:
                pass
        return self._read_file()

    def poll(self, timeout: float = 0.5) -> list[ev.Event]:
        """New events (live, or from the log while no worker is connected); waits up to
        ``timeout`` seconds for the first one. Reconnects when a worker listens again."""
        found: list[ev.Event] = []
        if self._conn is None and time.monotonic() >= self._next_attempt and not self._closed.is_set():
            self._next_attempt = time.monotonic() + _RECONNECT_EVERY_S
            try:
                self._connect_once(1.0)
                found = self._read_file()  # what was logged while we were away
            except WorkerUnavailable:
                pass
        if self._conn is None:
            found = self._read_file()
            if not found:
                self._closed.wait(timeout)
                found = self._read_file()
            return found
        if self._resync:
            self._resync = False
            found += self._read_file()
        found += [e for e in (self._accept(p) for p in self._drain_pending()) if e is not None]
        try:
            wait = 0.0 if found else timeout
            while self._conn is not None and self._conn.poll(wait):
                wait = 0.0
                event = self._accept(ev.from_json(self._conn.recv_bytes().decode()))
                if event is not None:
                    found.append(event)
        except (EOFError, OSError):
            # The worker went away: whatever it logged after our last live event is in the file.
            self._drop()
            found.extend(self._read_file())
        return found

    def events(self, follow: bool = True, poll_s: float = 0.5) -> Iterator[ev.Event]:
        """Every event of the run from the first, then (``follow``) new ones until :meth:`close`."""
        yield from self.catch_up()
        while follow and not self._closed.is_set():
            yield from self.poll(poll_s)

    def request_status(self, timeout: float = 10.0) -> ev.StatusReported:
        """Ask the worker what it is doing; events that arrive meanwhile are kept for :meth:`poll`."""
        self.send(ev.Status())
        deadline = time.monotonic() + timeout
        conn = self._conn
        while conn is not None and conn.poll(max(0.0, deadline - time.monotonic())):
            try:
                message = ev.from_json(conn.recv_bytes().decode())
            except (EOFError, OSError):
                self._drop()
                break
            if isinstance(message, ev.StatusReported) and message.seq < 0:
                self.status = message
                return message
            if isinstance(message, ev.Event):
                self._pending.append(message)
        raise WorkerUnavailable(f"run {self.run.id}: the worker did not report its status")

    def _drain_pending(self) -> list[ev.Event]:
        items = list(self._pending)
        self._pending.clear()
        return items

    def _accept(self, message: ev.Message) -> ev.Event | None:
        """The event if it is new; replies (seq -1) always pass."""
        if not isinstance(message, ev.Event):
            return None
        if message.seq < 0:
            if isinstance(message, ev.StatusReported):
                self.status = message
            return message
        if message.seq <= self._last_seq:
            return None
        self._last_seq = message.seq
        return message

    def _read_file(self) -> list[ev.Event]:
        """Complete lines appended to events.jsonl since the last read, as new events."""
        try:
            with open(self.run.events_path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        found = []
        for line in data[:end].splitlines():
            try:
                event = self._accept(ev.from_json(line.decode()))
            except (ValueError, TypeError, UnicodeDecodeError):
                continue
            if event is not None:
                found.append(event)
        return found
