"""Fixtures of the worker's tests: workers that train with the FakeTrainer (tests/helpers/worker_fakes.py)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TESTS

from studio.core.runs import RunDir


@pytest.fixture
def fake_worker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RunDir]]:
    """Workers started in this test use the FakeTrainer and a private GPU lock; any left running
    at the end are killed. Yields the list to which tests add the runs they start."""
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.worker_fakes:FakeTrainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "2")
    monkeypatch.setenv("FAKE_STEP_S", "0.03")
    started: list[RunDir] = []
    yield started
    for run in started:
        pid = run.worker_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)


