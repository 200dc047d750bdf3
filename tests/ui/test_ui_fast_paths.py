"""The UI's fast paths: the page table, the one-line footer, the plot helper process, the plot's own
lines and the screen's frame timer.

Each replaces a slower Textual or plotext route (see bench/ui_latency.py and bench/ui_events.py for
what they save); these tests pin down that they still do what the slow route did.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers.ui import make_config, panes_mounted, settle, workdir
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.style import Style
from textual.visual import Visual, visualize
from textual.widgets import Button

from studio.core import events as ev
from studio.ui import plot_process
from studio.ui.app import StudioApp
from studio.ui.frame_timer import FrameTimer
from studio.ui.metrics import TrainingState
from studio.ui.panes.training import TrainingPane
from studio.ui.theme import bundled_themes
from studio.ui.widgets.footer import StudioFooter
from studio.ui.widgets.loss_plot import LossPlot, frame_strips
from studio.ui.widgets.page_table import PageTable

pytestmark = pytest.mark.anyio

# ------------------------------------------------------------------------------ page table


class TableApp(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.highlighted: list[int] = []
        self.selected: list[int] = []

    def compose(self) -> ComposeResult:
        yield PageTable(id="table")

    def on_page_table_row_highlighted(self, event: PageTable.RowHighlighted) -> None:
        if not isinstance(event, PageTable.RowSelected):
            self.highlighted.append(event.cursor_row)

    def on_page_table_row_selected(self, event: PageTable.RowSelected) -> None:
        self.selected.append(event.cursor_row)


def page(start: int, n: int = 30) -> list[list[str]]:
    return [[str(i), f"instruction {i}", "wide cell " * (i % 3)] for i in range(start, start + n)]


def shown(widget) -> str:
    """The widget's lines as plain text, as they are drawn now."""
    return "\n".join(widget.render_line(y).text for y in range(widget.size.height))


async def test_page_table_draws_pages_moves_its_cursor_and_selects():
    app = TableApp()
    async with app.run_test(size=(60, 12)) as pilot:
        table = app.query_one(PageTable)
        for label in ("#", "instruction", "extra"):
            table.add_column(label)
        assert table.show_rows(page(0)) is False  # a new page size: the cursor starts at the top
        await pilot.pause()
        assert app.highlighted == [0]
        shot = shown(table)
        assert shot.splitlines()[0].split() == ["#", "instruction", "extra"]
        assert "instruction 0" in shot and "instruction 8" in shot
        table.focus()
        await pilot.press("down", "down")
        assert table.cursor_row == 2 and app.highlighted == [0, 1, 2]
        # The next page of as many rows: rewritten in place, the cursor stays, nothing is posted.
        assert table.show_rows(page(30)) is True
        await pilot.pause()
        assert table.cursor_row == 2 and app.highlighted == [0, 1, 2]
        assert table.get_row_at(2)[1] == "instruction 32"
        assert "instruction 30" in shown(table) and "instruction 0 " not in shown(table)
        # Paging down past the screen scrolls the rows under the fixed header.
        await pilot.press("end")
        assert table.cursor_row == 29
        shot = shown(table)
        assert "instruction 59" in shot and shot.splitlines()[0].split() == ["#", "instruction", "extra"]
        await pilot.press("enter")
        await pilot.pause()
        assert app.selected == [29]
        # A click on a row moves the cursor there and selects it; a click on the header does nothing.
        await pilot.press("home")
        await pilot.click(PageTable, offset=(5, 3))
        await pilot.pause()
        assert table.cursor_row == 2 and app.selected[-1] == 2
        await pilot.click(PageTable, offset=(5, 0))
        await pilot.pause()
        assert table.cursor_row == 2
        # Columns only grow: a page of shorter cells keeps the layout still.
        widths = list(table._widths)
        table.show_rows([[str(i), "x", ""] for i in range(30)])
        assert table._widths == widths


def test_page_table_measures_wide_characters():
    table = PageTable()
    table.add_column("text")
    table.show_rows([["日本語テキスト"]])
    assert table._widths == [14]  # seven double-width characters


