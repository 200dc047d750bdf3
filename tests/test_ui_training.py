"""The training pane: controls, batched redraws, failures in place, and (live) the real worker.

Most tests run the pane in a harness app and play the worker with events; the live test at the end
trains the tiny model through the real worker from the pane's keys.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from ui_part2_harness import PaneHarness

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run, iter_events
from studio.ui.panes.training import ConfirmScreen, TrainingPane
from studio.ui.widgets.loss_plot import LossPlot

pytestmark = pytest.mark.anyio
SIZE = (110, 34)
RECORDED = list(iter_events(Path(__file__).parent / "data" / "recorded_events.jsonl"))


def text_of(app, selector: str) -> str:
    return str(app.query_one(selector).render())


def harness(tmp_path, run=None) -> PaneHarness:
    return PaneHarness(TrainingPane, RunConfig(output_dir=str(tmp_path / "runs")), run=run)


async def test_recorded_history_is_drawn_in_full(tmp_path):
    app = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.feed(RECORDED)
        await pilot.pause(0.4)
        assert "step 40/40" in text_of(app, "#training-progress-line")
        assert "finished" in text_of(app, "#training-status")
        assert "perplexity" in text_of(app, "#training-eval") and "token accuracy" in text_of(app, "#training-eval")
        assert "memory (cpu)" in text_of(app, "#training-memory")
        assert app.query_one(LossPlot).points_drawn == 2 * 40 + 4  # raw + smoothed + 4 evals


async def test_a_flood_of_events_is_drawn_a_few_times_a_second(tmp_path):
    app = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.query_one(TrainingPane)
        await pilot.pause(0.3)
        before = pane.redraws
        started = time.monotonic()
        for event in RECORDED:  # one batch per event: the worst case
            app.feed([event])
            await pilot.pause(0.005)
        await pilot.pause(0.4)
        seconds = time.monotonic() - started
        assert pane.state.step == 40  # nothing lost...
        assert pane.redraws - before <= 4 * seconds + 2  # ...but at most ~4 redraws a second
        assert pane.redraws - before < len(RECORDED) / 3


async def test_start_creates_a_run_and_starts_its_worker(tmp_path):
    app = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("s")
        await pilot.pause()
        (run, start_worker), = app.opened
        assert start_worker and run.config_path.exists() and run.path.parent == tmp_path / "runs"
        assert isinstance(app.sent[-1], ev.StartTraining)
        await pilot.press("s")  # a second press while loading does nothing
        assert len(app.opened) == 1


async def test_pause_resume_and_stop_with_confirmation(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app = PaneHarness(TrainingPane, config, run=create_run(config))
    async with app.run_test(size=SIZE) as pilot:
        app.query_one(TrainingPane).focus()
        app.feed([ev.RunStarted(total_steps=10), ev.StepLogged(step=1, total_steps=10, loss=2.0)])
        await pilot.pause(0.3)
        await pilot.press("r")  # not paused: resume is not offered
        assert not app.sent
        await pilot.press("p")
        assert isinstance(app.sent[-1], ev.Pause)
        app.feed([ev.TrainingPaused(step=1)])
        await pilot.pause(0.3)
        assert "paused" in text_of(app, "#training-status")
        await pilot.press("r")
        assert isinstance(app.sent[-1], ev.Resume)
        app.feed([ev.TrainingResumed(step=1)])
        await pilot.pause(0.3)
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # changed my mind: nothing sent
        assert not isinstance(app.sent[-1], ev.Stop) and not isinstance(app.screen, ConfirmScreen)
        await pilot.press("x")
        await pilot.press("y")
        assert isinstance(app.sent[-1], ev.Stop)


async def test_failures_are_shown_in_place_and_the_ui_stays(tmp_path):
    app = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.feed([ev.RunStarted(total_steps=10, micro_batch_size=8, gradient_accumulation_steps=2),
                  ev.BatchSizeReduced(step=2, old_micro_batch_size=8, micro_batch_size=4,
                                      gradient_accumulation_steps=4)])
        await pilot.pause(0.3)
        assert "out of memory; micro-batch 8 -> 4" in text_of(app, "#training-alert")
        assert "micro-batch 4 × 4" in text_of(app, "#training-status")
        app.feed([ev.WorkerFailed(kind="data", message="train.jsonl line 12: 'output' is empty; fill it or "
                                  "drop the row")])
        await pilot.pause(0.3)
        assert "Data error: train.jsonl line 12" in text_of(app, "#training-alert")
        assert app.query_one("#training-alert").has_class("failed")
        assert app.is_running


async def test_export_copies_the_adapter(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    run = create_run(config)
    run.adapter_dir.mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    app = PaneHarness(TrainingPane, config, run=run)
    async with app.run_test(size=SIZE) as pilot:
        app.feed([ev.TrainingFinished(step=5, adapter_path=str(run.adapter_dir))])
        await pilot.pause(0.3)
        await pilot.press("e")
        dest = tmp_path / "out"
        app.screen.query_one("#export-path").value = str(dest)
        await pilot.click("#export-adapter")
        for _ in range(40):
            await pilot.pause(0.05)
            if (dest / "adapter_config.json").exists():
                break
        assert (dest / "adapter_config.json").exists()
        await pilot.pause(0.3)
        assert f"adapter saved to {dest}" in text_of(app, "#training-alert")
        await pilot.press("e")
        app.screen.query_one("#export-path").value = str(tmp_path / "merged")
        await pilot.click("#export-merged")
        await pilot.pause()
        assert app.sent[-1] == ev.ExportMerged(path=str(tmp_path / "merged"))
