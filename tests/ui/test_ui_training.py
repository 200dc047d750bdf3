"""The training pane: controls, batched redraws, failures in place, and (live) the real worker.

Most tests run the real app on the training pane and play the worker (commands recorded, events
fed to the app's follower queue); the live test at the end trains the tiny model through the real
worker from the pane's keys.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from helpers import DATA
from helpers.ui import PlayedWorker, events_drawn, panes_mounted

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run, iter_events
from studio.ui.app import StudioApp
from studio.ui.panes.training import ConfirmScreen, TrainingPane
from studio.ui.widgets.loss_plot import LossPlot

pytestmark = pytest.mark.anyio
SIZE = (110, 34)
RECORDED = list(iter_events(DATA / "recorded_events.jsonl"))
"""A real run: `studio train` on the tiny model (tests/ui/test_ui_training.py's tiny_config, 80 steps)."""
RECORDED_STEPS = [e.step for e in RECORDED if isinstance(e, ev.StepLogged)]
RECORDED_EVALS = [e for e in RECORDED if isinstance(e, ev.EvalLogged)]


def text_of(app, selector: str) -> str:
    return str(app.query_one(selector).render())


def studio(config: RunConfig, run=None) -> tuple[StudioApp, PlayedWorker]:
    """The real app on the training pane, its worker played by the test."""
    app = StudioApp(config, run=run, settings=False, initial_pane="training")
    return app, PlayedWorker(app)


def harness(tmp_path, run: bool = True) -> tuple[StudioApp, PlayedWorker]:
    """The app following a fresh run (events need one), or none when ``run`` is False."""
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    return studio(config, create_run(config) if run else None)


async def pane_ready(pilot) -> TrainingPane:
    """The training pane, once every pane is mounted (they mount just after the first frame; an
    app quitting while one is still composing fails in Textual's TabbedContent)."""
    await panes_mounted(pilot)
    return pilot.app.query_one(TrainingPane)


async def test_recorded_history_is_drawn_in_full(tmp_path):
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pane_ready(pilot)
        worker.feed(RECORDED)
        await events_drawn(pilot)
        last = RECORDED_STEPS[-1]
        assert f"step {last}/{last}" in text_of(app, "#training-progress-line")
        assert "finished" in text_of(app, "#training-status")
        assert "perplexity" in text_of(app, "#training-eval") and "token accuracy" in text_of(app, "#training-eval")
        assert "memory (cpu)" in text_of(app, "#training-memory")
        # raw + smoothed train loss at every step, and every eval
        assert app.query_one(LossPlot).points_drawn == 2 * len(RECORDED_STEPS) + len(RECORDED_EVALS)


async def test_a_flood_of_events_is_drawn_a_few_times_a_second(tmp_path):
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        pane = await pane_ready(pilot)
        await pilot.pause(0.3)
        before = pane.redraws
        started = time.monotonic()
        for event in RECORDED:  # one event at a time: the worst case
            worker.feed([event])
            await pilot.pause(0.005)
        await events_drawn(pilot)
        seconds = time.monotonic() - started
        assert pane.state.step == RECORDED_STEPS[-1]  # nothing lost...
        assert pane.redraws - before <= 4 * seconds + 2  # ...but at most ~4 redraws a second
        assert pane.redraws - before < len(RECORDED) / 3


async def test_start_creates_a_run_and_starts_its_worker(tmp_path):
    app, worker = harness(tmp_path, run=False)
    async with app.run_test(size=SIZE) as pilot:
        (await pane_ready(pilot)).focus()
        await pilot.press("s")
        await pilot.pause()
        (run, start_worker), = worker.opened
        assert start_worker and run.config_path.exists() and run.path.parent == tmp_path / "runs"
        assert isinstance(worker.sent[-1], ev.StartTraining)
        await pilot.press("s")  # a second press while loading does nothing
        assert len(worker.opened) == 1


async def test_pause_resume_and_stop_with_confirmation(tmp_path):
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        (await pane_ready(pilot)).focus()
        worker.feed([ev.RunStarted(total_steps=10), ev.StepLogged(step=1, total_steps=10, loss=2.0)])
        await events_drawn(pilot)
        await pilot.press("r")  # not paused: resume is not offered
        assert not worker.sent
        await pilot.press("p")
        assert isinstance(worker.sent[-1], ev.Pause)
        worker.feed([ev.TrainingPaused(step=1)])
        await events_drawn(pilot)
        assert "paused" in text_of(app, "#training-status")
        await pilot.press("r")
        assert isinstance(worker.sent[-1], ev.Resume)
        worker.feed([ev.TrainingResumed(step=1)])
        await events_drawn(pilot)
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # changed my mind: nothing sent
        assert not isinstance(worker.sent[-1], ev.Stop) and not isinstance(app.screen, ConfirmScreen)
        await pilot.press("x")
        await pilot.press("y")
        assert isinstance(worker.sent[-1], ev.Stop)


async def test_pause_and_stop_say_so_at_once_until_the_step_ends(tmp_path):
    """The worker pauses or stops after the current step (seconds on a CPU): the status line says
    so the moment the key is pressed, and Pause is not offered twice meanwhile."""
    from textual.widgets import Button

    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        (await pane_ready(pilot)).focus()
        worker.feed([ev.RunStarted(total_steps=10), ev.StepLogged(step=1, total_steps=10, loss=2.0)])
        await events_drawn(pilot)
        await pilot.press("p")
        assert "pausing after this step" in text_of(app, "#training-status")
        assert app.query_one("#training-pause", Button).disabled
        await pilot.press("p")
        assert sum(isinstance(c, ev.Pause) for c in worker.sent) == 1
        worker.feed([ev.TrainingPaused(step=1)])
        await events_drawn(pilot)
        status = text_of(app, "#training-status")
        assert "paused" in status and "pausing" not in status
        await pilot.press("x", "y")
        assert "stopping after this step" in text_of(app, "#training-status")
        worker.feed([ev.TrainingFinished(step=1, stopped=True)])
        await events_drawn(pilot)
        assert "stopping" not in text_of(app, "#training-status")


async def test_failures_are_shown_in_place_and_the_ui_stays(tmp_path):
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pane_ready(pilot)
        worker.feed([ev.RunStarted(total_steps=10, micro_batch_size=8, gradient_accumulation_steps=2),
                  ev.BatchSizeReduced(step=2, old_micro_batch_size=8, micro_batch_size=4,
                                      gradient_accumulation_steps=4)])
        # The pane redraws a few times a second: wait for the redraw rather than a fixed pause.
        await wait_until(pilot, lambda: "out of memory; micro-batch 8 -> 4" in text_of(app, "#training-alert"),
                         10, "the OOM notice")
        assert "micro-batch 4 × 4" in text_of(app, "#training-status")
        worker.feed([ev.WorkerFailed(kind="data", message="train.jsonl line 12: 'output' is empty; fill it or "
                                  "drop the row")])
        await wait_until(pilot, lambda: "Data error: train.jsonl line 12" in text_of(app, "#training-alert"),
                         10, "the data error")
        assert app.query_one("#training-alert").has_class("failed")
        assert app.is_running


CPU_NOTE = ("no CUDA GPU: loading the base in float32 instead of 4-bit (quantization only saves GPU memory; on a "
            "CPU it is slower); set quantization.on_cpu: keep to quantize anyway")


@pytest.mark.parametrize("written", ["now", "before"])
async def test_a_warning_is_shown_once_and_as_a_warning(tmp_path, written):
    """The CPU note while the model loads: one warning line in the alert, not a failure headline
    beside it. ``before``: as a run made by an older Studio logged it (a non-fatal WorkerFailed)."""
    old = {"type": "WorkerFailed", "seq": 4, "time": 1.0, "kind": "config", "message": CPU_NOTE, "detail": "",
           "fatal": False}
    note = ev.WarningRaised(kind="config", message=CPU_NOTE) if written == "now" else ev.from_json(json.dumps(old))
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pane_ready(pilot)
        worker.feed([ev.ModelLoading(stage="loading the weights", fraction=0.2), note,
                     ev.ModelLoading(stage="attaching LoRA", fraction=0.85)])
        await wait_until(pilot, lambda: "attaching LoRA" in text_of(app, "#training-status"), 10, "the loading")
        alert = text_of(app, "#training-alert")
        assert alert.count("no CUDA GPU") == 1, alert
        assert alert.startswith("warning (config): no CUDA GPU") and "Warning" not in alert
        assert not app.query_one("#training-alert").has_class("failed")


async def test_the_status_line_names_the_loading_stage_once(tmp_path):
    """The worker's stages say what they do ("loading the weights"): the line must not stutter."""
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pane_ready(pilot)
        worker.feed([ev.ModelLoading(stage="loading the weights", fraction=0.2)])
        await events_drawn(pilot)
        status = text_of(app, "#training-status")
        assert "loading the weights 20%" in status
        assert "loading loading" not in status


async def test_the_status_line_says_which_training_path_the_run_takes(tmp_path):
    """ModelLoaded's path: "fast path", or "plain path" with what rules the fast one out."""
    app, worker = harness(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pane_ready(pilot)
        worker.feed([ev.ModelLoading(stage="loading the weights", fraction=0.2),
                     ev.ModelLoaded(base_model="tiny", device="cpu", path="plain", path_reason="not on a CUDA device")])
        await events_drawn(pilot)
        assert "plain path: not on a CUDA device" in text_of(app, "#training-status")
        worker.feed([ev.ModelLoaded(base_model="tiny", device="cuda", path="fast", path_reason="fused LoRA products")])
        await events_drawn(pilot)
        status = text_of(app, "#training-status")
        assert "fast path" in status and "plain path" not in status


async def test_export_asks_the_worker_for_each_format(tmp_path):
    """Export offers what `studio export` does (adapter with its model card, merged, GGUF), each done
    by the worker; the pane shows the worker's answer."""
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    run = create_run(config)
    run.adapter_dir.mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    app, worker = studio(config, run)
    async with app.run_test(size=SIZE) as pilot:
        (await pane_ready(pilot)).focus()
        worker.feed([ev.TrainingFinished(step=5, adapter_path=str(run.adapter_dir))])
        await events_drawn(pilot)
        for button, fmt in (("#export-adapter", "adapter"), ("#export-merged", "merged"), ("#export-gguf", "gguf")):
            await pilot.press("e")
            dest = tmp_path / fmt
            app.screen.query_one("#export-path").value = str(dest)
            await pilot.click(button)
            await pilot.pause()
            assert worker.sent[-1] == ev.ExportRun(path=str(dest), format=fmt, quant="f16", dtype="bfloat16")
        worker.feed([ev.ExportFinished(path=str(tmp_path / "adapter"), ok=True, seconds=2.0)])
        await events_drawn(pilot)
        assert f"exported to {tmp_path / 'adapter'}" in text_of(app, "#training-alert")
        (tmp_path / "taken").mkdir()
        await pilot.press("e")
        app.screen.query_one("#export-path").value = str(tmp_path / "taken")
        await pilot.click("#export-adapter")
        await pilot.pause()
        assert worker.sent[-1].format == "gguf"  # an existing folder is refused before anything is sent


# --------------------------------------------------------------------------- the real worker


def tiny_config(tmp_path: Path) -> RunConfig:
    """The tiny Llama on "reverse the letters" pairs, set to learn in a few dozen steps on CPU."""
    import json

    from studio.engine.tiny import build_tiny_model, reverse_word_rows

    data = tmp_path / "reverse.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in reverse_word_rows(300)))
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(build_tiny_model())
    config.quantization.bits = None
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    config.lora.target_modules = ["q_proj", "v_proj"]
    config.prompt.template = "{instruction} {input}\n### Response:\n{output}"
    config.data.path, config.data.max_seq_length = str(data), 48
    t = config.trainer
    t.learning_rate, t.max_steps, t.micro_batch_size, t.effective_batch_size = 1e-2, 300, 8, 8
    t.warmup_fraction, t.eval_interval, t.eval_max_rows, t.checkpoint_interval = 0.02, 20, 30, 20
    t.gradient_checkpointing = False
    config.generation.max_new_tokens, config.generation.temperature = 8, 0.0
    return config


async def wait_until(pilot, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.1)


async def show_pane(app, pilot, key: str, kind):
    """Switch panes by key and wait until the pane is mounted (hidden panes mount after the first
    frame) and holds the focus, so that the next key press reaches it."""
    await pilot.press(key)

    def ready() -> bool:
        found = app.query(kind)
        return bool(found) and found.first().is_mounted and app.focused is not None \
            and found.first() in app.focused.ancestors_with_self

    await wait_until(pilot, ready, 30, f"the {kind.__name__}")
    return app.query_one(kind)


@pytest.mark.slow
async def test_live_train_pause_resume_reopen_stop_chat_heldout(tmp_path, monkeypatch):
    import os
    import signal

    from studio.ui.app import StudioApp
    from studio.ui.panes.chat import ChatPane

    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "settings"))
    config = tiny_config(tmp_path)
    # The stop has to come before the run's end: on a fast card (an H200) the tiny model's 300 steps
    # were over before the re-opened UI pressed it. The same 6 warmup steps, a longer run.
    config.trainer.max_steps, config.trainer.warmup_fraction = 20_000, 6 / 20_000
    run = None
    try:
        # 1. Start from the pane's key; watch the steps and the plot advance; pause and resume.
        app = StudioApp(config, settings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = await show_pane(app, pilot, "4", TrainingPane)
            await pilot.press("s")
            await wait_until(pilot, lambda: pane.state.step >= 3, 120, "the first steps")
            run = app.current_run
            assert run is not None and run.worker_pid() is not None
            await pilot.pause(0.6)
            assert app.query_one(LossPlot).points_drawn > 0
            # The line is repainted a few times a second while steps keep coming: it shows a step
            # that has been reached, never one from the future.
            shown = re.search(r"step (\d+)", text_of(app, "#training-progress-line"))
            assert shown is not None and 3 <= int(shown.group(1)) <= pane.state.step
            await pilot.press("p")
            await wait_until(pilot, lambda: pane.state.status == "paused", 30, "the pause")
            paused_at = pane.state.step
            await pilot.pause(1.0)
            assert pane.state.step == paused_at  # no steps while paused
            await pilot.press("r")
            await wait_until(pilot, lambda: pane.state.step > paused_at, 30, "steps after resuming")
        # 2. The UI quit; the worker goes on training.
        steps_at_quit = sum(isinstance(e, ev.StepLogged) for e in iter_events(run.events_path))
        await_steps = time.monotonic() + 30
        while sum(isinstance(e, ev.StepLogged) for e in iter_events(run.events_path)) <= steps_at_quit + 2:
            assert time.monotonic() < await_steps, "the worker stopped training when the UI quit"
            time.sleep(0.2)

        # 3. Re-open: the whole loss history is redrawn, then it follows live; stop with confirmation.
        app = StudioApp(config, run=run, settings=False)
        async with app.run_test(size=(120, 40)) as pilot:
            pane = await show_pane(app, pilot, "4", TrainingPane)
            await wait_until(pilot, lambda: pane.state.step > steps_at_quit + 2, 30, "the replayed history")
            assert pane.state.loss.steps[:3] == [1, 2, 3]  # from the first step, not from the re-open
            await wait_until(pilot, lambda: pane.state.step >= 25, 120, "25 steps")
            await pilot.press("x")
            await pilot.press("y")
            await wait_until(pilot, lambda: pane.state.status == "stopped", 60, "the stop")
            assert run.adapter_dir.exists()
            logged = [e.step for e in iter_events(run.events_path) if isinstance(e, ev.StepLogged)]
            assert pane.state.loss.steps == sorted(set(logged))

            # 4. Chat after training: two different answers, streamed from the one worker.
            chat = await show_pane(app, pilot, "5", ChatPane)
            await pilot.pause(0.2)
            for ch in "d-o-g":
                await pilot.press(ch)
            await pilot.press("enter")
            await wait_until(pilot, lambda: len(chat.answers) == 2 and all(a.done for a in chat.answers.values()),
                             60, "both answers")
            base, tuned = (chat.answers[rid].text for rid in chat.sides)
            assert base != tuned
            await pilot.pause(0.3)  # the columns repaint on a 0.1 s timer
            assert "tok/s" in text_of(app, "#chat-base-speed") and "tok/s" in text_of(app, "#chat-tuned-speed")

            # 5. Held-out: both models over validation rows; the fine-tune scores higher.
            app.query_one("#chat-heldout-n").value = "4"
            await pilot.press("f5")
            # The worker saves eval.json, then reports HeldOutFinished: the pane says so once every row is in.
            await wait_until(pilot, lambda: (run.path / "eval.json").exists() and
                             "Held-out done" in text_of(app, "#chat-status"), 120, "the held-out table")
            totals = chat.totals()
            assert totals["tuned"].rows == totals["base"].rows == 4
            assert totals["tuned"].similarity > totals["base"].similarity
    finally:
        if run is not None and (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)
