"""Exact resume: a run killed with SIGKILL and resumed gives the uninterrupted run's losses."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from helpers.cli import start_studio

from studio.cli import main as studio_main
from studio.core import events as ev
from studio.core.runs import RunDir, create_run, iter_events
from studio.engine.session import Session
from studio.engine.train import Trainer


def _losses_after_last_start(run: RunDir) -> dict[int, float]:
    """Loss by step logged by the latest (resumed) session of the run."""
    events = list(iter_events(run.events_path))
    last_start = max(i for i, e in enumerate(events) if isinstance(e, ev.RunStarted))
    return {e.step: e.loss for e in events[last_start:] if isinstance(e, ev.StepLogged)}


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tiny_config, tmp_path: Path, studio_env) -> None:
    # Dropout on: the resumed run must restore the RNG too, not only weights and optimizer.
    tiny_config.lora.dropout = 0.1
    tiny_config.trainer.max_steps = 30
    tiny_config.trainer.checkpoint_interval = 4
    tiny_config.trainer.keep_checkpoints = 2
    tiny_config.trainer.eval_interval = 8
    tiny_config.trainer.micro_batch_size = 4  # two micro-batches a step: accumulation is resumed too

    events: list[ev.Event] = []
    Trainer(Session(tiny_config, create_run(tiny_config, tmp_path / "reference"), events.append)).train()
    expected = {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}

    runs = tmp_path / "runs"
    tiny_config.output_dir = str(runs)
    config_path = tmp_path / "config.yaml"
    tiny_config.save(config_path)
    proc = start_studio("train", str(config_path), env=studio_env)
    run = None
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            found = [p for p in runs.glob("*") if p.is_dir()] if runs.exists() else []
            if found:
                run = RunDir(found[0])
                saved = [e for e in iter_events(run.events_path) if isinstance(e, ev.CheckpointSaved)]
                if saved and saved[0].step >= 4:
                    break
            if proc.poll() is not None:
                pytest.fail(f"training ended before it could be killed:\n{proc.stdout.read()}")
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint within the time limit")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert run is not None
    killed_at = run.latest_checkpoint()
    assert killed_at is not None
    resumed_from = int(killed_at.name.split("-")[1])
    assert resumed_from < 30, "the kill came after the end; make the run longer"

    code = studio_main(["train", "--resume", str(run.path)])
    assert code == 0
    events = list(iter_events(run.events_path))
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "seq keeps increasing across the resume"
    started = [e for e in events if isinstance(e, ev.RunStarted)]
    assert started[-1].resumed_from_step == resumed_from
    got = _losses_after_last_start(run)
    assert sorted(got) == list(range(resumed_from + 1, 31))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), f"step {step}"
    finished = [e for e in events if isinstance(e, ev.TrainingFinished)]
    assert finished and finished[-1].step == 30 and not finished[-1].stopped