# ---------------------------------------------------------------------------------- footer


class KeysApp(App[None]):
    BINDINGS = [Binding("ctrl+o", "note('opened')", "Open data", id="test.open"),
                Binding("f9", "note('hidden')", "Hidden", show=False)]

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def compose(self) -> ComposeResult:
        yield Button("one", id="one")
        yield StudioFooter()

    def action_note(self, text: str) -> None:
        self.notes.append(text)


async def test_footer_lists_the_shown_keys_and_a_click_presses_one():
    app = KeysApp()
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause()
        footer = app.query_one(StudioFooter)
        descriptions = [entry.description for entry in footer.entries]
        assert "Open data" in descriptions and "Hidden" not in descriptions
        assert footer.entries[-1].key == app.COMMAND_PALETTE_BINDING  # the palette's key, at the right
        line = shown(footer)
        assert "^o Open data" in line and line.rstrip().endswith("palette")
        await pilot.click(StudioFooter, offset=(2, 0))  # on "^o Open data", the first key
        await pilot.pause()
        assert app.notes == ["opened"]
        assert not list(footer.children)  # one widget drawing a line, not a widget per key


async def test_tab_between_training_buttons_keeps_the_pane_keys(tmp_path, monkeypatch):
    """The training pane gives focus to its first button (the pane itself never takes focus: that
    restyles everything in it); its keys stay live and listed while Tab moves between buttons."""
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False, initial_pane="training")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, rounds=1)
        pane = app.query_one(TrainingPane)
        assert not pane.can_focus
        assert isinstance(app.focused, Button) and pane in app.focused.ancestors
        footer = app.query_one(StudioFooter)
        assert "Runs" in [entry.description for entry in footer.entries]
        await pilot.press("tab")
        assert isinstance(app.focused, Button) and pane in app.focused.ancestors
        await pilot.pause()
        assert "Runs" in [entry.description for entry in footer.entries]


# ------------------------------------------------------------------------------ plot helper


def test_plot_helper_builds_the_same_frame_as_plotext_here():
    from plotext._figure import _figure_class

    xs = list(range(200))
    figure = plot_process.Figure(((xs, [1 / (1 + x) for x in xs], "train", "cyan", "braille"),), "loss")
    text, seconds = plot_process.submit(figure, 70, 18, "pro", None).result(timeout=60)
    here = plot_process.render_figure(_figure_class(), figure, 70, 18, "pro")
    assert isinstance(text, Text) and seconds > 0
    assert text.plain == here.plain and "loss" in text.plain and "train" in text.plain
    assert text.spans == here.spans  # the colours came across too


def test_evaluations_are_drawn_as_points_not_joined_by_a_line():
    """Three evaluations are three marks: a line between them would claim losses at steps where no
    evaluation ran."""
    from plotext._figure import _figure_class

    xs = list(range(101))
    train = (xs, [2.0 - x / 100 for x in xs], "train", "cyan", "braille")
    evals = ([20, 50, 100], [1.6, 1.4, 1.2], "eval", "orange", plot_process.POINTS)
    text = plot_process.render_figure(_figure_class(), plot_process.Figure((train, evals), "loss"), 80, 24, "pro")
    body = [line for line in text.plain.splitlines() if "eval" not in line]  # the legend's marks aside
    assert sum(line.count("•") for line in body) == 3


def test_a_bad_figure_fails_alone_and_a_dead_helper_is_replaced():
    bad = plot_process.Figure(((["not a number"], [1.0, 2.0], "x", "cyan", "braille"),))
    with pytest.raises(RuntimeError, match="plot helper"):
        plot_process.submit(bad, 40, 10, "pro", None).result(timeout=60)
    good = plot_process.Figure(title="still here")
    assert "still here" in plot_process.submit(good, 40, 10, "pro", None).result(timeout=60)[0].plain
    helper = plot_process._helper
    assert helper is not None
    helper.proc.kill()
    helper.proc.wait()
    for _ in range(100):  # the reader thread notices the exit
        if not helper.alive:
            break
        time.sleep(0.05)
    assert not helper.alive
    assert "again" in plot_process.submit(plot_process.Figure(title="again"), 40, 10, "pro", None) \
        .result(timeout=60)[0].plain
    assert plot_process._helper is not helper


