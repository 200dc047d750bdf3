"""The engine in tests: the tiny model's run config, and the engine pinned to the CPU for a block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from studio.core.config import RunConfig
from studio.engine.tiny import TINY_TEMPLATE


def tiny_run_config(tiny_model: Path, reverse_data: Path, out_dir: Path) -> RunConfig:
    """The ``tiny_config`` fixture's config (tests/conftest.py), its runs under ``out_dir``."""
    config = RunConfig()
    config.model.base_model = str(tiny_model)
    config.quantization.bits = None
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    # q_proj/v_proj alone barely move this 2-layer model in 300 steps; every linear layer does.
    config.lora.target_modules = "all-linear"
    config.prompt.template = TINY_TEMPLATE  # what the tiny model was pre-trained with
    config.data.path = str(reverse_data)
    config.data.max_seq_length = 64
    t = config.trainer
    t.learning_rate = 6e-3
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
    config.output_dir = str(out_dir)
    return config


@contextlib.contextmanager
def engine_on_cpu() -> Iterator[None]:
    """:func:`on_cpu` for a block of code (module-scoped fixtures train before any function fixture)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUDIO_DEVICE", "cpu")
        yield
