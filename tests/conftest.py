"""Shared fixtures: the tiny model (built once per test session), the reverse-word data, a config.

The whole session uses a temporary ``STUDIO_CACHE`` so that tests never read or write the user's
cache; set ``STUDIO_TEST_CACHE=DIR`` to keep the built tiny model between sessions while developing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from studio.core.config import RunConfig

REPO = Path(__file__).resolve().parents[1]

TINY_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
"""A short template keeps the tiny model's sequences short (and the tests fast)."""


def pytest_configure(config: pytest.Config) -> None:
    cache = os.environ.get("STUDIO_TEST_CACHE") or tempfile.mkdtemp(prefix="studio-test-cache-")
    os.environ["STUDIO_CACHE"] = cache
    # Training tests compare losses and time steps: the default thread count of a shared 2-core
    # machine is fine, but a fixed one keeps runs comparable between the parent and subprocesses.
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Folder of the tiny Llama model + tokenizer (random weights; built once per session)."""
    from studio.engine.tiny import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def reverse_rows() -> list[dict]:
    """The reverse-word rows (instruction / input / output / split 0,1,2) in ``reverse_data``."""
    from studio.engine.tiny import reverse_word_rows

    return reverse_word_rows(3000, seed=0, val_fraction=40 / 3000, test_fraction=40 / 3000)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory: pytest.TempPathFactory, reverse_rows: list[dict]) -> Path:
    """A JSONL file of reverse-word rows: 2920 train, 40 validation, 40 test (split column)."""
    path = tmp_path_factory.mktemp("data") / "reverse.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for row in reverse_rows:
            handle.write(json.dumps(row) + "\n")
    return path


@pytest.fixture
def tiny_config(tiny_model: Path, reverse_data: Path, tmp_path: Path) -> RunConfig:
    """A config that trains the tiny model on the reverse-word data on CPU in a few seconds.

    No quantization (fp32), LoRA r16 on q_proj/v_proj, lr 1e-2, 20 steps of 8 rows, evaluation and
    a checkpoint every 10 steps, runs under ``tmp_path/runs``. Tests change what they need.
    """
    config = RunConfig()
    config.model.base_model = str(tiny_model)
    config.quantization.bits = None
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    config.lora.target_modules = ["q_proj", "v_proj"]
    config.prompt.template = TINY_TEMPLATE
    config.data.path = str(reverse_data)
    config.data.max_seq_length = 64
    t = config.trainer
    t.learning_rate = 1e-2
    t.max_steps = 20
    t.micro_batch_size = 8
    t.effective_batch_size = 8
    t.warmup_fraction = 0.05
    t.gradient_checkpointing = False
    t.packing = False
    t.eval_interval = 10
    t.eval_max_rows = 40
    t.checkpoint_interval = 10
    t.log_interval = 1
    config.generation.max_new_tokens = 16
    config.output_dir = str(tmp_path / "runs")
    return config


@pytest.fixture
def studio_env() -> dict[str, str]:
    """Environment for a ``python -m studio.cli`` subprocess: this checkout importable, same cache."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def python() -> str:
    """The interpreter running the tests (for subprocesses)."""
    return sys.executable
