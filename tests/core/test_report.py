"""Events as text (studio/core/runs/report.py): units, and the same words in the CLI and the TUI."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run
from studio.core.runs.report import describe, format_bytes, format_duration, memory_text, step_line
from studio.ui.metrics import fold
from studio.worker.eventlog import EventLog

GB = 10**9

MEMORY = ev.MemorySampled(step=4, device="cuda", allocated=3 * GB, peak_allocated=4 * GB, capacity=80 * GB)
STEP = ev.StepLogged(step=4, total_steps=10, loss=1.23456, learning_rate=2e-4, grad_norm=0.5,
                     tokens_per_s=1234.4, eta_s=125)
EVAL = ev.EvalLogged(step=4, loss=0.98765, perplexity=2.685, token_accuracy=0.61, rows=40)
OOM = ev.BatchSizeReduced(step=3, old_micro_batch_size=8, micro_batch_size=4, gradient_accumulation_steps=2,
                          message="set trainer.micro_batch_size: 4 to start there next time")
FAILED = ev.WorkerFailed(kind="data", message="train.jsonl line 12: 'output' is empty; fill it or drop the row")
WARNED = ev.WarningRaised(kind="config", message="using torch AdamW")


def test_sizes_are_decimal_gigabytes_like_the_gauge() -> None:
    from studio.core.memory.gpus import GB as gauge_gb

    assert gauge_gb == GB
    assert [format_bytes(n) for n in (None, 0, 456 * 10**6, 3 * GB, 79_600_000_000)] == [
        "--", "--", "456 MB", "3.00 GB", "79.60 GB"]
    assert memory_text(MEMORY) == "3.00 GB in use, peak 4.00 GB of 80.00 GB"
    # No capacity on a CPU: the "of" part is left out rather than printed as "of --".
    assert memory_text(ev.MemorySampled(allocated=2 * 10**6, peak_allocated=3 * 10**6)) == "2 MB in use, peak 3 MB"


def test_durations_rates_and_step_lines() -> None:
    assert [format_duration(x) for x in (None, -1, float("nan"), 0, 59.6, 125, 3725, 2 * 86400 + 3 * 3600)] == [
        "--", "--", "--", "0s", "1m00s", "2m05s", "1h02m", "2d03h"]
    assert step_line(STEP) == "step 4/10  loss 1.2346  lr 2.00e-04  grad 0.500  1,234 tok/s  eta 2m05s"
    assert describe(ev.TokenGenerated(request_id="a", text="x")) is None
    assert describe(ev.TrainingFinished(step=150, adapter_path="runs/x/adapter", train_loss=0.5, elapsed_s=62)) == (
        "training finished at step 150: train loss 0.5000, adapter -> runs/x/adapter (1m02s)")


def test_the_tui_words_events_as_the_cli_does() -> None:
    """The training pane's lines are the very strings `studio attach` prints for the same events."""
    state = fold([STEP, MEMORY, EVAL, OOM])
    assert state.memory_line() == f"memory (cuda): {memory_text(MEMORY)}"
    assert memory_text(MEMORY) in describe(MEMORY)
    assert state.eval_line() == describe(EVAL)
    assert state.notices[-1] == describe(OOM)
    assert "out of memory; micro-batch 8 -> 4" in describe(OOM)
    state.apply(WARNED)
    assert state.notices[-1] == describe(WARNED) == "warning (config): using torch AdamW"
    state.apply(FAILED)
    # The pane heads its alert with a label; a console line starts with "error" for grep.
    assert state.failure_line() == f"Data error: {FAILED.message}"
    assert describe(FAILED) == f"error (data): {FAILED.message}"


def test_preference_numbers_say_what_they_are() -> None:
    """A DPO run's accuracies: the logged step's is its own batch's, the evaluation's the validation
    pairs'; the chosen answers' perplexity is never printed beside the preference loss."""
    def logged(split: str) -> ev.PreferenceLogged:
        return ev.PreferenceLogged(step=40, split=split, method="dpo", loss=0.0245, reward_margin=3.72,
                                   chosen_logp=-6.58, rejected_logp=-82.83, accuracy=1.0, pairs=16)

    assert describe(logged("train")).startswith("dpo step 40: loss 0.0245  train-batch accuracy 100.0%  margin 3.72")
    assert describe(logged("validation")).startswith("dpo eval at step 40: loss 0.0245  validation accuracy 100.0%")
    chosen = ev.EvalLogged(step=40, loss=0.6333, perplexity=3.87, token_accuracy=0.8, rows=60, method="dpo")
    assert describe(chosen) == "eval at step 40: chosen answers' perplexity 3.87  token accuracy 80.0% (60 pairs)"
    assert describe(EVAL).startswith("eval at step 4: loss 0.9877  perplexity 2.69")  # SFT: exp of that loss


