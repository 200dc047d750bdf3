"""The dataset and template panes show what core reads the data as: TRL's preference pairs and raw
text (with the prompt settings they train with), tool calls in a conversation, and a row that would
train on no token."""

from __future__ import annotations

import pytest
from helpers.ui import make_config, settle, workdir, write_rows
from textual.widgets import Select, Static

from studio.ui.app import StudioApp
from studio.ui.panes.dataset import DatasetPane

pytestmark = pytest.mark.anyio
SIZE = (140, 40)


def _page_label(app) -> str:
    return str(app.query_one("#dataset-page-label", Static).render())


async def test_trl_pairs_are_named_and_train_as_prompt_then_answer(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    write_rows(tmp_path / "pairs.jsonl", [{"prompt": f"Spell {w} loudly: ", "chosen": w.upper(), "rejected": w}
                                          for w in ("stone", "river", "cloud")])
    config = make_config(data="pairs.jsonl")
    config.trainer.method = "dpo"
    app = StudioApp(config, settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "preference pairs (TRL standard)" in _page_label(app)
        assert (app.config.prompt.template, app.config.prompt.response_field) == ("{prompt}{chosen}", "chosen")
        await pilot.press("2")
        await settle(pilot)
        render = str(app.query_one("#template-render", Static).render())
        assert "✓ chosen\nSpell stone loudly: STONE" in render and "✗ rejected\nSpell stone loudly: stone" in render
        # TRL's prompts carry their own separator: no lint about a missing one.
        assert "nothing separates" not in str(app.query_one("#template-lint", Static).render())


async def test_text_alone_is_raw_text_with_every_token_trained(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    write_rows(tmp_path / "docs.jsonl", [{"text": f"Chapter {i}. The river ran on."} for i in range(5)])
    app = StudioApp(make_config(data="docs.jsonl", max_len=8), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "raw text (continued pretraining: every token trained)" in _page_label(app)
        # Documents longer than max_seq_length are cut into blocks, not truncated: lint has nothing to say.
        assert "no problems found" in str(app.query_one("#lint-summary", Static).render())
        await pilot.press("2")
        await settle(pilot)
        assert app.query_one("#template-preset", Select).value == "text"
        counts = str(app.query_one("#template-counts", Static).render())
        assert "prompt 0 + response" in counts, "the whole document is response: every token is trained"
        assert "blocks of data.max_seq_length (8) tokens train it; nothing is cut" in counts
        assert "✂" not in counts
        assert "Chapter 0. The river ran on." in str(app.query_one("#template-render", Static).render())


async def test_a_row_that_trains_on_no_token_is_marked(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    write_rows(tmp_path / "rows.jsonl", [{"instruction": "Say hi", "input": "", "output": ""},
                                         {"instruction": "Say bye", "input": "", "output": "bye"}])
    app = StudioApp(make_config(data="rows.jsonl"), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        await settle(pilot)
        counts = str(app.query_one("#template-counts", Static).render())
        assert "✗ this row trains on no token: nothing is left to learn after the template" in counts
        pane = app.query_one(DatasetPane)
        pane.goto_row(1)
        await settle(pilot)
        await pilot.press("2")
        await settle(pilot)
        assert "trains on no token" not in str(app.query_one("#template-counts", Static).render())


async def test_a_tool_call_shows_in_the_row_view(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C."}]
    write_rows(tmp_path / "calls.jsonl", [{"messages": conversation}, {"messages": conversation[:1] + [
        {"role": "assistant", "content": "No idea."}]}])
    app = StudioApp(make_config(data="calls.jsonl"), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        app.query_one(DatasetPane).goto_row(0)
        await settle(pilot)
        shown = str(app.query_one("#dataset-row", Static).render())
        assert '→ calls get_weather({"city": "Paris"})' in shown and "3 tool" in shown


async def test_conversational_pairs_lint_only_what_hurts_a_pair(tmp_path, monkeypatch):
    """A pair's prompt ends with the user's turn on purpose: that is no turn-order finding."""
    workdir(tmp_path, monkeypatch)
    rows = [{"prompt": [{"role": "user", "content": f"Spell {w} loudly."}],
             "chosen": [{"role": "assistant", "content": w.upper()}],
             "rejected": [{"role": "assistant", "content": w.upper() if w == "river" else w}]}
            for w in ("stone", "river", "cloud")]
    write_rows(tmp_path / "chat_pairs.jsonl", rows)
    config = make_config(data="chat_pairs.jsonl")
    config.trainer.method = "orpo"
    app = StudioApp(config, settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "preference pairs (TRL conversational)" in _page_label(app)
        assert [(i.kind, i.row) for i in app.query_one(DatasetPane).issues] == [("identical", 1)]
