"""Shared fixtures: the tiny model (built once per test session), the reverse-word data, a config.

The whole session uses a temporary ``STUDIO_CACHE`` so that tests never read or write the user's
cache; set ``STUDIO_TEST_CACHE=DIR`` to keep the built tiny model between sessions while developing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import REPO
from helpers.engine import tiny_run_config

from studio.core.config import RunConfig

# Folders this process made for itself, removed when it ends (a cache holds a converted 0.5 GB
# model; left behind, every run of the suite would cost the disk that much again).
_MADE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    cache = os.environ.get("STUDIO_TEST_CACHE")
    if not cache:
        cache = tempfile.mkdtemp(prefix="studio-test-cache-")
        _MADE.append(cache)
    os.environ["STUDIO_CACHE"] = cache
    # Device locks live in the cache unless told otherwise; a cache shared between pytest-xdist
    # workers (STUDIO_TEST_CACHE) must not make them one machine's workers queueing for one GPU.
    # Each process its own folder: xdist workers inherit the controller's environment, so a folder
    # the controller made is replaced in every worker (one the caller set is kept).
    if "STUDIO_LOCK_DIR" not in os.environ or (os.environ.get("STUDIO_TEST_LOCKS_MADE")
                                               and os.environ.get("PYTEST_XDIST_WORKER")):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.environ["STUDIO_LOCK_DIR"] = tempfile.mkdtemp(prefix=f"studio-test-locks-{worker}-")
        os.environ["STUDIO_TEST_LOCKS_MADE"] = "1"
        _MADE.append(os.environ["STUDIO_LOCK_DIR"])
    # The tiny model's matmuls are too small to gain from threads, and on a busy machine spinning
    # OpenMP threads cost several times the work; one thread also keeps the parent process and the
    # `studio` subprocesses numerically identical (resume tests compare their losses).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _MADE:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``STUDIO_TEST_FAILURE_LOG=FILE``, each failure's report is appended to FILE as it happens
    (a run cut off by a time limit, as on the GPU box's lent machine, still says what failed)."""
    path = os.environ.get("STUDIO_TEST_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"==== {report.nodeid} ({report.when}, {os.environ.get('PYTEST_XDIST_WORKER', '')})\n")
            handle.write(str(report.longrepr)[-3000:] + "\n")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Folder of the tiny Llama model + tokenizer (random weights; built once per session)."""
    from studio.engine.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def reverse_rows() -> list[dict]:
    """The reverse-word rows (instruction / input / output / split 0,1,2) in ``reverse_data``."""
    from studio.engine.tiny import reverse_word_rows

    # Words of 3-4 letters: 300 steps take the tiny model's exact match from 0 to about 45%.
    return reverse_word_rows(3000, seed=0, max_len=4, val_fraction=40 / 3000, test_fraction=40 / 3000)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory: pytest.TempPathFactory, reverse_rows: list[dict]) -> Path:
    """A JSONL file of reverse-word rows: 2920 train, 40 validation, 40 test (split column)."""
    path = tmp_path_factory.mktemp("data") / "reverse.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for row in reverse_rows:
            handle.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="session")
def make_tiny_config(tiny_model: Path, reverse_data: Path) -> Callable[[Path], RunConfig]:
    """``make(out_dir)``: a fresh :func:`tiny_config`-style config whose runs go under ``out_dir``
    (for module-scoped fixtures, which cannot use ``tmp_path``)."""
    return lambda out_dir: tiny_run_config(tiny_model, reverse_data, out_dir)


@pytest.fixture
def tiny_config(tiny_model: Path, reverse_data: Path, tmp_path: Path) -> RunConfig:
    """A config that trains the tiny model on the reverse-word data on CPU in a few seconds.

    No quantization (fp32), LoRA r16 on every linear layer, lr 6e-3, 20 steps of 8 rows, evaluation
    and a checkpoint every 10 steps, runs under ``tmp_path/runs``. Tests change what they need.
    """
    return tiny_run_config(tiny_model, reverse_data, tmp_path / "runs")


@pytest.fixture(scope="session")
def studio_env() -> dict[str, str]:
    """Environment for a ``python -m studio.cli`` subprocess: this checkout importable, same cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def python() -> str:
    """The interpreter running the tests (for subprocesses)."""
    return sys.executable


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin the engine to the CPU on every machine (``STUDIO_DEVICE=cpu``, inherited by the workers and
    torchrun's processes a test starts). For tests whose thresholds were calibrated on the tiny model
    in fp32: how far it learns in N steps, equal losses however a step is split. On a GPU the engine
    trains it in bf16, where those numbers move; the GPU's own behaviour is what the fast-path,
    memory and benchmark tests check."""
    monkeypatch.setenv("STUDIO_DEVICE", "cpu")


@pytest.fixture
def kernel_device(monkeypatch):
    """Where Studio's own Triton kernels run in a test: CUDA where there is one (compiled), else the
    CPU under Triton's interpreter (engine/fast/update.py, norm.py)."""
    import torch

    if torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device("cpu")
