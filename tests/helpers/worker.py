"""Runs and events in worker tests: a run for the FakeTrainer, waiting for an event from a worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, create_run
from studio.worker.client import WorkerClient


def make_run(root: Path, steps: int = 20, name: str = "fake") -> RunDir:
    config = RunConfig(name=name)
    config.model.base_model = "fake-model"
    config.trainer.max_steps = steps
    return create_run(config, root)


_unread: dict[int, list[ev.Event]] = {}


def wait_for(client: WorkerClient, done: Callable[[ev.Event], bool], timeout: float = 30.0,
             seen: list[ev.Event] | None = None) -> ev.Event:
    """The first event for which ``done`` holds; fails at timeout. With an empty ``seen`` list it
    starts from the beginning of the log and records every event it reads there. Events read past
    the match are kept for the next call."""
    deadline = time.monotonic() + timeout
    backlog = _unread.setdefault(id(client), [])
    if seen is not None and not seen:
        backlog[:0] = client.catch_up()
    while True:
        while backlog:
            event = backlog.pop(0)
            if seen is not None:
                seen.append(event)
            if done(event):
                return event
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for an event")
        backlog.extend(client.poll(0.2))
