"""Fixtures of the end-to-end tests: the `studio` command against workers that train with the FakeTrainer."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TESTS

from studio.core.runs import list_runs


@pytest.fixture
def fake_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A config for the FakeTrainer, a private GPU lock, and cleanup of leftover workers."""
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.worker_fakes:FakeTrainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "2")
    monkeypatch.setenv("FAKE_STEP_S", "0.03")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    config = tmp_path / "fake.yaml"
    config.write_text("model:\n  base_model: fake-model\ndata:\n  path: rows.jsonl\n")
    yield config
    for run in list_runs(tmp_path / "runs"):
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)
