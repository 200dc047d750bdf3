"""Training curves drawn with plotext: loss (raw, smoothed, eval), learning rate, and run comparison.

The plot is rebuilt only when :meth:`LossPlot.show` (or :meth:`LossPlot.compare`) hands it new data;
the caller decides how often that is (the training pane does it a few times a second at most).
Long runs are thinned to a few points per column before plotting: a terminal cannot show more and
plotext's cost grows with the points.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual_plotext import PlotextPlot

from studio.ui.metrics import TrainingState, ema

MAX_POINTS = 600
"""Most points per curve handed to plotext; more are thinned evenly (the last point always kept)."""

COMPARE_COLORS = (("cyan", "blue"), ("orange", "red"), ("green", "magenta"))
"""(smoothed train, eval) colours per compared run."""


def thin(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most ``limit`` evenly spaced points of a curve, keeping the first and the last."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    stride = n / (limit - 1)
    picks = sorted({min(n - 1, round(i * stride)) for i in range(limit - 1)} | {n - 1})
    return [xs[i] for i in picks], [ys[i] for i in picks]


class LossPlot(PlotextPlot):
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
        """How many points the last redraw handed to plotext (a test and the benchmark read it)."""
        self._empty("no steps yet")

    def _empty(self, message: str) -> None:
        plt = self.plt
        plt.clear_figure()
        plt.title(f"{self.title}: {message}")
        plt.xlabel("step")
        self.points_drawn = 0

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state: raw loss (dim), smoothed loss, eval loss points."""
        if not len(state.loss) and not len(state.eval_loss):
            self._empty("no steps yet")
            self.refresh()
            return
        plt = self.plt
        plt.clear_figure()
        drawn = 0
        if len(state.loss):
            xs, ys = thin(state.loss.steps, state.loss.values)
            _, smooth = thin(state.loss.steps, state.smoothed_loss)
            plt.plot(xs, ys, label="train", color="gray", marker="braille")
            plt.plot(xs, smooth, label="train (smoothed)", color="cyan", marker="braille")
            drawn += 2 * len(xs)
        if len(state.eval_loss):
            xs, ys = thin(state.eval_loss.steps, state.eval_loss.values)
            plt.plot(xs, ys, label="eval", color="orange", marker="dot")
            drawn += len(xs)
        last = state.loss.last()
        plt.title(f"{self.title}" + (f" · last {last:.4f}" if last is not None else ""))
        plt.xlabel("step")
        self.points_drawn = drawn
        self.refresh()

    def compare(self, runs: Sequence[tuple[str, TrainingState]]) -> None:
        """Overlay several runs: each run's smoothed train loss (line) and eval loss (points)."""
        plt = self.plt
        plt.clear_figure()
        drawn = 0
        for i, (label, state) in enumerate(runs):
            train_color, eval_color = COMPARE_COLORS[i % len(COMPARE_COLORS)]
            if len(state.loss):
                xs, ys = thin(state.loss.steps, ema(state.loss.values, state.smoothing))
                plt.plot(xs, ys, label=f"{label} train", color=train_color, marker="braille")
                drawn += len(xs)
            if len(state.eval_loss):
                xs, ys = thin(state.eval_loss.steps, state.eval_loss.values)
                plt.plot(xs, ys, label=f"{label} eval", color=eval_color, marker="dot")
                drawn += len(xs)
        if not drawn:
            self._empty("the runs have no steps yet")
        else:
            plt.title(f"{self.title}: " + " vs ".join(label for label, _ in runs))
            plt.xlabel("step")
        self.points_drawn = drawn
        self.refresh()


class LearningRatePlot(PlotextPlot):
    """The learning rate schedule as it was applied, step by step."""

    DEFAULT_CSS = """
    LearningRatePlot {
        width: 1fr;
        height: 1fr;
        min-height: 8;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.plt.title("learning rate")
        self.plt.xlabel("step")

    def show(self, state: TrainingState) -> None:
        """Redraw from a run's state."""
        plt = self.plt
        plt.clear_figure()
        if len(state.learning_rate):
            xs, ys = thin(state.learning_rate.steps, state.learning_rate.values)
            plt.plot(xs, ys, color="green", marker="braille")
            plt.title(f"learning rate · {ys[-1]:.2e}")
        else:
            plt.title("learning rate")
        plt.xlabel("step")
        self.refresh()