# ------------------------------------------------------------------------------ plot lines


class PlotApp(App[None]):
    def compose(self) -> ComposeResult:
        yield LossPlot(id="plot")


def cells(strips) -> list[list[tuple[str, str]]]:
    """Each line as (character, style) cells: what the terminal shows, whatever the segments."""
    return [[(char, str(segment.style or "")) for segment in strip for char in segment.text] for strip in strips]


@pytest.mark.parametrize("theme", ["studio-dark", "studio-light"])
async def test_plot_lines_are_the_ones_textual_draws(theme):
    """The plot paints its frame through the line API (frame_strips): every cell must show the
    character and the colours Textual's own Text-to-Content path gives, at the widget's size."""
    app = PlotApp()
    for bundled in bundled_themes():
        app.register_theme(bundled)
    app.theme = theme
    async with app.run_test(size=(90, 30)) as pilot:
        plot = app.query_one(LossPlot)
        state = TrainingState()
        for step in range(1, 400):
            state.apply(ev.StepLogged(step=step, total_steps=400, loss=3 / (1 + step / 40) + (step % 7) / 20,
                                      learning_rate=2e-4))
            if step % 50 == 0:
                state.apply(ev.EvalLogged(step=step, loss=2 / (1 + step / 40)))
        plot.show(state)
        for _ in range(100):
            await pilot.pause(0.1)
            if plot._frame is not None and plot._frame[0] == plot._key():
                break
        text = plot._frame[1]
        width, height = plot.size
        textual_lines = Visual.to_strips(plot, visualize(plot, text), width, height, plot.visual_style)
        ours = frame_strips(text, width, height, plot.visual_style, app.ansi_theme)
        assert ours is not None and len(ours) == height
        assert cells(ours) == cells(textual_lines)
        assert [strip.cell_length for strip in ours] == [strip.cell_length for strip in textual_lines]
        assert plot.render_line(0) is plot._strips[2][0]  # painted from the lines built once
    # What the fast path does not cover is left to Textual's path.
    assert frame_strips(Text("wide 字"), 20, 2, Style()) is None
    assert frame_strips(Text("x" * 30), 20, 2, Style()) is None


# ------------------------------------------------------------------------------ frame timer


async def test_frame_timer_ticks_at_once_when_a_frame_is_due_and_keeps_the_cap():
    """Resumed after a pause longer than its interval, the timer ticks at once (Textual's own timer
    could wait up to two intervals); resumed within an interval of its last tick, it waits out the
    rest of the interval, so frames stay capped."""
    ticks: list[float] = []

    class TimerApp(App[None]):
        pass

    app = TimerApp()
    # A long interval, so that "at once" and "an interval later" stay far apart on a busy machine
    # (a test worker beside this one): Textual's own timer would wait one to two intervals here.
    interval = 0.25
    async with app.run_test() as pilot:
        timer = FrameTimer(app, interval, callback=lambda: (ticks.append(time.monotonic()), timer.pause()),
                           pause=True)
        timer._start()
        try:
            for _ in range(3):
                await pilot.pause(1.6 * interval)  # longer than the interval: a frame is due
                resumed = time.monotonic()
                timer.resume()
                while len(ticks) < 1 or ticks[-1] < resumed:
                    await asyncio.sleep(0.001)
                assert ticks[-1] - resumed < interval / 2
            timer.resume()  # at once after a tick: waits for the interval
            count = len(ticks)
            while len(ticks) == count:
                await asyncio.sleep(0.001)
            assert ticks[-1] - ticks[-2] >= interval - 0.001
        finally:
            timer.stop()


async def test_the_app_screen_paints_with_the_frame_timer(tmp_path, monkeypatch):
    from studio.ui.app import StudioScreen

    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=(100, 30)) as pilot:
        await panes_mounted(pilot)
        assert isinstance(app.screen, StudioScreen) and isinstance(app.screen._update_timer, FrameTimer)
