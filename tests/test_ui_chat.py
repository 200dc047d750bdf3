"""The chat pane in a harness app: what it asks the worker, and how it shows the answers.

The worker is played by the test (it reads the Generate commands the pane sent and answers with
events), so these run in a second; the real worker is driven in test_ui_training.py's live test.
"""

from __future__ import annotations

import json

import pytest
from ui_part2_harness import PaneHarness

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run
from studio.ui.panes.chat import NO_ADAPTER, ChatPane

SIZE = (110, 34)
pytestmark = pytest.mark.anyio


def generates(app: PaneHarness) -> list[ev.Generate]:
    return [c for c in app.sent if isinstance(c, ev.Generate)]


def text_of(app: PaneHarness, widget_id: str) -> str:
    return str(app.query_one(widget_id).render())


async def ask(pilot, text: str) -> None:
    pilot.app.query_one("#chat-prompt").focus()
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")
    await pilot.pause()


async def test_before_training_only_the_base_model_answers(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app = PaneHarness(ChatPane, config)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "reverse abc")
        assert len(app.opened) == 1 and app.opened[0][1] is True  # a run and its worker were started
        sent = generates(app)
        assert [g.adapter for g in sent] == [False]
        assert sent[0].prompt == "reverse abc"  # the worker renders it with the run's template
        assert NO_ADAPTER in text_of(app, "#chat-tuned-text")
        rid = sent[0].request_id
        app.feed([ev.GenerationStarted(request_id=rid), ev.TokenGenerated(request_id=rid, text="cb"),
                  ev.TokenGenerated(request_id="someone-else", text="zzz")])
        await pilot.pause(0.2)
        assert "cb" in text_of(app, "#chat-base-text") and "zzz" not in text_of(app, "#chat-base-text")
        app.feed([ev.TokenGenerated(request_id=rid, text="a"),
                  ev.GenerationFinished(request_id=rid, text="cba", new_tokens=3, tokens_per_s=42.5)])
        await pilot.pause(0.2)
        assert text_of(app, "#chat-base-text") == "cba"
        assert "42.5 tok/s" in text_of(app, "#chat-base-speed")


async def test_after_training_two_streams_are_kept_apart(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    run = create_run(config)
    app = PaneHarness(ChatPane, config, run=run)
    async with app.run_test(size=SIZE) as pilot:
        app.feed([ev.StepLogged(step=1, total_steps=5, loss=1.0)])  # an adapter is being trained
        await ask(pilot, "hello")
        base, tuned = generates(app)
        assert (base.adapter, tuned.adapter) == (False, True)
        assert base.request_id != tuned.request_id and base.prompt == tuned.prompt
        app.feed([ev.TokenGenerated(request_id=base.request_id, text="B1 "),
                  ev.TokenGenerated(request_id=tuned.request_id, text="T1 "),
                  ev.TokenGenerated(request_id=base.request_id, text="B2")])
        await pilot.pause(0.2)
        assert text_of(app, "#chat-base-text").startswith("B1 B2")
        assert text_of(app, "#chat-tuned-text").startswith("T1")
        assert "streaming" in text_of(app, "#chat-tuned-speed")


async def test_generation_settings_are_sent_and_checked(tmp_path):
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    app = PaneHarness(ChatPane, config, run=create_run(config))
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#chat-max-tokens").value = "7"
        app.query_one("#chat-top-p").value = "0.5"
        app.query_one("#chat-greedy").value = False
        app.query_one("#chat-temperature").value = "0.8"
        await ask(pilot, "x")
        sent = generates(app)[-1]
        assert (sent.max_new_tokens, sent.temperature, sent.top_p) == (7, 0.8, 0.5)
        await pilot.press("f6")  # greedy on: temperature 0 whatever the box says
        await ask(pilot, "y")
        assert generates(app)[-1].temperature == 0.0
        app.query_one("#chat-max-tokens").value = "0"
        before = len(app.sent)
        await ask(pilot, "z")
        assert len(app.sent) == before
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
    app = PaneHarness(ChatPane, config, run=run)
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#chat-heldout-n").value = "4"
        await pilot.press("f5")
        await pilot.pause(0.1)
        requests = [c for c in app.sent if isinstance(c, ev.ScoreHeldOut)]
        assert len(requests) == 1 and requests[0].rows == 4 and requests[0].adapter
        assert not generates(app)  # the worker answers the rows, not one Generate per row

        # Play the worker with the engine's own scorer: the fine-tune answers right, the base not.
        from studio.engine.evaluate import HeldOutScoring

        def generate(row: dict, adapter: bool, max_new_tokens: int | None) -> str:
            word = row["input"]  # the whole row goes to the model, input field included
            return word[::-1] if adapter else word

        scoring = HeldOutScoring(run, requests[0], generate, lambda e: app.feed([e]))
        while not scoring.next_row():
            await pilot.pause(0.02)
        await pilot.pause(0.3)
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
