"""One client connected to the worker: its commands read in one thread, its events sent from another.

The sender has its own outgoing queue, so a slow client never stalls training; one that falls
``CLIENT_BACKLOG`` events behind is dropped and catches up from the event log when it reconnects.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from studio.core import events as ev

CLIENT_BACKLOG = 20000  # events queued for one client before it is dropped as too slow
MAX_COMMAND_BYTES = 1 << 20  # a longer message is not read as a command


class Peer:
    """One connected client: a reader thread feeding the command queue and a sender thread."""

    def __init__(self, conn: Connection, commands: queue.Queue, on_close: Callable[[Peer], None]):
        self.conn = conn
        self.outbox: queue.Queue[bytes | None] = queue.Queue(maxsize=CLIENT_BACKLOG)
        self._commands = commands
        self._on_close = on_close
        self._closed = threading.Event()

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="worker-client-reader", daemon=True)
        self._sender = threading.Thread(target=self._send, name="worker-client-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    def finish(self, timeout: float) -> None:
        """Send what is queued, then hang up (waits at most ``timeout`` seconds)."""
        try:
            self.outbox.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._sender.join(timeout)
        self.close()

    def offer(self, line: bytes) -> None:
        """Queue ``line`` for this client; a client that stopped reading is disconnected."""
        try:
            self.outbox.put_nowait(line)
        except queue.Full:
            self.close()

    def reply(self, event: ev.Event) -> None:
        """Send an unlogged event (seq -1) to this client only."""
        self.offer(ev.to_json(ev.with_seq(event, -1)).encode())

    def _read(self) -> None:
        try:
            while True:
                data = self.conn.recv_bytes(MAX_COMMAND_BYTES)
                try:
                    command = ev.from_json(data.decode())
                    if not isinstance(command, ev.Command):
                        raise ValueError(f"{type(command).__name__} is an event, not a command")
                except (ValueError, TypeError, UnicodeDecodeError) as exc:
                    self.reply(ev.WorkerFailed(kind="config", fatal=False, request="message",
                                               message=f"ignored a message the worker cannot read: {exc}"))
                    continue
                self._commands.put((self, command))
        except (EOFError, OSError):
            pass
        finally:
            self.close()

    def _send(self) -> None:
        try:
            while (line := self.outbox.get()) is not None:
                self.conn.send_bytes(line)
        except OSError:
            pass
        finally:
            self.close()
            self._reader.join()
            self.conn.close()  # both threads are done with it now

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._on_close(self)
        try:
            self.outbox.put_nowait(None)
        except queue.Full:
            pass
        try:
            # shutdown (not close) wakes the reader blocked in recv in the other thread.
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
