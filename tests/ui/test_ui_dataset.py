"""The dataset browser, driven like a person would: open a file, page, filter, read a row, jump from lint."""

from __future__ import annotations

import json

import pytest
from helpers.ui import lint_rows_dataset, make_config, settle, workdir, write_rows
from textual.widgets import Input, OptionList, Select, Static, TabbedContent

from studio.ui.app import StudioApp
from studio.ui.panes.dataset import PAGE_SIZE, DatasetPane, cell_text
from studio.ui.widgets.column_map import ColumnMap
from studio.ui.widgets.column_stats import StatsView
from studio.ui.widgets.page_table import PageTable

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


def table_ids(app) -> list[int]:
    grid = app.query_one("#dataset-table", PageTable)
    return [int(str(grid.get_row_at(r)[0])) for r in range(grid.row_count)]


async def test_open_page_filter_and_read_a_row(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    lint_rows_dataset(tmp_path / "rows.jsonl")
    app = StudioApp(make_config(data=None), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.query_one(DatasetPane)
        assert pane.table is None

        # Open by typing the path.
        await pilot.click("#dataset-path")
        await pilot.press(*"rows.jsonl", "enter")
        await settle(pilot)
        assert app.config.data.path == "rows.jsonl"
        assert table_ids(app) == list(range(PAGE_SIZE))
        label = str(app.query_one("#dataset-page-label", Static).render())
        assert "rows 0-99 of 250" in label and "page 1/3" in label

        # Page forward twice (the last page is partial) and back once.
        app.query_one("#dataset-table").focus()
        await pilot.press("right_square_bracket", "right_square_bracket")
        assert table_ids(app) == list(range(200, 250))
        await pilot.press("left_square_bracket")
        assert table_ids(app) == list(range(100, 200))
        # The label, the # column and the row view number rows alike (from 0, as lint and errors do).
        await pilot.pause(0.2)
        assert "rows 100-199 of 250" in str(app.query_one("#dataset-page-label", Static).render())
        assert str(app.query_one("#dataset-row", Static).render()).startswith("row 100\n")

        # Filter: "/" focuses the box; the table keeps only matching rows.
        await pilot.press("slash", *"number 12", "enter")
        await settle(pilot)
        expected = [i for i in range(250) if "number 12" in f"Reverse the word number {i}."]
        assert table_ids(app) == expected
        assert f"matches 1-{len(expected)} of {len(expected)} (filter, of 250 rows)" in str(
            app.query_one("#dataset-page-label", Static).render())

        # A column filter searches that column only.
        app.query_one("#dataset-filter", Input).value = "output:drow"
        await settle(pilot)
        # every row but the empty one and the long one
        assert "of 248 (filter, of 250 rows)" in str(app.query_one("#dataset-page-label", Static).render())
        assert 7 not in table_ids(app) and 20 not in table_ids(app)

        # Open a row: the row view shows its full text, newlines and all.
        app.query_one("#dataset-filter", Input).value = ""
        await settle(pilot)
        app.query_one("#dataset-table").focus()
        await pilot.press("down", "down", "enter")
        await pilot.pause()
        assert app.query_one("#dataset-side", TabbedContent).active == "row"
        shown = str(app.query_one("#dataset-row", Static).render())
        assert "row 2" in shown and "Reverse the word number 2." in shown and "2drow" in shown
        assert app.selected[0] == 2


async def test_lint_lists_problems_and_jumps_to_the_row(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    data = lint_rows_dataset(tmp_path / "rows.jsonl")
    app = StudioApp(make_config(data=str(data), max_len=64), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.query_one(DatasetPane)
        kinds = {(i.kind, i.row) for i in pane.issues}
        assert ("empty_output", 7) in kinds
        assert ("duplicate_prompt", 3) in kinds
        assert ("too_long", 20) in kinds
        await pilot.press("l")
        assert app.query_one("#dataset-side", TabbedContent).active == "lint"
        assert "1 empty output" in str(app.query_one("#lint-summary", Static).render())

        # Go to page 3, then jump from the lint entry for row 20: the browser pages back to it.
        app.query_one("#dataset-table").focus()
        await pilot.press("right_square_bracket", "right_square_bracket")
        options = app.query_one("#lint-list", OptionList)
        options.focus()
        target = next(n for n, i in enumerate(pane.issues) if i.row == 20)
        options.highlighted = target
        await pilot.press("enter")
        await pilot.pause()
        grid = app.query_one("#dataset-table", PageTable)
        assert pane.page == 0
        assert int(str(grid.get_row_at(grid.cursor_row)[0])) == 20
        assert "token119" in str(app.query_one("#dataset-row", Static).render())


async def test_stats_use_the_tokenizer_and_show_splits(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("s")
        await pilot.pause()
        stats = app.query_one(StatsView)
        assert set(stats.stats) == {"instruction", "input", "output"}
        output = stats.stats["output"]
        assert output.tokens is not None and output.tokens.max < output.chars.max
        assert stats.token_label == "tokenizer: tok"
        splits = str(app.query_one("#stats-splits", Static).render())
        rows = [json.loads(line) for line in open("code_alpaca_sample.jsonl")]
        train = sum(1 for r in rows if r["split"] == 0)
        assert "train" in splits and f"{train}" in splits


async def test_columns_named_differently_are_mapped_to_template_fields(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    data = write_rows(tmp_path / "qa.jsonl", [{"question": f"What is {i}+{i}?", "answer": str(2 * i)}
                                             for i in range(30)])
    app = StudioApp(make_config(data=str(data)), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("m")
        await pilot.pause()
        note = str(app.query_one("#map-note", Static).render())
        assert "no column for {instruction}, {output}" in note
        selects = {s.field_name: s for s in app.query_one(ColumnMap).query(".map-select").results(Select)}
        selects["instruction"].value = "question"
        await pilot.pause()
        selects["output"].value = "answer"
        await settle(pilot)
        assert app.config.data.columns == {"instruction": "question", "output": "answer"}
        # The template preview now renders the mapped columns.
        await pilot.press("2")
        await settle(pilot, rounds=1)
        render = str(app.query_one("#template-render", Static).render())
        assert "What is 0+0?" in render and "0" in render
        assert "instruction: question" in app.config.to_yaml()


def test_cells_are_one_short_line():
    assert cell_text("a\nb") == "a⏎ b"
    long = cell_text("x" * 100)
    assert len(long) == 40 and long.endswith("…")
    assert cell_text(None) == ""
    # An escape sequence in someone's data must not reach the terminal as one.
    assert cell_text("red \x1b[31mtext\x07 \x9b") == "red [31mtext "
