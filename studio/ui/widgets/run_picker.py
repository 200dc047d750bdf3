"""The run picker: every run under the runs folder, to open one or compare two.

:class:`RunPickerScreen` lists runs with status, model, steps, best eval loss and date (read with
``studio.core.runs`` in a thread, so a folder of many runs does not stall the UI). Enter opens the
highlighted run; space marks runs and ``c`` compares the two marked. The screen's result is None
(cancelled), ``("open", RunDir)`` or ``("compare", [RunDir, RunDir])``. :class:`CompareScreen`
draws two runs' loss curves on one plot.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from studio.core.runs import RunDir, RunSummary, iter_events, list_runs, summarize
from studio.core.runs.cells import cell
from studio.ui.metrics import TrainingState, fold
from studio.ui.widgets.loss_plot import LossPlot

PickResult = tuple[str, RunDir] | tuple[str, list[RunDir]] | None


def _date(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(started)) if started else "?"


def summary_row(summary: RunSummary, marked: bool = False) -> tuple[str, ...]:
    """The cells of one run in the picker table."""
    best = f"{summary.best_eval_loss:.4f}" if summary.best_eval_loss is not None else "--"
    steps = f"{summary.step}/{summary.total_steps}" if summary.total_steps else str(summary.step)
    return ("*" if marked else " ", summary.run.id, summary.status, cell(summary.model), steps, best,
            _date(summary.started))


class RunPickerScreen(ModalScreen[PickResult]):
    """All runs under ``root``; open one, or mark two and compare them."""

    DEFAULT_CSS = """
    RunPickerScreen { align: center middle; }
    RunPickerScreen > Vertical {
        width: 90%; height: 80%;
        border: round $primary; background: $panel; padding: 0 1;
    }
    RunPickerScreen #runs-hint { color: $text-muted; height: auto; }
    RunPickerScreen DataTable { height: 1fr; }
    """

    BINDINGS = [
        Binding("enter", "open_run", "Open", id="runs.open"),
        Binding("space", "mark", "Mark for compare", id="runs.mark"),
        Binding("c", "compare", "Compare marked", id="runs.compare"),
        Binding("escape", "dismiss(None)", "Close", id="runs.close"),
    ]

    def __init__(self, root: str | Path = "runs") -> None:
        super().__init__()
        self.root = Path(root)
        self.summaries: list[RunSummary] = []
        self.marked: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"Runs in {self.root}/ — enter: open · space: mark · c: compare two marked · "
                         "esc: close", id="runs-hint")
            table: DataTable = DataTable(id="runs-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("", "run", "status", "model", "steps", "best eval", "started")
            yield table
            yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).loading = True
        self.load_runs()

    @work(thread=True, exclusive=True, exit_on_error=False, group="runs", description="reading runs")
    def load_runs(self) -> None:
        """Summarize every run (reads each events.jsonl) off the event loop."""
        summaries = [summarize(run) for run in list_runs(self.root)]
        self.app.call_from_thread(self._show, summaries)

    def _show(self, summaries: list[RunSummary]) -> None:
        self.summaries = summaries
        table = self.query_one(DataTable)
        table.loading = False
        table.clear()
        for summary in summaries:
            table.add_row(*summary_row(summary, summary.run.id in self.marked), key=summary.run.id)
        if not summaries:
            self.query_one("#runs-hint", Static).update(
                f"No runs in {self.root}/ yet: start one from the Training pane (s) or 'studio train CONFIG'.")

    def _current(self) -> RunSummary | None:
        table = self.query_one(DataTable)
        if not self.summaries or table.cursor_row < 0:
            return None
        return self.summaries[min(table.cursor_row, len(self.summaries) - 1)]

    def action_open_run(self) -> None:
        """Open the highlighted run."""
        current = self._current()
        if current is not None:
            self.dismiss(("open", current.run))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open_run()

    def action_mark(self) -> None:
        """Mark (or unmark) the highlighted run for comparison; at most two stay marked."""
        current = self._current()
        if current is None:
            return
        run_id = current.run.id
        if run_id in self.marked:
            self.marked.remove(run_id)
        else:
            self.marked.append(run_id)
            if len(self.marked) > 2:
                self.marked.pop(0)
        table = self.query_one(DataTable)
        for summary in self.summaries:
            table.update_cell(summary.run.id, table.ordered_columns[0].key,
                              "*" if summary.run.id in self.marked else " ")

    def action_compare(self) -> None:
        """Compare the two marked runs (or the marked one with the highlighted one)."""
        picks = list(self.marked)
        current = self._current()
        if len(picks) == 1 and current is not None and current.run.id not in picks:
            picks.append(current.run.id)
        if len(picks) != 2:
            self.notify("Mark two runs with space, then press c.", severity="warning")
            return
        by_id = {s.run.id: s.run for s in self.summaries}
        self.dismiss(("compare", [by_id[p] for p in picks]))


class CompareScreen(ModalScreen[None]):
    """Two (or more) runs' loss curves on one plot."""

    DEFAULT_CSS = """
    CompareScreen { align: center middle; }
    CompareScreen > Vertical {
        width: 95%; height: 90%;
        border: round $primary; background: $panel;
    }
    CompareScreen #compare-summary { height: auto; padding: 0 1; }
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "Close", id="compare.close")]

    def __init__(self, runs: list[RunDir]) -> None:
        super().__init__()
        self.runs = runs

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("", id="compare-summary")
            yield LossPlot(title="compare", id="compare-plot")
            yield Footer()

    def on_mount(self) -> None:
        self.load()

    @work(thread=True, exclusive=True, exit_on_error=False, group="compare", description="reading runs")
    def load(self) -> None:
        """Fold each run's event log off the event loop."""
        states = [(run.id, fold(iter_events(run.events_path))) for run in self.runs]
        self.app.call_from_thread(self._show, states)

    def _show(self, states: list[tuple[str, TrainingState]]) -> None:
        self.query_one(LossPlot).compare(states)
        lines = []
        for label, state in states:
            best = f"{state.best_eval_loss:.4f}" if state.best_eval_loss is not None else "--"
            last = state.loss.last()
            lines.append(f"{label}: {state.status}, step {state.step}/{state.total_steps}, "
                         f"last loss {last:.4f}" if last is not None else f"{label}: no steps")
            lines[-1] += f", best eval {best}"
        self.query_one("#compare-summary", Static).update("\n".join(lines))
