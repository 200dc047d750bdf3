"""A real full disk at a chosen step, for the disk-full tests (tests/e2e/test_disk_full.py).

The tests mount a small tmpfs for the runs; :func:`fill` writes a filler file on it until the
kernel says ENOSPC (then frees ``leave`` bytes of it). A worker subprocess fills its disk after
optimizer step ``N`` when ``$STUDIO_WORKER_TRAINER`` is ``disk_fill:DiskFillingSession`` (the
engine's Session) or ``disk_fill:DiskFillingFake`` (the torch-free FakeTrainer), with
``$STUDIO_FILL_DISK=FILLER_PATH:N[:LEAVE]`` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.worker_fakes import FakeTrainer

FILL_ENV = "STUDIO_FILL_DISK"


def fill(filler: Path, leave: int = 0) -> int:
    """Write ``filler`` until its filesystem is full, then give back ``leave`` bytes of it; returns
    the filler's size."""
    chunk = b"\0" * (1 << 16)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
        size = os.fstat(fd).st_size
        if leave:
            size = max(0, size - leave)
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return size


def _filling(between_steps: Callable[[Any], str | None] | None) -> Callable[[Any], str | None]:
    """``between_steps`` that first fills the disk after the step named by $STUDIO_FILL_DISK."""
    filler, at, leave = (os.environ[FILL_ENV].split(":") + ["0"])[:3]
    done = False

    def hook(trainer: Any) -> str | None:
        nonlocal done
        if not done and trainer.step >= int(at):
            done = True
            fill(Path(filler), int(leave))
        return between_steps(trainer) if between_steps is not None else None

    return hook


class DiskFillingFake(FakeTrainer):
    """The FakeTrainer, whose disk fills after the step $STUDIO_FILL_DISK names."""

    def __init__(self, config: Any, run: Any, emit: Any, between_steps: Any = None):
        super().__init__(config, run, emit, _filling(between_steps))


def _session_class() -> type:
    from studio.engine.session import Session

    class DiskFillingSession(Session):
        """The engine's Session, whose disk fills after the step $STUDIO_FILL_DISK names."""

        def __init__(self, config: Any, run: Any, emit: Any, between_steps: Any = None, **kwargs: Any):
            super().__init__(config, run, emit, _filling(between_steps), **kwargs)

    return DiskFillingSession


def __getattr__(name: str) -> type:
    # Built on first use, so the torch-free fake's users never import the engine.
    if name == "DiskFillingSession":
        return _session_class()
    raise AttributeError(name)
