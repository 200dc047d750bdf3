"""Column statistics: character and token length histograms (plotext) and split counts.

Shows one column at a time (picked in a Select) so the plots stay readable in a narrow side panel.
The numbers come from :func:`studio.core.data.column_stats`, computed by the dataset pane in a thread.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.color import Color
from textual.containers import Vertical
from textual.widgets import Select, Static
from textual_plotext import PlotextPlot

from studio.core.data import ColumnStats, LengthStats


def summary_line(what: str, stats: LengthStats) -> str:
    """One line of numbers for a length distribution."""
    return (f"{what}: min {stats.min:,} · median {stats.p50:,.0f} · p95 {stats.p95:,.0f} · "
            f"max {stats.max:,}")


def split_bars(counts: dict[str, int], width: int = 16) -> str:
    """Split counts as text bars (``train ██████ 450``); zero-row splits other than train are left out."""
    shown = {name: n for name, n in counts.items() if n or name == "train"}
    top = max(shown.values(), default=0) or 1
    label = max((len(name) for name in shown), default=0)
    return "\n".join(f"{name:<{label}} {'█' * max(1 if n else 0, round(width * n / top)):<{width}} {n:,}"
                     for name, n in shown.items())


class StatsView(Vertical):
    """Length histograms of one column at a time, with the split counts under them."""

    def compose(self) -> ComposeResult:
        yield Static("Open a dataset to see its statistics.", id="stats-note")
        yield Select([], prompt="column", allow_blank=True, id="stats-column", compact=True)
        yield Static("", id="stats-summary")
        yield PlotextPlot(id="stats-chars")
        yield PlotextPlot(id="stats-tokens")
        yield Static("", id="stats-splits")

    def on_mount(self) -> None:
        self.stats: dict[str, ColumnStats] = {}
        self.token_label = ""
        self.app.theme_changed_signal.subscribe(self, lambda _: self.call_after_refresh(self._draw))

    def show(self, stats: dict[str, ColumnStats], splits: dict[str, int] | None, note: str,
             token_label: str) -> None:
        """Display new statistics; keeps the chosen column when it still exists."""
        self.stats = stats
        self.token_label = token_label
        self.query_one("#stats-note", Static).update(note)
        select = self.query_one("#stats-column", Select)
        current = select.value
        select.set_options([(name, name) for name in stats])
        if current in stats:
            select.value = current
        elif stats:
            preferred = [n for n in ("output", "instruction") if n in stats]
            select.value = preferred[0] if preferred else next(iter(stats))
        if splits:
            self.query_one("#stats-splits", Static).update("splits\n" + split_bars(splits))
        else:
            self.query_one("#stats-splits", Static).update("no split column: train/validation are "
                                                           "drawn at random (data.val_fraction)")
        self._draw()

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._draw()

    def _draw(self) -> None:
        value = self.query_one("#stats-column", Select).value
        column = self.stats.get(value) if isinstance(value, str) else None
        chars_plot = self.query_one("#stats-chars", PlotextPlot)
        tokens_plot = self.query_one("#stats-tokens", PlotextPlot)
        if column is None:
            for plot in (chars_plot, tokens_plot):
                plot.plt.clear_data()
                plot.refresh()
            return
        lines = [summary_line("chars", column.chars)]
        if column.tokens is not None:
            lines.append(summary_line("tokens", column.tokens))
        if column.empty:
            lines.append(f"{column.empty:,} empty")
        self.query_one("#stats-summary", Static).update("\n".join(lines))
        variables = self.app.theme_variables
        self._histogram(chars_plot, column.chars, f"{column.column}: characters",
                        Color.parse(variables["primary"]).rgb)
        if column.tokens is not None:
            title = "tokens" if self.token_label.startswith("tokenizer") else "≈ tokens"
            self._histogram(tokens_plot, column.tokens, title, Color.parse(variables["studio-response"]).rgb)
        tokens_plot.display = column.tokens is not None

    @staticmethod
    def _histogram(plot: PlotextPlot, stats: LengthStats, title: str, colour: tuple[int, int, int]) -> None:
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.bar(stats.edges[:-1], stats.counts, color=colour, width=0.9)
        plt.title(title)
        plt.xticks(_ticks(stats.edges))
        plot.refresh()


def _ticks(edges: list[int], most: int = 4) -> list[int]:
    """A few x ticks at bucket starts, so labels do not collide in a narrow plot."""
    starts = edges[:-1]
    step = max(1, len(starts) // most)
    return starts[::step]
