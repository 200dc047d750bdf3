"""The exported adapter's model card: metadata the Hub reads, the settings, the held-out table, the curve."""

from __future__ import annotations

from pathlib import Path

import pytest

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.export.model_card import model_card

REPORT = {
    "rows": 2, "split": "test",
    "base": {"exact_match": 0.0, "similarity": 0.41}, "fine_tuned": {"exact_match": 0.5, "similarity": 0.83},
    "results": [
        {"target": "e-n-o-t-s", "base": "s-t-o-n-e", "tuned": "e-n-o-t-s", "base_exact": False, "tuned_exact": True},
        {"target": "a|b", "base": "x", "tuned": "b|a", "base_exact": False, "tuned_exact": False},
    ],
}


def test_card_for_a_hub_model_with_an_eval_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    config = RunConfig(name="reverse-words")
    config.data.path = "data/reverse.jsonl"
    events = [ev.RunStarted(train_rows=2920, eval_rows=40)]
    events += [ev.StepLogged(step=s, loss=3.0 / s) for s in range(1, 11)]
    events += [ev.EvalLogged(step=10, loss=0.5), ev.TrainingFinished(step=10, train_loss=0.3, best_eval_loss=0.5)]
    card, chart = model_card(config, "run-1", "HuggingFaceTB/SmolLM2-135M-Instruct", events, tmp_path, REPORT,
                             "### Q:\n{instruction}\n### A:\n{output}")
    assert card.startswith('---\nbase_model: "HuggingFaceTB/SmolLM2-135M-Instruct"\nlibrary_name: "peft"\n')
    assert "# reverse-words" in card and "(https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in card
    assert "- 2920 training rows, 40 validation rows" in card
    assert "- 10 optimizer steps, final training loss 0.3000, best validation loss 0.5000" in card
    assert "| e-n-o-t-s | s-t-o-n-e | ✓ e-n-o-t-s |" in card
    assert "| a\\|b | x | b\\|a |" in card, "pipes in answers are escaped so the table keeps its columns"
    assert "exact match went from 0.0% to 50.0% and similarity from 0.41 to 0.83" in card
    assert chart == "png" and (tmp_path / "loss.png").stat().st_size > 1000
    assert "```text\n### Q:\n{instruction}\n### A:\n{output}\n```" in card


def test_card_without_eval_says_how_to_get_it(tmp_path: Path) -> None:
    card, chart = model_card(RunConfig(), "run-2", "/models/mine", [], tmp_path, None, "{instruction}{output}")
    assert "base_model" not in card and "`/models/mine`" in card
    assert "run `studio eval run-2` and export again" in card and chart == "none"