def test_a_warning_reads_as_one_warning() -> None:
    """A warning is its own event: the console line says "warning", the training pane lists it once
    with no failure headline beside it, and the run goes on."""
    note = ev.WarningRaised(kind="config", message="no CUDA GPU: loading the base in float32 instead of 4-bit")
    state = fold([ev.ModelLoading(stage="loading the weights", fraction=0.2), note])
    assert state.failure is None and state.status == "loading"
    assert [state.failure_line(), *state.notices] == ["", describe(note)]
    assert describe(note) == f"warning (config): {note.message}"
    # A request that failed (the worker goes on) is a failure, named as such.
    failed = ev.WorkerFailed(kind="crash", fatal=False, request="Generate", message="RuntimeError: boom")
    state.apply(failed)
    assert state.status == "loading" and state.notices == [describe(note)]
    assert state.failure_line() == "Worker error (Generate): RuntimeError: boom"
    assert describe(failed) == "error (crash, Generate): RuntimeError: boom"


OLD_WARNING = ('{"type":"WorkerFailed","seq":1,"time":1.0,"kind":"data","message":"6 training rows are longer '
               'than data.max_seq_length (256 tokens) and were truncated","detail":"","fatal":false}')
OLD_FAILURE = ('{"type":"WorkerFailed","seq":2,"time":2.0,"kind":"data","message":"train.jsonl line 12: empty",'
               '"detail":"","fatal":true}')


def test_warnings_of_runs_made_before_read_as_warnings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """events.jsonl of a run made when warnings were non-fatal WorkerFailed events: `studio attach`
    and the pane show them as warnings; a failure stays a failure."""
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    run.events_path.write_text(OLD_WARNING + "\n" + OLD_FAILURE + "\n")
    warning, failure = run.events()
    assert isinstance(warning, ev.WarningRaised) and (warning.seq, warning.kind) == (1, "data")
    assert isinstance(failure, ev.WorkerFailed) and failure.fatal
    replied = ev.from_json(ev.to_json(ev.WorkerFailed(kind="config", fatal=False, request="Pause", message="no")))
    assert isinstance(replied, ev.WorkerFailed) and replied.request == "Pause"
    assert fold([warning]).notices == [describe(warning)]
    assert studio(["attach", run.id, "--runs-dir", str(tmp_path / "runs")]) == 1
    printed = capsys.readouterr().out
    assert "  warning (data): 6 training rows are longer" in printed
    assert "  error (data): train.jsonl line 12: empty" in printed


def test_attach_prints_the_shared_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`studio attach` words events as `studio train` does: one line a step, its memory on it."""
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    log = EventLog(run.events_path)
    for event in (MEMORY, STEP, EVAL, OOM, FAILED):
        log.append(event)
    log.close()
    assert studio(["attach", run.id, "--runs-dir", str(tmp_path / "runs")]) == 1  # failed: nothing to follow
    printed = capsys.readouterr().out
    assert f"  {step_line(STEP)}  mem {memory_text(MEMORY)}\n" in printed
    for event in (EVAL, OOM, FAILED):
        assert f"  {describe(event)}\n" in printed
    assert "memory at step" not in printed, "the step's memory is on its line, not a second one"
    assert "GiB" not in printed


def test_foreground_train_prints_the_shared_lines() -> None:
    from studio.cli.train import ConsolePrinter

    out = io.StringIO()
    printer = ConsolePrinter(out=out, err=io.StringIO())
    for event in (MEMORY, STEP, EVAL, OOM, FAILED):
        printer(event)
    assert out.getvalue().splitlines() == [
        f"{step_line(STEP)}  mem {memory_text(MEMORY)}", describe(EVAL), describe(OOM), describe(FAILED)]


def test_the_model_loaded_line_says_which_training_path_the_run_takes() -> None:
    """`studio train` and `studio attach` print ModelLoaded through describe(): the path and why;
    an event log written before the path was recorded reads as before."""
    loaded = dict(base_model="Qwen/Qwen3-8B", device="cuda", dtype="bfloat16", quantization="nf4",
                  total_params=8_000_000, trainable_params=40_000, load_seconds=12.0)
    fast = describe(ev.ModelLoaded(**loaded, path="fast", path_reason="fused 4-bit LoRA products"))
    assert fast.endswith("; fast path: fused 4-bit LoRA products")
    plain = describe(ev.ModelLoaded(**loaded, path="plain", path_reason="not on a CUDA device"))
    assert plain.endswith("; plain path: not on a CUDA device")
    assert "path" not in describe(ev.ModelLoaded(**loaded))
    state = fold([ev.ModelLoaded(**loaded, path="plain", path_reason="DoRA adapters")])
    assert state.path == "plain path: DoRA adapters"  # the training pane's words: why not fast
    assert fold([ev.ModelLoaded(**loaded, path="fast", path_reason="fused LoRA products")]).path == "fast path"
