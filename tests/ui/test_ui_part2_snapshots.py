"""Snapshots of the training and chat panes (and run comparison) in the real app, in Studio's dark and
light themes, at the smallest supported terminal (100x30) and a large one (160x50).

The training plots come from tests/data/recorded_events.jsonl, so they are the same on every run.
Update after an intended change with: pytest tests/ui/test_ui_part2_snapshots.py --snapshot-update
"""

from __future__ import annotations

import shutil
import time

import pytest
from helpers import DATA
from helpers.ui import PlayedWorker, events_drawn, fixed_run, panes_mounted
from plotext._dict import themes as plotext_themes
from textual.color import Color
from textual.widgets import Input

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, iter_events
from studio.ui.app import StudioApp
from studio.ui.panes.chat import ChatPane
from studio.ui.widgets.loss_plot import BackgroundPlot, LossPlot
from studio.ui.widgets.run_picker import CompareScreen
from studio.worker.eventlog import EventLog

RECORDED_PATH = DATA / "recorded_events.jsonl"
RECORDED = list(iter_events(RECORDED_PATH))
SIZE = (100, 30)
SIZES = [SIZE, (160, 50)]
THEMES = ["studio-dark", "studio-light"]
SIZE_IDS = [f"{w}x{h}" for w, h in SIZES]


def studio(config: RunConfig, theme: str, pane: str = "training", run: RunDir | None = None) -> StudioApp:
    """The real app showing ``pane`` in ``theme`` (the run's events are read from its log)."""
    app = StudioApp(config, run=run, settings=False, initial_pane=pane)
    app.theme = theme
    return app


async def settle(pilot) -> None:
    """Every pane mounted and the run's events drawn; cursor blink and toasts off; then wait until
    every plot shows its newest figure at its size and theme. Frames are built at most once a
    second, and later than that on a loaded machine, so a fixed pause is not enough."""
    await panes_mounted(pilot)
    await events_drawn(pilot)
    pilot.app.clear_notifications()
    for widget in pilot.app.query(Input):
        widget.cursor_blink = False
    await pilot.pause(0.5)
    deadline = time.monotonic() + 30
    steady = 0
    while steady < 3:  # a few quiet checks in a row: no redraw is still on its way
        assert time.monotonic() < deadline, "the plots never settled"
        plots = [p for p in pilot.app.query(BackgroundPlot) if p.size.area]  # hidden ones wait to be shown
        drawn = all(p._frame is not None and p._frame[0] == p._key() and not p._build_scheduled for p in plots)
        # (the app's event follower runs for as long as a run is open)
        busy = any(worker.is_running and worker.group != "events" for worker in pilot.app.workers)
        steady = steady + 1 if drawn and not busy else 0
        await pilot.pause(0.1)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("theme", THEMES)
def test_training_pane(snap_compare, theme, size, tmp_path):
    config = RunConfig(output_dir=str(tmp_path))
    run = fixed_run(tmp_path, "demo-run", config)
    shutil.copy(RECORDED_PATH, run.events_path)
    app = studio(config, theme, run=run)

    async def run_before(pilot):
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.anyio
async def test_plot_takes_the_theme_colours_even_after_a_stale_registration(monkeypatch, tmp_path):
    """textual-plotext keeps one plotext theme per app theme name for the whole process, made from
    app.theme_variables, which lag a theme switch until the CSS refresh: a plot mounted in between (in
    test_ui_app's theme test) left the light theme registered with the dark colours, and every light
    plot after it was drawn on the dark background. A plot must register the colours of its theme."""
    dark_rgb = (26, 32, 41)  # a background that is not the light theme's
    stale = ((dark_rgb, dark_rgb, (221, 227, 234), "default", ()))
    monkeypatch.setitem(plotext_themes, "textual-auto-studio-light", stale)
    config = RunConfig(output_dir=str(tmp_path))
    run = fixed_run(tmp_path, "demo-run", config)
    shutil.copy(RECORDED_PATH, run.events_path)
    app = studio(config, "studio-light", run=run)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        surface = Color.parse(app.theme_variables["surface"]).rgb
        frame = app.query_one(LossPlot)._frame[1]
        backgrounds = {span.style.bgcolor.triplet for span in frame.spans
                       if not isinstance(span.style, str) and span.style.bgcolor is not None}
    assert tuple(surface) in {tuple(b) for b in backgrounds}
    assert dark_rgb not in {tuple(b) for b in backgrounds}


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("theme", THEMES)
def test_chat_pane(snap_compare, theme, size, tmp_path):
    config = RunConfig(output_dir=str(tmp_path))
    run = fixed_run(tmp_path, "demo-run", config)
    run.adapter_dir.mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")  # a saved adapter, as far as the pane looks
    app = studio(config, theme, pane="chat", run=run)
    worker = PlayedWorker(app)

    async def run_before(pilot):
        await panes_mounted(pilot)
        pane = app.query_one(ChatPane)
        pane.ask("Reverse the word: hello")
        base, tuned = worker.sent
        worker.feed([ev.TokenGenerated(request_id=base.request_id, text="hello hello "),
                     ev.TokenGenerated(request_id=tuned.request_id, text="olleh"),
                     ev.GenerationFinished(request_id=tuned.request_id, text="olleh", new_tokens=3,
                                           tokens_per_s=55.1),
                     ev.TokenGenerated(request_id=base.request_id, text="hello")])
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_compare_screen(snap_compare, tmp_path):
    config = RunConfig(output_dir=str(tmp_path))
    first = fixed_run(tmp_path, "run-a", config)
    shutil.copy(RECORDED_PATH, first.events_path)
    second = fixed_run(tmp_path, "run-b", config)
    log = EventLog(second.events_path)
    for step in range(1, 31):
        log.append(ev.StepLogged(step=step, total_steps=30, loss=4.0 / (1 + step / 5)))
    log.append(ev.EvalLogged(step=30, loss=1.1))
    log.close()
    app = studio(config, "studio-dark")

    async def run_before(pilot):
        await panes_mounted(pilot)  # the training pane has taken focus: its keys are in the footer
        app.push_screen(CompareScreen([first, second]))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
