"""A GRPO run's curves: what the training pane shows in place of the loss and the learning rate.

Four plots from :class:`studio.ui.grpo_metrics.GrpoCurves`: ``rewards`` (each reward's mean per step,
the total, and the held-out total per evaluation as points), ``spread`` (the total's standard
deviation within a group: what GRPO learns from; the title gives the share of groups that all
scored the same), ``length`` (mean completion tokens; the title gives the share cut at the limit)
and ``kl`` (to the base model, when ``grpo.beta`` > 0). Frames are built off the event loop, as for
the loss (:class:`studio.ui.widgets.loss_plot.BackgroundPlot`).
"""

from __future__ import annotations

from studio.ui.metrics import TrainingState
from studio.ui.plot_process import POINTS, Curve, Figure, thin
from studio.ui.widgets.loss_plot import BackgroundPlot

KINDS = ("rewards", "spread", "length", "kl")
"""The plots, in the order the training pane places them."""

REWARD_COLORS = ("green", "orange", "magenta", "blue", "red", "yellow")
"""One colour per reward, in the order the run names them; the total is cyan."""


class GrpoPlot(BackgroundPlot):
    """One of :data:`KINDS`."""

    DEFAULT_CSS = """
    GrpoPlot {
        width: 1fr;
        height: 1fr;
        min-height: 8;
    }
    """

    def __init__(self, kind: str = "rewards", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind = kind
        self.draw(Figure(title=kind))

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state."""
        curves_of = state.grpo
        last = curves_of.last
        curves: list[Curve] = []

        def line(series, label: str, color: str, marker: str = "braille") -> None:
            if len(series):
                xs, ys = thin(series.steps, series.values)
                curves.append((xs, ys, label, color, marker))

        if self.kind == "rewards":
            for index, (name, series) in enumerate(curves_of.rewards.items()):
                line(series, name, REWARD_COLORS[index % len(REWARD_COLORS)])
            line(curves_of.total, "total", "cyan")
            line(curves_of.eval_total, "held-out", "gray", POINTS)
            title = f"reward {last.reward:.3f}" if last is not None else "reward"
            if curves_of.last_eval is not None:
                title += f" (held-out {curves_of.last_eval.reward:.3f})"
        elif self.kind == "spread":
            line(curves_of.spread, "within groups", "cyan")
            title = f"spread {last.reward_std:.3f} · flat {last.zero_spread:.0%}" if last is not None else "spread"
        elif self.kind == "length":
            line(curves_of.length, "tokens", "cyan")
            title = f"length {last.completion_length:.1f} · cut {last.truncated:.0%}" if last is not None else "length"
        else:
            line(curves_of.kl, "kl", "cyan")
            title = "kl" if last is None else f"kl {last.kl:.4f}" if last.kl is not None else "kl (beta 0: off)"
        self.draw(Figure(tuple(curves), title))
