"""Training curves drawn with plotext: loss (raw, smoothed, eval), learning rate, and run comparison.

The plot is rebuilt only when :meth:`LossPlot.show` (or :meth:`LossPlot.compare`) hands it new data;
the caller decides how often that is (the training pane does it a few times a second at most).
Building a plotext frame costs tens of milliseconds of pure Python, so it happens in a helper
process (:mod:`studio.ui.plot_process`) and the finished frame is swapped in: a keypress never waits
behind a plot, not even for the GIL. Long runs are thinned to a few points per
column before plotting: a terminal cannot show more and plotext's cost grows with the points.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from plotext._dict import themes as plotext_themes
from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style as RichStyle
from rich.text import Text
from textual import work
from textual.color import Color
from textual.strip import Strip
from textual.style import Style
from textual_plotext import PlotextPlot
from textual_plotext.plot import _rgbify_theme, _sequence

from studio.ui import plot_process
from studio.ui.metrics import TrainingState, ema
from studio.ui.plot_process import POINTS, Curve, Figure, render_figure, thin

COMPARE_COLORS = (("cyan", "blue"), ("orange", "red"), ("green", "magenta"))
"""(smoothed train, eval) colours per compared run."""


class BackgroundPlot(PlotextPlot):
    """A PlotextPlot whose frames are built off the event loop.

    Subclasses describe a figure as a function of the plotext object (:meth:`draw`); the frame is
    built in a thread and cached, and ``render`` returns the cached frame. A resize or a theme change
    (rare) builds one frame in place so the widget never shows a stale size.

    The frame is painted through the line API (:meth:`render_line`): Textual's own path turns the
    frame's Rich Text into Content and renders it span by span with a per-cell offset style for
    mouse selection, 5-20 ms on the event loop for every new frame (a keypress landing then waits).
    The same lines built straight from the text's spans, with one combined style a colour, take about
    a millisecond. A plot has no text to select, so selection is off.
    """

    ALLOW_SELECT = False

    min_interval_s = 1.0
    """Fewest seconds between two frame builds: plotext needs 30-90 ms of CPU for one, so a stream of
    updates is coalesced into at most one frame a second."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._last_build = 0.0
        self._build_scheduled = False
        self._figure_lock = threading.Lock()
        self._figure = Figure()
        self._version = 0
        self._requested = 0
        self._frame: tuple[tuple[int, int, str, int], Text] | None = None
        self._strips: tuple[Text, tuple[int, int], list[Strip]] | None = None
        """The lines of the frame last painted, and the size they were cut to."""
        self.build_seconds: list[float] = []
        """CPU seconds of each frame built off the event loop (the events benchmark reads them)."""

    def draw(self, figure: Figure) -> None:
        """Replace the figure; its frame follows shortly."""
        self._figure = figure
        self._version += 1
        if not (self.is_mounted and self.size.area):
            return  # hidden: built when it shows (see render)
        wait = self.min_interval_s - (time.monotonic() - self._last_build)
        if wait <= 0:
            self._start_build()
        elif not self._build_scheduled:
            self._build_scheduled = True
            self.set_timer(wait, self._scheduled_build)

    def _scheduled_build(self) -> None:
        self._build_scheduled = False
        if self._requested != self._version:
            self._start_build()

    def _start_build(self) -> None:
        self._last_build = time.monotonic()
        self._requested = self._version
        self._build_frame(self._key())

    def _register_theme(self, app_theme_name: str) -> None:
        # textual-plotext registers a plotext theme per app theme name once per process, from
        # app.theme_variables; those lag app.theme until the CSS refresh after a switch, so a plot
        # mounted in between froze the old theme's colours under the new name (a light plot drawn on
        # the dark background from then on). Register from the named theme's own colours, every time.
        theme = self.app.get_theme(app_theme_name)
        if self.theme != "auto" or theme is None:
            super()._register_theme(app_theme_name)
            return
        variables = {**theme.to_color_system().generate(), **theme.variables}
        surface = Color.parse(variables["surface"]).rgb
        foreground = Color.parse(variables["foreground"]).rgb
        plotext_themes[self._get_plotext_theme_name(app_theme_name)] = _rgbify_theme(
            surface, surface, foreground, "default", _sequence)
        self.refresh()

    def _key(self) -> tuple[int, int, str, int]:
        return (self.size.width, self.size.height, self._get_plotext_theme_name(self.app.theme), self._version)

    def _frame_text(self, key: tuple[int, int, str, int], figure: Figure) -> Text:
        """Build a frame here, in this process (a resize, or no helper process)."""
        width, height, theme, _ = key
        with self._figure_lock:
            return render_figure(self.plt, figure, width, height, theme)

    @work(exclusive=True, exit_on_error=False, group="plot", description="building a plot")
    async def _build_frame(self, key: tuple[int, int, str, int]) -> None:
        width, height, theme, _ = key
        figure = self._figure
        try:
            future = plot_process.submit(figure, width, height, theme, plotext_themes.get(theme))
            text, seconds = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            raise  # a newer figure replaced this one
        except Exception:
            # No helper process (it could not start, or died): a thread of this one draws instead.
            started = time.process_time()
            text = await asyncio.to_thread(self._frame_text, key, figure)
            seconds = time.process_time() - started
        self.build_seconds.append(seconds)
        self._swap_in(key, text)

    def _swap_in(self, key: tuple[int, int, str, int], text: Text) -> None:
        # A newer figure may have been asked for meanwhile: keep only the frame of the latest one.
        if key[3] == self._version:
            self._frame = (key, text)
            self.refresh()

    def render(self) -> Text:
        key = self._key()
        frame = self._frame
        if frame is not None and frame[0][:3] == key[:3]:
            if frame[0][3] != self._version and self._requested != self._version:
                # Drawn while hidden (no size then): build the newest figure now that it shows.
                self._start_build()
            return frame[1]
        self._frame = (key, self._frame_text(key, self._figure))
        return self._frame[1]

    def notify_style_update(self) -> None:
        """Theme or CSS changed: the lines are cut again in the new colours."""
        self._strips = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the current frame (see the class docstring)."""
        text = self.render()
        width, height = self.size
        cached = self._strips
        if cached is None or cached[0] is not text or cached[1] != (width, height):
            strips = frame_strips(text, width, height, self.visual_style, self.app.ansi_theme)
            if strips is None:  # a frame this fast path does not cover: Textual's own path draws it
                self._strips = None
                return super().render_line(y)
            cached = self._strips = (text, (width, height), strips)
        lines = cached[2]
        return lines[y] if y < len(lines) else Strip.blank(width, self.visual_style.rich_style)


def frame_strips(text: Text, width: int, height: int, base: Style,
                 ansi_theme: object = None) -> list[Strip] | None:
    """The lines Textual draws for a plot frame ``text`` in a widget ``width`` x ``height`` cells
    whose own style is ``base`` (the same colours and attributes, without the offsets used by mouse
    selection), built from the text's spans directly. None for a frame this does not cover:
    overlapping spans, a whole-text style, a character wider than a cell, or a line wider than
    ``width`` (Textual would fold it onto the next line)."""
    if text.style or not width:
        return None
    combined: dict[RichStyle | str, RichStyle] = {}
    base_rich = base.rich_style

    def style_of(span_style: RichStyle | str) -> RichStyle:
        style = combined.get(span_style)
        if style is None:
            parsed = RichStyle.parse(span_style) if isinstance(span_style, str) else span_style
            style = combined[span_style] = (base + Style.from_rich_style(parsed, ansi_theme)).rich_style
        return style

    plain = text.plain
    if not plain.isascii() and any(cell_len(char) != 1 for char in set(plain) - {"\n"}):
        return None
    spans = sorted(text.spans, key=lambda span: span.start)
    if any(a.end > b.start for a, b in zip(spans, spans[1:], strict=False)):
        return None
    strips: list[Strip] = []
    index = 0  # the first span that may reach the current line
    start = 0
    for line in plain.split("\n")[:height]:
        end = start + len(line)
        if len(line) > width:
            return None
        segments: list[Segment] = []
        x = start
        while index < len(spans) and spans[index].end <= start:
            index += 1
        i = index
        while i < len(spans) and spans[i].start < end:
            span = spans[i]
            left, right = max(span.start, start), min(span.end, end)
            if left > x:
                segments.append(Segment(plain[x:left], base_rich))
            if right > left:
                segments.append(Segment(plain[left:right], style_of(span.style)))
            x = max(x, right)
            i += 1
        if x < end:
            segments.append(Segment(plain[x:end], base_rich))
        strips.append(Strip(segments, len(line)))
        start = end + 1
    return strips


class LossPlot(BackgroundPlot):
    """Train loss (raw and EMA-smoothed) and eval loss against the optimizer step."""

    DEFAULT_CSS = """
    LossPlot {
        width: 1fr;
        height: 1fr;
        min-height: 8;
    }
    """

    def __init__(self, title: str = "loss", **kwargs) -> None:
        super().__init__(**kwargs)
        self.title = title
        self.points_drawn = 0
        """How many points the last figure handed to plotext (tests and the benchmark read it)."""
        self._empty("no steps yet")

    def _empty(self, message: str) -> None:
        self.points_drawn = 0
        self.draw(Figure(title=f"{self.title}: {message}"))

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state: raw loss (dim), smoothed loss, eval loss points."""
        if not len(state.loss) and not len(state.eval_loss):
            self._empty("no steps yet")
            return
        curves: list[Curve] = []
        if len(state.loss):
            xs, ys = thin(state.loss.steps, state.loss.values)
            _, smooth = thin(state.loss.steps, state.smoothed_loss)
            curves.append((xs, ys, "train", "gray", "braille"))
            curves.append((xs, smooth, "train (smoothed)", "cyan", "braille"))
        if len(state.eval_loss):
            xs, ys = thin(state.eval_loss.steps, state.eval_loss.values)
            curves.append((xs, ys, "eval", "orange", POINTS))
        last = state.loss.last()
        title = self.title + (f" · last {last:.4f}" if last is not None else "")
        self.points_drawn = sum(len(c[0]) for c in curves)
        self.draw(Figure(tuple(curves), title))

    def compare(self, runs: Sequence[tuple[str, TrainingState]]) -> None:
        """Overlay several runs: each run's smoothed train loss (line) and eval loss (points)."""
        curves: list[Curve] = []
        for i, (label, state) in enumerate(runs):
            train_color, eval_color = COMPARE_COLORS[i % len(COMPARE_COLORS)]
            if len(state.loss):
                xs, ys = thin(state.loss.steps, ema(state.loss.values, state.smoothing))
                curves.append((xs, ys, f"{label} train", train_color, "braille"))
            if len(state.eval_loss):
                xs, ys = thin(state.eval_loss.steps, state.eval_loss.values)
                curves.append((xs, ys, f"{label} eval", eval_color, POINTS))
        if not curves:
            self._empty("the runs have no steps yet")
            return
        self.points_drawn = sum(len(c[0]) for c in curves)
        self.draw(Figure(tuple(curves), f"{self.title}: " + " vs ".join(label for label, _ in runs)))


class LearningRatePlot(BackgroundPlot):
    """The learning rate schedule as it was applied, step by step."""

    min_interval_s = 2.0  # a schedule changes slowly; its plot need not keep up with every step

    DEFAULT_CSS = """
    LearningRatePlot {
        width: 1fr;
        height: 1fr;
        min-height: 8;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.draw(Figure(title="learning rate"))

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state."""
        if not len(state.learning_rate):
            self.draw(Figure(title="learning rate"))
            return
        xs, ys = thin(state.learning_rate.steps, state.learning_rate.values)
        self.draw(Figure(((xs, ys, "", "green", "braille"),), f"learning rate · {ys[-1]:.2e}"))
