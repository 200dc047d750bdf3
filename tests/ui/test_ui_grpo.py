"""A GRPO run in the TUI: the training pane plots each reward, the total, the spread within groups,
the completion length and the KL in place of the loss; the group view shows the newest sampled
group best first with each reward's score, live, and goes back through the run's history with
[ and ]; the template pane shows a prompt as the policy reads it and what the rewards receive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.ui import PlayedWorker, events_drawn, panes_mounted, settle, workdir
from textual.widgets import DataTable, Static

from studio.core import events as ev
from studio.core.config import RewardConfig, RunConfig
from studio.core.runs import create_run
from studio.ui.app import StudioApp
from studio.ui.widgets.group_view import GroupView
from studio.ui.widgets.grpo_plot import GrpoPlot
from studio.ui.widgets.loss_plot import LearningRatePlot, LossPlot

pytestmark = pytest.mark.anyio
SIZE = (150, 50)


def _config(data: Path) -> RunConfig:
    config = RunConfig(output_dir=str(data.parent / "runs"))
    config.model.base_model = "tok"
    config.data.path = str(data)
    config.trainer.method = "grpo"
    config.prompt.template = "Q: {question}\nA:"
    config.grpo.rewards = [RewardConfig(name="number_match", column="answer"),
                           RewardConfig(name="rewards.py:short")]
    return config


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _group(step: int) -> ev.GrpoGroupSampled:
    texts = [(f"it is {step}", 1.0, 0.5), ("no idea", 0.0, 1.0), (f"{step}", 1.0, 1.0), ("maybe 3", 0.0, None)]
    completions = [{"text": text, "total": exact + (short or 0.0), "scores": {"number_match": exact, "short": short},
                    "advantage": 0.0, "tokens": len(text), "stopped": text != "no idea"}
                   for text, exact, short in texts]
    return ev.GrpoGroupSampled(step=step, prompt=f"Q: what is {step}?\nA:", completions=completions)


def _step(step: int) -> list[ev.Event]:
    return [ev.GrpoStepLogged(step=step, rewards={"number_match": step / 20, "short": 0.5}, reward=0.5 + step / 20,
                              reward_std=0.3, zero_spread=0.25, completion_length=20.0 - step, truncated=0.1,
                              kl=0.001 * step, completions=32, prompts=4),
            _group(step),
            ev.StepLogged(step=step, total_steps=20, loss=0.0, learning_rate=1e-5)]


async def test_training_pane_plots_rewards_and_browses_the_sampled_groups(tmp_path: Path) -> None:
    data = _write(tmp_path / "q.jsonl", [{"question": "2+2?", "answer": 4}] * 4)
    config = _config(data)
    run = create_run(config)
    app = StudioApp(config, run=run, settings=False, initial_pane="training")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)
        assert app.query_one(LossPlot).display and not app.query_one(GroupView).display
        events: list[ev.Event] = [ev.RunStarted(run_id=run.id, total_steps=20),
                                  ev.GrpoStepLogged(step=0, split="validation", rewards={"number_match": 0.1},
                                                    reward=0.1, completions=4, prompts=4)]
        for step in range(1, 11):
            events += _step(step)
        worker.feed(events)
        await events_drawn(pilot)
        assert not app.query_one(LossPlot).display and not app.query_one(LearningRatePlot).display
        plots = {p.kind: p for p in app.query(GrpoPlot)}
        assert all(p.display for p in plots.values())
        rewards = plots["rewards"]._figure
        assert [c[2] for c in rewards.curves] == ["number_match", "short", "total", "held-out"]
        assert rewards.title == "reward 1.000 (held-out 0.100)"
        assert plots["spread"]._figure.title == "spread 0.300 · flat 25%"
        assert plots["length"]._figure.title == "length 10.0 · cut 10%"
        assert plots["kl"]._figure.title == "kl 0.0100"
        line = str(app.query_one("#training-eval", Static).render())
        assert line.startswith("grpo eval of the base model (step 0): reward 0.100 (number_match 0.100)")

        view = app.query_one(GroupView)
        table = view.query_one(DataTable)

        def title() -> str:
            return str(view.query_one("#group-title", Static).render())

        assert title().startswith("sampled group at step 10 (the newest")
        assert [str(c.label) for c in table.ordered_columns] == ["total", "number_match", "short", "adv", "tokens",
                                                                 "completion"]
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert [r[0] for r in rows] == ["2.000", "1.500", "1.000", "0.000"]  # best first
        assert rows[0][-1] == "10" and rows[2][-1] == "no idea" and rows[2][-2] == "7 ✂" and rows[3][2] == "-"

        await pilot.press("[")
        await pilot.press("[")
        await pilot.pause(0.1)
        assert title().startswith("sampled group at step 8 (8 of 10")
        worker.feed(_step(11))  # a new step while browsing: the view stays where it is
        await events_drawn(pilot)
        assert title().startswith("sampled group at step 8 (8 of 11")
        await pilot.press("]")
        await pilot.pause(0.1)
        assert title().startswith("sampled group at step 9 (9 of 11")
        await pilot.press("]", "]")
        await pilot.pause(0.1)
        assert title().startswith("sampled group at step 11 (the newest")
        worker.feed(_step(12))
        await events_drawn(pilot)
        assert title().startswith("sampled group at step 12 (the newest")

        # A resume from the checkpoint at step 5 redoes the later steps: their groups go.
        worker.feed([ev.RunStarted(run_id=run.id, total_steps=20, resumed_from_step=5), *_step(6)])
        await events_drawn(pilot)
        assert title().startswith("sampled group at step 6 (the newest") and len(app.query_one(
            "TrainingPane").state.grpo.groups) == 6


async def test_dataset_and_template_panes_show_a_grpo_prompt_as_the_policy_reads_it(tmp_path: Path, monkeypatch) -> None:
    workdir(tmp_path, monkeypatch)
    data = _write(tmp_path / "q.jsonl", [{"question": "What is 6 x 7?", "answer": 42, "source": "tables"}] * 3)
    config = _config(data)
    config.data.max_seq_length, config.grpo.max_completion_length = 300, 256
    app = StudioApp(config, settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        lint = str(app.query_one("#lint-summary", Static).render())
        # No answer column and three rows with one prompt: right for GRPO, so lint says nothing of it.
        assert "empty output" not in lint and "different answers" not in lint, lint
        await pilot.press("2")
        await settle(pilot, rounds=1)
        render = str(app.query_one("#template-render", Static).render())
        assert "the policy reads" in render and "(room 44: data.max_seq_length 300 less grpo.max_completion_length 256)" \
            in render and "then writes 8 completions" in render
        assert "Q: What is 6 x 7?\nA:▌the policy writes from here (up to 256 tokens)" in render
        assert "the rewards also get: question='What is 6 x 7?'  answer=42  source='tables'" in render
        settings = str(app.query_one("#template-settings", Static).render())
        assert settings == "GRPO: 8 completions of up to 256 tokens · max 300 tokens"
        counts = str(app.query_one("#template-counts", Static).render())
        assert "a GRPO prompt: the policy writes the answer" in counts
        lint = str(app.query_one("#template-lint", Static).render())
        assert "template looks right" in lint  # no response placeholder is what a GRPO template wants
