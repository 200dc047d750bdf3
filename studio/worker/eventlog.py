"""``events.jsonl``, as the worker writes it: numbered, one whole line an event, never a torn one.

The log is the run's truth, so a write that fails (a full disk) must not leave half a line for the
next writer to continue: the file is cut back to the end of the last whole event, which needs no
free space, and :class:`~studio.core.runs.storage.DiskFull` says where. A torn last line left by a kill
is cut before the first append, so every writer starts on a line of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import drop_torn_tail, iter_events
from studio.core.runs.storage import FILE_MODE, DiskFull, is_disk_full


class EventLog:
    """``events.jsonl``: numbers events and appends them, continuing after the last seq on disk."""

    def __init__(self, path: Path, run_id: str | None = None):
        self.path = path
        self.run_id = run_id
        drop_torn_tail(path)
        last = -1
        for event in iter_events(path):
            last = max(last, event.seq)
        self.next_seq = last + 1
        # Open for the worker's whole life; unbuffered, so a failed write leaves nothing queued
        # that a later flush would add after the cut.
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        self._size = os.fstat(self._fd).st_size

    def append(self, event: ev.Event) -> tuple[ev.Event, bytes]:
        """Number ``event``, write it, and return it with its JSON line (no newline). Raises
        DiskFull (the log cut back to its last whole line) when there is no room for it."""
        numbered = ev.with_seq(event, self.next_seq)
        line = ev.to_json(numbered).encode()
        data = memoryview(line + b"\n")
        try:
            while data:
                written = os.write(self._fd, data)
                data = data[written:]
        except OSError as exc:
            self._cut_back()
            if is_disk_full(exc, self.path):
                raise DiskFull(self.path, self.run_id) from exc
            raise
        self._size += len(line) + 1
        self.next_seq += 1
        return numbered, line

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            pass  # the reader skips a last line with no newline, and the next start cuts it

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
