"""A preference run in the TUI: the dataset row shows chosen | rejected with the difference marked,
lint flags identical pairs and empty sides, the template pane renders both texts, and the held-out
table shows which answer each model prefers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ui import PlayedWorker, events_drawn, panes_mounted, settle, workdir
from textual.widgets import DataTable, Static

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import create_run
from studio.ui.app import StudioApp
from studio.ui.panes.chat import ChatPane
from studio.ui.widgets.loss_plot import LearningRatePlot
from studio.ui.widgets.pair_view import PairView
from studio.ui.widgets.preference_plot import PreferencePlot

pytestmark = pytest.mark.anyio
SIZE = (140, 40)


def _config(data: Path, out: Path | None = None) -> RunConfig:
    config = RunConfig(output_dir=str(out or data.parent / "runs"))
    config.model.base_model = "tok"
    config.data.path = str(data)
    config.trainer.method = "dpo"
    config.prompt.template, config.prompt.response_field = "Q: {prompt}\nA: {chosen}", "chosen"
    return config


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_dataset_and_template_panes_show_both_answers_and_lint_the_pairs(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    data = _write(tmp_path / "pairs.jsonl", [
        {"prompt": "Say hi", "chosen": "Hello there friend", "rejected": "Go away friend"},
        {"prompt": "Same", "chosen": "twice  over", "rejected": "twice over"},
        {"prompt": "Empty", "chosen": "something", "rejected": ""},
    ])
    app = StudioApp(_config(data), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pair = app.query_one(PairView)
        assert pair.display
        chosen = pair.query_one(".pair-chosen", Static).render()
        rejected = pair.query_one(".pair-rejected", Static).render()
        assert "Hello there friend" in chosen.plain and "Go away friend" in rejected.plain

        def marked(text) -> set[str]:
            return {text.plain[s.start:s.end].strip() for s in text.spans if "reverse" in str(s.style)}

        assert marked(chosen) == {"Hello", "there"} and marked(rejected) == {"Go", "away"}
        lint = str(app.query_one("#lint-summary", Static).render())
        assert "1 identical" in lint and "1 empty rejected" in lint and "empty output" not in lint

        await pilot.press("2")
        await settle(pilot, rounds=1)
        render = str(app.query_one("#template-render", Static).render())
        assert "✓ chosen\nQ: Say hi\nA: Hello there friend" in render
        assert "✗ rejected\nQ: Say hi\nA: Go away friend" in render


async def test_heldout_table_shows_each_models_preference(tmp_path):
    data = _write(tmp_path / "pairs.jsonl", [
        {"prompt": f"p{i}", "chosen": f"GOOD {i}", "rejected": f"bad {i}", "split": 1 if i >= 4 else 0}
        for i in range(8)])
    config = _config(data)
    run = create_run(config)
    run.adapter_dir.mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    app = StudioApp(config, run=run, settings=False, initial_pane="chat")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        app.query_one("#chat-heldout-n").value = "4"
        await pilot.press("f5")
        await pilot.pause(0.1)
        request = next(c for c in worker.sent if isinstance(c, ev.ScoreHeldOut))
        from studio.engine.evaluate import HeldOutScoring

        # The base prefers the chosen answer of the first pair only; the fine-tune of all.
        def margin(row: dict, adapter: bool) -> float:
            return 2.5 if adapter else (1.0 if row["prompt"] == "p4" else -3.0)

        scoring = HeldOutScoring(run, request, lambda row, adapter, n: "GOOD", lambda e: worker.feed([e]),
                                 margin=margin)
        while not scoring.next_row():
            await pilot.pause(0.02)
        await pilot.pause(0.3)
        table = app.query_one("#chat-heldout-table", DataTable)
        labels = [str(c.label) for c in table.ordered_columns]
        assert labels[-2:] == ["rejected", "prefers chosen: base → tuned"]
        first, second = table.get_row_at(0), table.get_row_at(1)
        assert first[-2:] == ["bad 4", "✓ +1.0 → ✓ +2.5"] and second[-1] == "✗ -3.0 → ✓ +2.5"
        totals = str(app.query_one("#chat-heldout-totals", Static).render())
        assert "prefers chosen: base 25% → fine-tuned 100%" in totals
        assert app.query_one(ChatPane).heldout[0].margins == {"base": 1.0, "tuned": 2.5}
        saved = json.loads((run.path / "eval.json").read_text())
        assert saved["preference"] == {"base_accuracy": 0.25, "fine_tuned_accuracy": 1.0}


async def test_training_pane_plots_the_preference_in_place_of_the_learning_rate(tmp_path):
    data = _write(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 4)
    config = _config(data)
    run = create_run(config)
    app = StudioApp(config, run=run, settings=False, initial_pane="training")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        assert app.query_one(LearningRatePlot).display
        assert not any(p.display for p in app.query(PreferencePlot))
        events: list[ev.Event] = [ev.RunStarted(run_id=run.id, total_steps=20)]
        for step in range(1, 11):
            events.append(ev.StepLogged(step=step, total_steps=20, loss=0.7 - step / 50, learning_rate=1e-4))
            events.append(ev.PreferenceLogged(step=step, method="dpo", loss=0.7 - step / 50, reward_margin=step / 5,
                                              chosen_logp=-20.0, rejected_logp=-20.0 - step, accuracy=0.9, pairs=4))
        events.append(ev.PreferenceLogged(step=10, split="validation", method="dpo", loss=0.4, reward_margin=1.5,
                                          chosen_logp=-21.0, rejected_logp=-30.0, accuracy=0.75, pairs=4))
        worker.feed(events)
        await events_drawn(pilot)
        assert not app.query_one(LearningRatePlot).display
        logps, margin = app.query(PreferencePlot)
        assert logps.display and margin.display
        assert logps._figure.title == "log p -20.0 / -30.0" and len(logps._figure.curves) == 2
        assert margin._figure.title == "margin 2.00 · acc 90% (eval 75%)"
        line = str(app.query_one("#training-eval", Static).render())
        assert line.startswith("dpo eval at step 10: loss 0.4000  validation accuracy 75.0%")
