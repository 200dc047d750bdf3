"""Snapshots of the training and chat panes (and run comparison) in Studio's dark and light themes, at
the smallest supported terminal (100x30) and a large one (160x50).

The training plots come from tests/data/recorded_events.jsonl, so they are the same on every run.
Update after an intended change with: pytest tests/test_ui_part2_snapshots.py --snapshot-update
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from plotext._dict import themes as plotext_themes
from textual.color import Color
from textual.widgets import Input
from ui_part2_harness import PaneHarness

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, append_event, iter_events
from studio.ui.panes.chat import ChatPane
from studio.ui.panes.training import TrainingPane
from studio.ui.theme import bundled_themes
from studio.ui.widgets.loss_plot import BackgroundPlot, LossPlot
from studio.ui.widgets.run_picker import CompareScreen

RECORDED_PATH = Path(__file__).parent / "data" / "recorded_events.jsonl"
RECORDED = list(iter_events(RECORDED_PATH))
SIZE = (100, 30)
SIZES = [SIZE, (160, 50)]
THEMES = ["studio-dark", "studio-light"]
SIZE_IDS = [f"{w}x{h}" for w, h in SIZES]


def themed(app: PaneHarness, theme: str) -> PaneHarness:
    for t in bundled_themes():
        app.register_theme(t)
    app.theme = theme
    return app


def fixed_run(root: Path, name: str, config: RunConfig) -> RunDir:
    """A run with a fixed id (create_run stamps the time, which would change every snapshot)."""
    run = RunDir(root / name)
    run.checkpoints_dir.mkdir(parents=True)
    config.save(run.config_path)
    return run


async def settle(pilot) -> None:
    """Cursor blink off; then wait until every plot shows its newest figure at its size and theme.
    Frames are built in threads at most once a second, and later than that on a loaded machine, so
    a fixed pause is not enough."""
    for widget in pilot.app.query(Input):
        widget.cursor_blink = False
    await pilot.pause(0.5)
    deadline = time.monotonic() + 30
    steady = 0
    while steady < 3:  # a few quiet checks in a row: no redraw is still on its way
        assert time.monotonic() < deadline, "the plots never settled"
        plots = list(pilot.app.query(BackgroundPlot))
        drawn = all(p._frame is not None and p._frame[0] == p._key() and not p._build_scheduled for p in plots)
        busy = any(worker.is_running for worker in pilot.app.workers)
        steady = steady + 1 if drawn and not busy else 0
        await pilot.pause(0.1)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("theme", THEMES)
def test_training_pane(snap_compare, theme, size, tmp_path):
    app = themed(PaneHarness(TrainingPane, RunConfig(output_dir=str(tmp_path))), theme)

    async def run_before(pilot):
        app.feed(RECORDED)
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
    app = themed(PaneHarness(TrainingPane, RunConfig(output_dir=str(tmp_path))), "studio-light")
    async with app.run_test(size=SIZE) as pilot:
        app.feed(RECORDED)
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
    app = themed(PaneHarness(ChatPane, config, run=run), theme)

    async def run_before(pilot):
        pane = app.query_one(ChatPane)
        pane.ask("Reverse the word: hello")
        base, tuned = app.sent
        app.feed([ev.TokenGenerated(request_id=base.request_id, text="hello hello "),
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
    for step in range(1, 31):
        append_event(second.events_path, ev.StepLogged(step=step, total_steps=30, loss=4.0 / (1 + step / 5)))
    append_event(second.events_path, ev.EvalLogged(step=30, loss=1.1))
    app = themed(PaneHarness(TrainingPane, config), "studio-dark")

    async def run_before(pilot):
        app.push_screen(CompareScreen([first, second]))
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
