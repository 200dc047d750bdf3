"""The run picker and run comparison, from the training pane's keys."""

from __future__ import annotations

import shutil

import pytest
from helpers import DATA
from helpers.ui import PlayedWorker, panes_mounted

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run, iter_events
from studio.ui.app import StudioApp
from studio.ui.panes.training import TrainingPane
from studio.ui.widgets.loss_plot import LossPlot
from studio.ui.widgets.run_picker import CompareScreen, RunPickerScreen
from studio.worker.eventlog import EventLog

pytestmark = pytest.mark.anyio
RECORDED = DATA / "recorded_events.jsonl"
RECORDED_STEPS = sum(isinstance(e, ev.StepLogged) for e in iter_events(RECORDED))
RECORDED_EVALS = sum(isinstance(e, ev.EvalLogged) for e in iter_events(RECORDED))


def two_runs(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    finished = create_run(config)
    shutil.copy(RECORDED, finished.events_path)
    config.name = "short"
    short = create_run(config)
    log = EventLog(short.events_path)
    log.append(ev.RunStarted(total_steps=10))
    for step in range(1, 4):
        log.append(ev.StepLogged(step=step, total_steps=10, loss=5.0 - step))
    log.append(ev.TrainingFinished(step=3, stopped=True))
    log.close()
    return config, finished, short


def studio(config: RunConfig) -> tuple[StudioApp, PlayedWorker]:
    """The real app on the training pane (no run yet), its worker played by the test."""
    app = StudioApp(config, settings=False, initial_pane="training")
    return app, PlayedWorker(app)


async def wait_for_rows(pilot, table, rows: int) -> None:
    for _ in range(60):
        await pilot.pause(0.05)
        if table.row_count == rows:
            return


async def test_picker_lists_runs_and_opens_one(tmp_path):
    config, finished, short = two_runs(tmp_path)
    app, worker = studio(config)
    async with app.run_test(size=(120, 34)) as pilot:
        await panes_mounted(pilot)
        app.query_one(TrainingPane).focus()
        await pilot.press("o")
        assert isinstance(app.screen, RunPickerScreen)
        table = app.screen.query_one("#runs-table")
        await wait_for_rows(pilot, table, 2)
        cells = {table.get_row_at(i)[1]: table.get_row_at(i) for i in range(2)}
        assert cells[finished.id][2] == "finished" and cells[finished.id][4] == f"{RECORDED_STEPS}/{RECORDED_STEPS}"
        assert cells[finished.id][5] != "--"  # best eval loss
        assert cells[short.id][2] == "stopped" and cells[short.id][5] == "--"
        table.move_cursor(row=[r[1] for r in map(table.get_row_at, range(2))].index(finished.id))
        await pilot.press("enter")
        await pilot.pause()
        assert worker.opened == [(finished, False)] and app.current_run == finished


async def test_compare_two_runs_on_one_plot(tmp_path):
    config, finished, short = two_runs(tmp_path)
    app, _ = studio(config)
    async with app.run_test(size=(120, 34)) as pilot:
        await panes_mounted(pilot)
        app.query_one(TrainingPane).focus()
        await pilot.press("o")
        table = app.screen.query_one("#runs-table")
        await wait_for_rows(pilot, table, 2)
        await pilot.press("c")  # nothing marked yet: a hint, no comparison
        assert isinstance(app.screen, RunPickerScreen)
        await pilot.press("space", "down", "space")
        assert "*" in str(table.get_row_at(0)[0]) and "*" in str(table.get_row_at(1)[0])
        await pilot.press("c")
        await pilot.pause(0.3)
        assert isinstance(app.screen, CompareScreen)
        plot = app.screen.query_one(LossPlot)
        for _ in range(40):
            await pilot.pause(0.05)
            if plot.points_drawn:
                break
        # both runs' smoothed losses, and the recorded run's evals
        assert plot.points_drawn == RECORDED_STEPS + RECORDED_EVALS + 3
        summary = str(app.screen.query_one("#compare-summary").render())
        assert finished.id in summary and short.id in summary and "best eval" in summary
        await pilot.press("escape")
        assert not isinstance(app.screen, CompareScreen)


async def test_no_runs_says_how_to_make_one(tmp_path):
    app, _ = studio(RunConfig(output_dir=str(tmp_path / "none")))
    async with app.run_test(size=(120, 34)) as pilot:
        await panes_mounted(pilot)
        app.query_one(TrainingPane).focus()
        await pilot.press("o")
        await pilot.pause(0.3)
        assert "No runs" in str(app.screen.query_one("#runs-hint").render())


@pytest.mark.parametrize("key", ["o", "ctrl+r"])
async def test_the_picker_opens_a_run_the_same_way_from_every_key(tmp_path, key):
    """The training pane's o and the app's ctrl+r are one picker: Enter follows the run (its plots
    redrawn from its log) and leaves the config being edited, and where Save writes, as they were."""
    config, finished, short = two_runs(tmp_path)
    config.name, config.trainer.learning_rate = "being edited", 3e-5
    app, worker = studio(config)
    async with app.run_test(size=(120, 34)) as pilot:
        await panes_mounted(pilot)
        app.query_one(TrainingPane).focus()
        await pilot.press(key)
        table = app.screen.query_one("#runs-table")
        await wait_for_rows(pilot, table, 2)
        table.move_cursor(row=[table.get_row_at(i)[1] for i in range(2)].index(finished.id))
        await pilot.press("enter")
        await pilot.pause()
        assert worker.opened == [(finished, False)] and app.current_run == finished
        assert app.config is config and app.config.name == "being edited" and app.config_path is None
        pane = app.query_one(TrainingPane)
        for _ in range(100):
            if pane.state.step == RECORDED_STEPS:
                break
            await pilot.pause(0.05)
        assert pane.state.loss.steps[0] == 1 and pane.state.step == RECORDED_STEPS


async def test_reopening_studio_follows_the_latest_run_in_training_and_chat(tmp_path):
    """`studio` again after quitting: the newest run of the runs folder is back in the training pane
    (its curves redrawn from events.jsonl) and the chat pane, not "no run yet"."""
    from helpers.ui import fixed_run

    from studio.ui.panes.chat import ChatPane

    config = RunConfig(output_dir=str(tmp_path / "runs"))
    fixed_run(tmp_path / "runs", "20260101-090000-older", config)
    latest = fixed_run(tmp_path / "runs", "20260102-090000-latest", config)
    shutil.copy(RECORDED, latest.events_path)
    app = StudioApp(config, settings=False, initial_pane="training", follow_latest=True)
    worker = PlayedWorker(app)
    async with app.run_test(size=(120, 34)) as pilot:
        await panes_mounted(pilot)
        pane = app.query_one(TrainingPane)
        for _ in range(200):
            if pane.state.step == RECORDED_STEPS and pane.redraws and app.current_run == latest:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        assert app.current_run == latest and worker.opened == [(latest, False)]  # no worker started
        status = str(app.query_one("#training-status").render())
        assert "no run yet" not in status and "finished" in status
        assert pane.state.loss.steps[0] == 1 and len(pane.state.loss.steps) == RECORDED_STEPS
        assert app.query_one(LossPlot).points_drawn > 0
        assert latest.id in str(app.query_one(ChatPane).query_one("#chat-status").render())
        assert latest.id in app.sub_title
