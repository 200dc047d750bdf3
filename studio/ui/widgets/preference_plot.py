"""A preference run's curves (DPO / ORPO): what the training pane shows in place of the learning rate.

Two plots from :class:`studio.ui.metrics.PreferenceCurves`: the summed log-probs of the chosen and
the rejected answers (they should part: chosen up or level, rejected down), and the reward margin
with the pairs' preference accuracy in the title (titles stay short: plotext drops one wider than
the plot). Frames are built off the event loop, as for the
loss (:class:`studio.ui.widgets.loss_plot.BackgroundPlot`).
"""

from __future__ import annotations

from studio.ui.metrics import TrainingState
from studio.ui.plot_process import Curve, Figure, thin
from studio.ui.widgets.loss_plot import BackgroundPlot


class PreferencePlot(BackgroundPlot):
    """``kind`` ``logps``: chosen and rejected log-probs; ``margin``: the reward margin and accuracy."""

    DEFAULT_CSS = """
    PreferencePlot {
        width: 1fr;
        height: 1fr;
        min-height: 8;
    }
    """

    def __init__(self, kind: str = "logps", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.draw(Figure(title=self._title()))

    def _title(self) -> str:
        return "log p" if self.kind == "logps" else "margin"

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state."""
        curves_of = state.preference
        if self.kind == "logps":
            pairs = ((curves_of.chosen_logp, "chosen", "green"), (curves_of.rejected_logp, "rejected", "red"))
        else:
            pairs = ((curves_of.reward_margin, "margin", "cyan"),)
        curves: list[Curve] = []
        for series, label, color in pairs:
            if len(series):
                xs, ys = thin(series.steps, series.values)
                curves.append((xs, ys, label, color, "braille"))
        title = self._title()
        last = curves_of.last
        if last is not None and self.kind == "logps":
            title += f" {last.chosen_logp:.1f} / {last.rejected_logp:.1f}"
        elif last is not None:
            title += f" {last.reward_margin:.2f} · acc {last.accuracy:.0%}"
            if curves_of.last_eval is not None:
                title += f" (eval {curves_of.last_eval.accuracy:.0%})"
        self.draw(Figure(tuple(curves), title))
