"""The event fold behind the training pane, and the held-out scores: plain Python, no Textual."""

from __future__ import annotations

import pytest
from helpers import DATA

from studio.core import events as ev
from studio.core.runs import iter_events, scoring
from studio.ui.metrics import TrainingState, ema, fold, format_duration
from studio.ui.series import Series

RECORDED = DATA / "recorded_events.jsonl"


def steps(n: int, start: int = 1, total: int = 10, loss0: float = 3.0) -> list[ev.Event]:
    return [ev.StepLogged(step=s, total_steps=total, epoch=s / total, loss=loss0 / s, learning_rate=1e-3 * s,
                          tokens_per_s=100.0 + s, elapsed_s=float(s), eta_s=float(total - s))
            for s in range(start, start + n)]


def test_steps_move_progress_curves_and_eta():
    state = fold([ev.RunStarted(run_id="r", total_steps=10), *steps(4)])
    assert state.status == "training"
    assert (state.step, state.total_steps) == (4, 10)
    assert state.loss.steps == [1, 2, 3, 4]
    assert state.learning_rate.last() == pytest.approx(4e-3)
    assert state.progress == pytest.approx(0.4)
    assert "step 4/10" in state.progress_line() and "ETA 6s" in state.progress_line()
    assert "104 tok/s" in state.progress_line()


def test_eta_is_estimated_when_the_worker_gives_none():
    state = fold([ev.StepLogged(step=5, total_steps=20, loss=1.0, elapsed_s=10.0, eta_s=0.0)])
    assert state.eta_s == pytest.approx(30.0)


def test_smoothed_loss_follows_the_trend_with_less_noise():
    noisy = [2.0 + (0.5 if i % 2 else -0.5) - i * 0.01 for i in range(100)]
    smooth = ema(noisy, 0.9)
    assert smooth[0] == pytest.approx(noisy[0])  # bias-corrected: no pull towards zero
    jumps_raw = sum(abs(a - b) for a, b in zip(noisy, noisy[1:], strict=False))
    jumps_smooth = sum(abs(a - b) for a, b in zip(smooth, smooth[1:], strict=False))
    assert jumps_smooth < jumps_raw / 5
    state = fold(steps(5))
    assert len(state.smoothed_loss) == 5
    state.apply(steps(1, start=6)[0])
    assert len(state.smoothed_loss) == 6  # the cache follows new points


def test_eval_metrics_and_best_eval_loss():
    state = fold([ev.EvalLogged(step=5, loss=1.5, perplexity=4.48, token_accuracy=0.25),
                  ev.EvalLogged(step=10, loss=1.2, perplexity=3.32, token_accuracy=0.4)])
    assert state.eval_loss.values == [1.5, 1.2]
    assert state.best_eval_loss == 1.2
    assert "perplexity 3.32" in state.eval_line() and "40.0%" in state.eval_line()


def test_pause_resume_finish_statuses():
    state = fold([ev.RunStarted(total_steps=10), *steps(2), ev.TrainingPaused(step=2)])
    assert state.status == "paused"
    state.apply(ev.TrainingResumed(step=2))
    assert state.status == "training"
    state.apply(ev.TrainingFinished(step=3, stopped=True, adapter_path="/x/adapter"))
    assert state.status == "stopped" and state.adapter_ready


def test_resume_from_checkpoint_redraws_the_redone_steps_once():
    log = [ev.RunStarted(total_steps=10), *steps(6), ev.RunStarted(total_steps=10, resumed_from_step=4),
           *steps(3, start=5, loss0=6.0)]
    state = fold(log)
    assert state.loss.steps == [1, 2, 3, 4, 5, 6, 7]
    assert state.loss.values[4] == pytest.approx(6.0 / 5)  # the redone step's new loss


def test_oom_and_failures_are_explained():
    state = fold([ev.RunStarted(total_steps=10, micro_batch_size=8, gradient_accumulation_steps=2),
                  ev.BatchSizeReduced(step=3, old_micro_batch_size=8, micro_batch_size=4,
                                      gradient_accumulation_steps=4)])
    assert state.status == "training"
    assert "micro-batch 8 -> 4" in state.notices[-1] and "accumulation 4" in state.notices[-1]
    state.apply(ev.WorkerFailed(kind="data", message="data.jsonl line 7: empty output; fix the row"))
    assert state.status == "failed"
    assert state.failure_line() == "Data error: data.jsonl line 7: empty output; fix the row"


def test_memory_line():
    # Decimal GB, the VRAM gauge's unit, as every front end prints it (studio/core/runs/report.py).
    gb = 10**9
    state = fold([ev.MemorySampled(device="cuda", allocated=3 * gb, peak_allocated=4 * gb, capacity=80 * gb)])
    assert state.memory_line() == "memory (cuda): 3.00 GB in use, peak 4.00 GB of 80.00 GB"


def test_unknown_events_change_nothing():
    state = TrainingState()
    assert not state.apply(ev.TokenGenerated(request_id="a", text="x"))
    assert state.version == 0


def test_series_replaces_a_repeated_step():
    s = Series()
    for step, value in [(1, 1.0), (2, 2.0), (2, 3.0)]:
        s.add(step, value)
    assert s.steps == [1, 2] and s.values == [1.0, 3.0]


def test_format_duration():
    assert [format_duration(x) for x in (None, 5, 125, 3725)] == ["--", "5s", "2m05s", "1h02m"]


def test_recorded_run_folds_to_a_finished_curve():
    state = fold(iter_events(RECORDED))
    assert state.status == "finished"
    assert state.step == state.total_steps > 10
    assert len(state.loss) == state.total_steps and len(state.eval_loss) >= 2
    assert state.smoothed_loss[-1] < state.smoothed_loss[0]


# ------------------------------------------------------------------------------------- scoring


def test_exact_match_ignores_case_space_and_final_stop():
    assert scoring.exact_match("  Hello   World. ", "hello world")
    assert not scoring.exact_match("hello", "hello world")


def test_similarity_ranks_nearer_answers_higher():
    target = "olleh"
    assert scoring.similarity("olleh", target) == 1.0
    assert scoring.similarity("olle", target) > scoring.similarity("xyz", target)
    assert scoring.similarity("", "") == 1.0


def test_totals():
    t = scoring.totals([scoring.score("a", "a"), scoring.score("b", "c")])
    assert t.rows == 2 and t.exact_match == 0.5 and t.similarity == pytest.approx(0.5)
    assert "exact 50.0%" in t.line()
    assert scoring.totals([]).rows == 0
