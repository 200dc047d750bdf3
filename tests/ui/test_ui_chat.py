"""The chat pane in the real app: what it asks the worker, and how it shows the answers.

The worker is played by the test (it reads the Generate commands the pane sent and answers with
events), so these run in a second; the real worker is driven in test_ui_training.py's live test.
"""

from __future__ import annotations

import json

import pytest
from helpers.ui import PlayedWorker, events_drawn, panes_mounted

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, create_run
from studio.ui.app import StudioApp
from studio.ui.panes.chat import NO_ADAPTER, ChatPane

SIZE = (110, 34)
pytestmark = pytest.mark.anyio


def studio(config: RunConfig, run: RunDir | None = None) -> tuple[StudioApp, PlayedWorker]:
    """The real app on the chat pane, its worker played by the test."""
    app = StudioApp(config, run=run, settings=False, initial_pane="chat")
    return app, PlayedWorker(app)


def generates(worker: PlayedWorker) -> list[ev.Generate]:
    return [c for c in worker.sent if isinstance(c, ev.Generate)]


def text_of(app: StudioApp, widget_id: str) -> str:
    return str(app.query_one(widget_id).render())


async def ask(pilot, text: str) -> None:
    pilot.app.query_one("#chat-prompt").focus()
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")
    await pilot.pause()


async def test_before_training_only_the_base_model_answers(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app, worker = studio(config)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        await ask(pilot, "reverse abc")
        assert len(worker.opened) == 1 and worker.opened[0][1] is True  # a run and its worker were started
        sent = generates(worker)
        assert [g.adapter for g in sent] == [False]
        assert sent[0].prompt == "reverse abc"  # the worker renders it with the run's template
        assert NO_ADAPTER in text_of(app, "#chat-tuned-text")
        rid = sent[0].request_id
        worker.feed([ev.GenerationStarted(request_id=rid), ev.TokenGenerated(request_id=rid, text="cb"),
                     ev.TokenGenerated(request_id="someone-else", text="zzz")])
        await events_drawn(pilot)
        assert "cb" in text_of(app, "#chat-base-text") and "zzz" not in text_of(app, "#chat-base-text")
        worker.feed([ev.TokenGenerated(request_id=rid, text="a"),
                     ev.GenerationFinished(request_id=rid, text="cba", new_tokens=3, tokens_per_s=42.5)])
        await events_drawn(pilot)
        assert text_of(app, "#chat-base-text") == "cba"
        assert "42.5 tok/s" in text_of(app, "#chat-base-speed")


async def test_after_training_two_streams_are_kept_apart(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    run = create_run(config)
    app, worker = studio(config, run)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        worker.feed([ev.StepLogged(step=1, total_steps=5, loss=1.0)])  # an adapter is being trained
        await events_drawn(pilot)
        await ask(pilot, "hello")
        base, tuned = generates(worker)
        assert (base.adapter, tuned.adapter) == (False, True)
        assert base.request_id != tuned.request_id and base.prompt == tuned.prompt
        worker.feed([ev.TokenGenerated(request_id=base.request_id, text="B1 "),
                     ev.TokenGenerated(request_id=tuned.request_id, text="T1 "),
                     ev.TokenGenerated(request_id=base.request_id, text="B2")])
        await events_drawn(pilot)
        assert text_of(app, "#chat-base-text").startswith("B1 B2")
        assert text_of(app, "#chat-tuned-text").startswith("T1")
        assert "streaming" in text_of(app, "#chat-tuned-speed")


async def test_generation_settings_are_sent_and_checked(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app, worker = studio(config, create_run(config))
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        app.query_one("#chat-max-tokens").value = "7"
        app.query_one("#chat-top-p").value = "0.5"
        app.query_one("#chat-greedy").value = False
        app.query_one("#chat-temperature").value = "0.8"
        await ask(pilot, "x")
        sent = generates(worker)[-1]
        assert (sent.max_new_tokens, sent.temperature, sent.top_p) == (7, 0.8, 0.5)
        await pilot.press("f6")  # greedy on: temperature 0 whatever the box says
        await ask(pilot, "y")
        assert generates(worker)[-1].temperature == 0.0
        app.query_one("#chat-max-tokens").value = "0"
        before = len(worker.sent)
        await ask(pilot, "z")
        assert len(worker.sent) == before
        assert "max new tokens > 0" in text_of(app, "#chat-status")


async def test_heldout_table_scores_both_models_and_saves(tmp_path):
    data = tmp_path / "pairs.jsonl"
    words = ["alpha", "bravo", "delta", "gamma", "omega", "sigma"]
    with open(data, "w") as fh:
        for i, word in enumerate(words * 2):
            split = 1 if i >= len(words) else 0
            fh.write(json.dumps({"instruction": "Reverse the word.", "input": word,
                                 "output": word[::-1], "split": split}) + "\n")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.data.path = str(data)
    run = create_run(config)
    (run.adapter_dir).mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")  # a saved adapter, as far as the pane looks
    app, worker = studio(config, run)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        app.query_one("#chat-heldout-n").value = "4"
        await pilot.press("f5")
        await pilot.pause(0.1)
        requests = [c for c in worker.sent if isinstance(c, ev.ScoreHeldOut)]
        assert len(requests) == 1 and requests[0].rows == 4 and requests[0].adapter
        assert not generates(worker)  # the worker answers the rows, not one Generate per row

        # Play the worker with the engine's own scorer: the fine-tune answers right, the base not.
        from studio.engine.evaluate import HeldOutScoring

        def generate(row: dict, adapter: bool, max_new_tokens: int | None) -> str:
            word = row["input"]  # the whole row goes to the model, input field included
            return word[::-1] if adapter else word

        scoring = HeldOutScoring(run, requests[0], generate, lambda e: worker.feed([e]))
        while not scoring.next_row():
            await pilot.pause(0.02)
        await events_drawn(pilot)  # every row's event handled (a fixed 0.3 s was short on a loaded CI machine)
        pane = app.query_one(ChatPane)
        totals = pane.totals()
        assert totals["tuned"].rows == totals["base"].rows == 4
        assert totals["tuned"].exact_match == 1.0 and totals["base"].exact_match == 0.0
        assert "fine-tuned: exact 100.0%" in text_of(app, "#chat-heldout-totals")
        assert "eval.json" in text_of(app, "#chat-status")
        saved = json.loads((run.path / "eval.json").read_text())
        assert saved["fine_tuned"]["exact_match"] > saved["base"]["exact_match"]
        assert saved["split"] == "validation"  # no test split in this data
        assert saved["results"][0]["target"] == "ahpla"  # validation rows, in order
        assert (run.path / "eval.csv").read_text().startswith("instruction,input,target,base_answer")


async def test_the_status_line_learns_of_the_adapter_without_a_question(tmp_path):
    """A run trained (and stopped, saving its adapter) while the chat pane was open: its line says
    the adapter is ready at once, not only after the next question."""
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app, worker = studio(config, create_run(config))
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        assert "no adapter yet" in text_of(app, "#chat-status")
        worker.feed([ev.RunStarted(total_steps=10), ev.StepLogged(step=1, total_steps=10, loss=2.0),
                     ev.TrainingFinished(step=1, stopped=True, adapter_path=str(app.current_run.adapter_dir))])
        await events_drawn(pilot)
        assert "adapter ready" in text_of(app, "#chat-status")
        assert NO_ADAPTER not in text_of(app, "#chat-tuned-text")
