"""The base model's evaluation at step 0: folded as the first eval point, drawn, worded, not a "best"."""

from __future__ import annotations

from studio.core import events as ev
from studio.core.runs import report
from studio.ui.metrics import fold
from studio.ui.plot_process import render_figure
from studio.ui.widgets.loss_plot import LossPlot

BASE = ev.EvalLogged(step=0, loss=2.5, perplexity=12.18, token_accuracy=0.31, rows=16)
AFTER = [ev.StepLogged(step=s, total_steps=10, loss=2.6 - 0.1 * s, learning_rate=1e-3) for s in range(1, 11)]
FINAL = ev.EvalLogged(step=10, loss=2.7, perplexity=14.88, token_accuracy=0.35, rows=16)


def test_step_zero_eval_is_the_first_point_and_not_the_best() -> None:
    state = fold([ev.RunStarted(run_id="r", total_steps=10), BASE, *AFTER, FINAL])
    assert state.eval_loss.steps == [0, 10] and state.eval_loss.values == [2.5, 2.7]
    assert state.base_eval == BASE
    # The fine-tune's best is its own evaluations' best, even when the base scored lower.
    assert state.best_eval_loss == 2.7
    assert report.eval_line(BASE).startswith("eval of the base model (step 0): loss 2.5")
    assert report.eval_line(FINAL).startswith("eval at step 10: ")


def test_loss_plot_draws_the_step_zero_point_alone_and_with_training() -> None:
    from plotext._figure import _figure_class

    plot = LossPlot()
    plot.show(fold([ev.RunStarted(run_id="r", total_steps=10), BASE]))
    eval_curve = [c for c in plot._figure.curves if c[2] == "eval"]
    assert eval_curve and list(eval_curve[0][0]) == [0] and plot.points_drawn == 1
    text = render_figure(_figure_class(), plot._figure, 60, 14, "pro").plain
    assert "eval" in text and "0" in text

    plot.show(fold([ev.RunStarted(run_id="r", total_steps=10), BASE, *AFTER, FINAL]))
    xs = [c[0] for c in plot._figure.curves if c[2] == "eval"][0]
    assert list(xs) == [0, 10]
    assert render_figure(_figure_class(), plot._figure, 60, 14, "pro").plain.strip()
