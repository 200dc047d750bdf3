"""Events as text (studio/core/report.py): units, and the same words in the CLI and the TUI."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.report import describe, format_bytes, format_duration, memory_text, step_line
from studio.core.runs import create_run
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
WARNED = ev.WorkerFailed(kind="config", fatal=False, message="using torch AdamW")


def test_sizes_are_decimal_gigabytes_like_the_gauge() -> None:
    from studio.core.gpus import GB as gauge_gb

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


def test_attach_prints_the_shared_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    log = EventLog(run.events_path)
    for event in (STEP, MEMORY, EVAL, OOM, FAILED):
        log.append(event)
    log.close()
    assert studio(["attach", run.id, "--runs-dir", str(tmp_path / "runs")]) == 1  # failed: nothing to follow
    printed = capsys.readouterr().out
    for event in (STEP, MEMORY, EVAL, OOM, FAILED):
        assert f"  {describe(event)}\n" in printed
    assert "GiB" not in printed


def test_foreground_train_prints_the_shared_lines() -> None:
    from studio.worker.cli_train import ConsolePrinter

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
