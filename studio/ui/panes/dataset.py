"""The dataset browser: open a file, page through it, filter it, read a row, see its statistics and lint.

Everything slow runs in thread workers (reading the file, searching, statistics, lint) and comes back
with ``call_from_thread``; the table only ever holds one page, so 100k rows page as fast as 100.
The selected row feeds the template preview (``app.select_row``); the opened path becomes the
config's ``data.path`` and the column mapping its ``data.columns``.

Longer than ~400 lines on purpose: what is here is the wiring of one cursor and one page between the
table, the filter and the side views (row, statistics, lint, column mapping); the work itself already
lives elsewhere (core/data/, widgets/page_table.py, column_stats.py, column_map.py).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.timer import Timer
from textual.widgets import Button, Input, OptionList, ProgressBar, Static, TabbedContent, TabPane
from textual.widgets.option_list import Option

from studio.core import data as datalib
from studio.core import prompt as prompts
from studio.core.data import shapes
from studio.core.data.pairs import is_preference
from studio.core.data.stats import pair_lint
from studio.core.grpo.rows import grpo_lint, is_grpo
from studio.core.prompt import chat
from studio.core.runs.cells import cell
from studio.ui.host import Pane
from studio.ui.messages import ConfigChanged, TokenizerChanged
from studio.ui.widgets.column_map import ColumnMap
from studio.ui.widgets.column_stats import StatsView
from studio.ui.widgets.dialogs import PathDialog
from studio.ui.widgets.page_table import PageTable
from studio.ui.widgets.pair_view import PairView, pair_row

PAGE_SIZE = 100
"""Rows in the table at once; paging replaces them (never the whole dataset in the table)."""
CELL_CHARS = 40
"""Longest cell text in the table; the row view shows everything."""
STATS_SAMPLE = 20_000
"""Statistics on bigger datasets use a seeded random sample of this many rows."""
LINT_SHOWN = 500
"""Most lint findings listed (the count says how many there are)."""
_COLUMN_FILTER = re.compile(r"^(\w+):(.*)$")


def cell_text(value: Any, limit: int = CELL_CHARS) -> str:
    """A value as one short table cell: newlines shown as ⏎, long text cut with …, and no control
    characters (an escape sequence in someone's data must not reach the terminal)."""
    if isinstance(value, list) and chat.shape_of(value) is not None:
        value = conversation_summary(value)
    return cell(value, limit)


def conversation_summary(value: list) -> str:
    """A conversation as one cell: ``3 turns · user: first question…``."""
    try:
        turns = chat.parse_turns(value)
    except chat.ChatFormatError:
        return str(value)
    first = next((t for t in turns if t.role == "user"), turns[0])
    return f"{len(turns)} turns · {first.role}: {first.content}"


class DatasetPane(Pane, Vertical):
    """Open, page, filter and inspect a dataset."""

    BINDINGS = [
        Binding("ctrl+o", "open_file", "Open", id="dataset.open", show=False),
        Binding("right_square_bracket", "page(1)", "Next page", id="dataset.next_page", key_display="]"),
        Binding("left_square_bracket", "page(-1)", "Prev page", id="dataset.prev_page", key_display="["),
        Binding("slash", "focus_filter", "Filter", id="dataset.filter", key_display="/"),
        Binding("v", "side('row')", "Row", id="dataset.row_view", show=False,
                tooltip="Show the highlighted row's full text"),
        Binding("s", "side('stats')", "Stats", id="dataset.stats", show=False),
        Binding("l", "side('lint')", "Lint", id="dataset.lint", show=False),
        Binding("m", "side('columns')", "Map columns", id="dataset.map_columns", show=False),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table: datalib.Table | None = None
        self.matches: list[int] | None = None
        """Row indices the filter kept, or None when there is no filter."""
        self.page = 0
        self.issues: list[datalib.DataIssue] = []
        self.chat_column: str | None = None
        """The column holding conversations when the dataset is a chat dataset."""
        self.shape: shapes.DataShape | None = None
        """What the open dataset holds (core/data/shapes.py), shown beside the page count."""
        self._filter_timer: Timer | None = None
        self._lint_timer: Timer | None = None
        self._page_rows: list[int] = []
        self._highlight_pending: int | None = None
        """Dataset row the cursor moved to, shown in the row view after the table's repaint."""
        self._mapping_shown: tuple = ()

    def compose(self) -> ComposeResult:
        with Horizontal(id="dataset-toolbar"):
            yield Input(placeholder="dataset: CSV / JSON / JSONL / Parquet file or saved folder",
                        id="dataset-path", compact=True)
            yield Button("Open", id="dataset-open", variant="primary", compact=True)
            yield Button("Browse…", id="dataset-browse", compact=True)
        with Horizontal(id="dataset-busy"):
            yield Static("", id="dataset-busy-label")
            yield ProgressBar(total=None, show_eta=False, id="dataset-progress")
        with Horizontal(id="dataset-body"):
            with Vertical(id="dataset-left"):
                yield PageTable(id="dataset-table")
                with Horizontal(id="dataset-pager"):
                    yield Static("no dataset", id="dataset-page-label")
                    yield Input(placeholder="/ filter (col:text)", id="dataset-filter", compact=True)
            with TabbedContent(id="dataset-side", initial="row"):
                with TabPane("v Row", id="row"):
                    with VerticalScroll(id="dataset-row-scroll"):
                        yield Static("Highlight a row to read it in full.", id="dataset-row")
                        yield PairView(id="dataset-pair")  # preference runs: chosen | rejected
                with TabPane("s Stats", id="stats"):
                    yield StatsView(id="dataset-stats")
                with TabPane("l Lint", id="lint"):
                    yield Static("", id="lint-summary")
                    yield OptionList(id="lint-list")
                with TabPane("m Columns", id="columns"):
                    yield ColumnMap(id="dataset-columns")

    def on_mount(self) -> None:
        self._busy(None)
        path = self.host.config.data.path
        if path:
            self.query_one("#dataset-path", Input).value = str(path)
            # Reading starts once the pane is painted: the reader thread imports `datasets` and
            # would hold the GIL while the pane's first frame is built.
            self._busy(f"reading {path}…")
            self.call_after_refresh(self._load, str(path))

    def focus_target(self) -> PageTable:
        """What gets focus when the pane is shown: the table."""
        return self.query_one("#dataset-table", PageTable)

    # ------------------------------------------------------------------------------ loading

    def _busy(self, label: str | None, progress: float | None = None) -> None:
        """Show (or hide, with None) the progress line under the toolbar."""
        busy = self.query_one("#dataset-busy")
        busy.display = label is not None
        if label is not None:
            self.query_one("#dataset-busy-label", Static).update(label)
            bar = self.query_one("#dataset-progress", ProgressBar)
            bar.update(total=None if progress is None else 100, progress=(progress or 0) * 100)

    def open(self, path: str) -> None:
        """Load ``path`` in a thread; the table fills when it is read."""
        self._busy(f"reading {path}…")
        self._load(path)

    @work(thread=True, exclusive=True, group="dataset-load", exit_on_error=False, description="reading data")
    def _load(self, path: str) -> None:
        config_path = self.host.config_path
        base = config_path.parent if config_path else None
        started = time.perf_counter()
        try:
            table = datalib.Table.open(path, self.host.config.data.hub_split, base)
        except datalib.DataError as exc:
            self.app.call_from_thread(self._load_failed, str(exc))
            return
        except Exception as exc:  # anything else the reader raises is still the file's fault
            self.app.call_from_thread(self._load_failed, f"{path}: cannot read it ({exc})")
            return
        found = datalib.chat_column(table.dataset, self.host.config.data.columns)
        shape = shapes.detect(table.dataset, self.host.config)
        self.app.call_from_thread(self._loaded, path, table, time.perf_counter() - started, found, shape)

    def _load_failed(self, message: str) -> None:
        self._busy(None)
        self.query_one("#dataset-page-label", Static).update("no dataset")
        self.notify(message, title="Dataset not opened", severity="error", timeout=10)

    def _loaded(self, path: str, table: datalib.Table, seconds: float,
                chat_found: tuple[str, str] | None = None, shape: shapes.DataShape | None = None) -> None:
        if not self.is_attached:  # the app quit while the file was being read
            return
        self.table = table
        self.chat_column = chat_found[0] if chat_found else None
        self.shape = shape
        self.matches = None
        self.page = 0
        self.query_one("#dataset-filter", Input).value = ""
        grid = self.query_one("#dataset-table", PageTable)
        grid.clear(columns=True)
        grid.add_column("#", key="#")
        for name in table.column_names:
            grid.add_column(name, key=name)
        self.show_page(0)
        self._busy(None)
        self.host.dataset_opened(path, table.column_names, len(table), origin=self)
        self._show_mapping()
        self.refresh_analysis()
        self.notify(f"{len(table):,} rows, {len(table.column_names)} columns in {seconds:.1f} s",
                    title=Path(path).name)
        if chat_found is not None:
            self._use_chat_template(*chat_found)
        if shape is not None:
            self._use_shape(shape)

    def _use_chat_template(self, column: str, shape: str) -> None:
        """Conversations train through the model's chat template: switch ``prompt.template`` to it."""
        app = self.host
        name = "ShareGPT from/value" if shape == "sharegpt" else "OpenAI role/content"
        if app.config.prompt.template != "chat":
            app.config.prompt.template = "chat"
            app.config_edited("prompt", origin=self)
            self.notify(f"column '{column}' holds conversations ({name}); prompt.template is now 'chat', "
                        "the model's chat template (loss on the assistant turns)", title="Chat dataset")

    def _use_shape(self, shape: shapes.DataShape) -> None:
        """TRL's preference shapes and raw text train with prompt settings of their own
        (core/data/shapes.py): make them the config's, as training will, and say what the data is."""
        app = self.host
        adapted = shape.adapt(app.config)
        if adapted.prompt != app.config.prompt or adapted.data.columns != app.config.data.columns:
            app.config.prompt = adapted.prompt
            app.config.data.columns = adapted.data.columns
            app.config_edited("prompt", origin=self)
            self.notify(f"{shape.label}: prompt.template is now {adapted.prompt.template!r} (response "
                        f"'{adapted.prompt.response_field}')", title="Dataset shape")
        self._page_label()

    # ------------------------------------------------------------------------------- paging

    @property
    def row_total(self) -> int:
        """Rows shown by the table (after the filter)."""
        if self.table is None:
            return 0
        return len(self.matches) if self.matches is not None else len(self.table)

    @property
    def page_count(self) -> int:
        """Pages at PAGE_SIZE rows."""
        return max(1, -(-self.row_total // PAGE_SIZE))

    def show_page(self, page: int, cursor_row: int | None = None,
                  fetched: list[dict[str, Any]] | None = None) -> None:
        """Fill the table with page ``page`` (clamped), cursor on dataset row ``cursor_row`` if given;
        ``fetched`` are the page's rows when a thread already read them."""
        if self.table is None:
            return
        self.page = max(0, min(page, self.page_count - 1))
        start = self.page * PAGE_SIZE
        if self.matches is None:
            indices = list(range(start, min(start + PAGE_SIZE, len(self.table))))
            rows = fetched if fetched is not None else self.table.rows(start, start + PAGE_SIZE)
        else:
            indices = self.matches[start:start + PAGE_SIZE]
            rows = fetched if fetched is not None else [self.table.row(i) for i in indices]
        self._page_rows = indices
        columns = self.table.column_names
        # Plain strings: the table draws them as they are (no markup, so "[/x]" in data is just text).
        cells = [[str(i), *(cell_text(row.get(c)) for c in columns)] for i, row in zip(indices, rows, strict=True)]
        grid = self.query_one("#dataset-table", PageTable)
        target = indices.index(cursor_row) if cursor_row is not None and cursor_row in indices else 0
        if grid.show_rows(cells):
            # Same rows rewritten: the cursor did not move, so say which row is under it now.
            if grid.cursor_row != target:
                grid.move_cursor(row=target)  # the table posts RowHighlighted
            else:
                self._highlight(target)
            if target == 0:
                grid.scroll_to(y=0, animate=False)
        elif target:
            grid.move_cursor(row=target)
        self._page_label()

    def _page_label(self) -> None:
        total = self.row_total
        start = self.page * PAGE_SIZE
        end = min(start + PAGE_SIZE, total)
        if self.matches is not None and self.table is not None:
            # Counted matches, from 1: their row numbers are in the table's # column.
            shown = f"matches {start + 1:,}-{end:,}" if total else "no matches"
            what = f"{shown} of {total:,} (filter, of {len(self.table):,} rows)"
        else:
            # Row numbers from 0, as in the # column, the row view, lint and every error message.
            what = f"rows {start:,}-{end - 1:,} of {total:,}" if total else "no rows"
        label = self.query_one("#dataset-page-label", Static)
        # Instruction rows are the usual case; any other shape is named (what core reads the data as).
        shape = f" · {self.shape.label}" if self.shape is not None and self.shape.kind != shapes.INSTRUCTION else ""
        text = f"{what} · page {self.page + 1}/{self.page_count}{shape}"
        # Same length, same size: a repaint of the label, not a re-layout of the whole screen.
        label.update(text, layout=len(text) != len(str(label.content)))

    def action_page(self, delta: int) -> None:
        """Next (+1) or previous (-1) page."""
        self.show_page(self.page + delta)

    def goto_row(self, index: int) -> None:
        """Show dataset row ``index``: clear a filter that hides it, page to it, put the cursor on it."""
        if self.table is None:
            return
        if self.matches is not None and index not in self.matches:
            self.matches = None
            self.query_one("#dataset-filter", Input).value = ""
        position = self.matches.index(index) if self.matches is not None else index
        self.show_page(position // PAGE_SIZE, cursor_row=index)
        self.query_one("#dataset-table", PageTable).focus()
        self.action_side("row")

    # ------------------------------------------------------------------------------ filter

    def action_focus_filter(self) -> None:
        self.query_one("#dataset-filter", Input).focus()

    @on(Input.Changed, "#dataset-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(0.25, lambda: self._search(event.value))

    @on(Input.Submitted, "#dataset-filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.query_one("#dataset-table", PageTable).focus()

    @work(thread=True, exclusive=True, group="dataset-search", exit_on_error=False, description="filtering")
    def _search(self, text: str) -> None:
        table = self.table
        if table is None:
            return
        columns = None
        match = _COLUMN_FILTER.match(text)
        if match and match.group(1) in table.column_names:
            columns, text = [match.group(1)], match.group(2)
        found = table.search(text.strip(), columns, limit=None) if text.strip() else None
        # The first page's rows are read here too: a hundred scattered rows are ~10 ms of Arrow
        # slicing that the event loop would otherwise spend between two key presses.
        first = table.rows(0, PAGE_SIZE) if found is None else [table.row(i) for i in found[:PAGE_SIZE]]
        self.app.call_from_thread(self._filtered, table, found, first)

    def _filtered(self, table: datalib.Table, found: list[int] | None, first: list[dict[str, Any]]) -> None:
        if table is not self.table:
            return  # another file was opened meanwhile
        self.matches = found
        self.show_page(0, fetched=first)

    # --------------------------------------------------------------------------- row view

    @on(PageTable.RowHighlighted, "#dataset-table")
    def _row_highlighted(self, event: PageTable.RowHighlighted) -> None:
        self._highlight(event.cursor_row)

    def _highlight(self, cursor_row: int) -> None:
        """Show the page's row ``cursor_row`` in the row view and hand it to the previews."""
        if self.table is None or not 0 <= cursor_row < len(self._page_rows):
            return
        # The table's new frame goes out first; the row view (a re-layout of the side panel) and
        # the previews follow right after it, once for a burst of moves (a held arrow key).
        if self._highlight_pending is None:
            self.call_after_refresh(self._show_highlighted)
        self._highlight_pending = self._page_rows[cursor_row]

    def _show_highlighted(self) -> None:
        index, self._highlight_pending = self._highlight_pending, None
        if index is None or self.table is None or index >= len(self.table):
            return
        row = self.table.row(index)
        self._show_row(index, row)
        self.host.select_row(index, row, origin=self)

    @on(PageTable.RowSelected, "#dataset-table")
    def _row_selected(self, event: PageTable.RowSelected) -> None:
        self.action_side("row")

    def _show_row(self, index: int, row: dict[str, Any]) -> None:
        parts = [Content.from_markup("[b $primary]row $index[/]\n", index=f"{index:,}")]
        for name, value in row.items():
            if name == self.chat_column:
                parts.append(self._conversation_view(name, value))
                continue
            text = "" if value is None else str(value)
            parts.append(Content.from_markup("\n[b $accent]$name[/]\n", name=name))
            parts.append(Content(text if text else "(empty)") + "\n")
        self.query_one("#dataset-row", Static).update(Content("").join(parts))
        pair = self.query_one(PairView)
        pair.display = is_preference(self.host.config)
        if pair.display:
            config = self.host.config
            fields = datalib.template_fields_for(config)[0]
            flat = pair_row(row, config, fields[0])
            names = (config.prompt.response_field, config.prompt.rejected_field)
            pair.show(str(flat.get(names[0]) or ""), str(flat.get(names[1]) or ""), names)

    def _conversation_view(self, name: str, value: Any) -> Content:
        """A conversation turn by turn: role, token count (the model's tokenizer), text."""
        try:
            turns = chat.parse_turns(value)
        except chat.ChatFormatError as exc:
            return Content.from_markup("\n[b $accent]$name[/]\n[b $error]$m[/]\n", name=name, m=str(exc))
        counter = self.host.counter
        counts = counter.count([t.content for t in turns])
        approx = "" if counter.exact else "≈"
        parts = [Content.from_markup("\n[b $accent]$name[/] [dim]$n turns, $total tokens of text[/]\n",
                                     name=name, n=str(len(turns)), total=f"{approx}{sum(counts):,}")]
        for number, (turn, count) in enumerate(zip(turns, counts, strict=True), start=1):
            style = "$studio-response" if turn.role == "assistant" else "$studio-prompt"
            parts.append(Content.from_markup(f"\n[b {style}]$number $role[/] [dim]$count tokens[/]\n",
                                             number=str(number), role=turn.role, count=f"{approx}{count:,}"))
            calls = [_call_text(call) for call in turn.tool_calls]
            shown = turn.content if turn.content.strip() else "" if calls else "(empty)"
            parts.append(Content("\n".join(t for t in (shown, *calls) if t)) + "\n")
        return Content("").join(parts)

    def action_side(self, tab: str) -> None:
        """Bring a side tab (row, stats, lint, columns) to the front."""
        self.query_one("#dataset-side", TabbedContent).active = tab

    # ---------------------------------------------------------------------- stats and lint

    def refresh_analysis(self) -> None:
        """Recompute statistics and lint for the current table, config and tokenizer."""
        if self.table is not None:
            self._analyse(self.table)

    @work(thread=True, exclusive=True, group="dataset-analysis", exit_on_error=False,
          description="column statistics and lint")
    def _analyse(self, table: datalib.Table) -> None:
        app = self.app
        config, counter = self.host.config, self.host.counter
        tokenize = counter.tokenizer if counter.tokenizer is not None else counter.tokenize
        app.call_from_thread(self._busy, "statistics…", 0.1)
        source: Any = table.dataset
        note = f"{len(table):,} rows"
        if len(table) > STATS_SAMPLE:
            picks = sorted(random.Random(0).sample(range(len(table)), STATS_SAMPLE))
            source = table.dataset.select(picks)
            note = f"a random sample of {STATS_SAMPLE:,} of {len(table):,} rows"
        text_columns = [c for c in table.column_names if c != config.data.split_column]
        stats = datalib.column_stats(source, text_columns, tokenize)
        splits = (datalib.split_counts(table.dataset, config.data.split_column)
                  if config.data.split_column else None)
        app.call_from_thread(self._show_stats, stats, splits, note, counter.label)
        app.call_from_thread(self._busy, "lint…", 0.6)
        try:
            template = _template_for_lint(config, counter)
            raw = config.prompt.template == prompts.RAW_TEXT  # documents are cut into blocks, never too long
            issues = datalib.lint_rows(table.dataset, config.prompt.response_field,
                                       columns=config.data.columns, tokenize=tokenize,
                                       max_seq_length=None if raw else config.data.max_seq_length, template=template,
                                       add_eos=config.prompt.add_eos, chat_template=counter.chat_template)
            if is_preference(config):
                issues = pair_lint(table.dataset, config, issues)
            elif is_grpo(config):
                issues = grpo_lint(issues)
        except (datalib.DataError, ValueError) as exc:
            app.call_from_thread(self._show_lint_error, str(exc))
        else:
            app.call_from_thread(self._show_lint, issues)
        app.call_from_thread(self._busy, None)

    def _show_stats(self, stats: dict[str, Any], splits: dict[str, int] | None, note: str, label: str) -> None:
        if not self.is_attached:
            return
        self.query_one(StatsView).show(stats, splits, note, label)

    def _show_lint(self, issues: list[datalib.DataIssue]) -> None:
        if not self.is_attached:
            return
        self.issues = issues
        kinds: dict[str, int] = {}
        for issue in issues:
            kinds[issue.kind] = kinds.get(issue.kind, 0) + 1
        summary = " · ".join(f"{n:,} {kind.replace('_', ' ')}" for kind, n in kinds.items())
        self.query_one("#lint-summary", Static).update(
            f"⚠ {summary} (Enter jumps to the row)" if issues else "✓ no problems found")
        options = self.query_one("#lint-list", OptionList)
        options.clear_options()
        options.add_options([Option(f"row {i.row:,} · {i.message.split(': ', 1)[-1]}", id=str(n))
                             for n, i in enumerate(issues[:LINT_SHOWN])])
        tab = self.query_one("#dataset-side", TabbedContent).get_tab("lint")
        tab.label = f"l Lint ({len(issues):,})" if issues else "l Lint"

    def _show_lint_error(self, message: str) -> None:
        self.issues = []
        self.query_one("#lint-list", OptionList).clear_options()
        self.query_one("#lint-summary", Static).update(f"⚠ {message}")

    @on(OptionList.OptionSelected, "#lint-list")
    def _lint_chosen(self, event: OptionList.OptionSelected) -> None:
        issue = self.issues[int(event.option.id or 0)]
        self.goto_row(issue.row)

    # ---------------------------------------------------------------------- column mapping

    def _show_mapping(self) -> None:
        if self.table is None:
            return
        config = self.host.config
        fields, optional = datalib.template_fields_for(config)
        shown = (tuple(fields), tuple(self.table.column_names), tuple(sorted(config.data.columns.items())))
        if shown != self._mapping_shown:  # rebuilding the Selects on every template edit is wasteful
            self._mapping_shown = shown
            self.query_one(ColumnMap).show(fields, optional, self.table.column_names, config.data.columns)

    def on_column_map_changed(self, message: ColumnMap.Changed) -> None:
        app = self.host
        if app.config.data.columns == message.mapping:
            return
        app.config.data.columns = message.mapping
        app.config_edited("data", origin=self)
        self._schedule_analysis()

    def _schedule_analysis(self) -> None:
        """Re-lint a moment after the last edit (typing in the template must not re-lint per key)."""
        if self._lint_timer is not None:
            self._lint_timer.stop()
        self._lint_timer = self.set_timer(0.8, self.refresh_analysis)

    def on_config_changed(self, message: ConfigChanged) -> None:
        if self.table is not None and message.section in ("trainer", "data", "all"):
            # A preference method (or a column mapping) can change what the data is read as.
            self.shape = shapes.detect(self.table.dataset, self.host.config)
            self._use_shape(self.shape)
        if message.section in ("prompt", "data", "all"):
            path = self.host.config.data.path
            if message.section in ("data", "all") and path and (self.table is None or self.table.source != path):
                self.query_one("#dataset-path", Input).value = str(path)
                self.open(str(path))
                return
            self._show_mapping()
            self._schedule_analysis()

    def on_tokenizer_changed(self, message: TokenizerChanged) -> None:
        self._schedule_analysis()

    # ----------------------------------------------------------------------------- opening

    def action_open_file(self) -> None:
        """Pick a data file (or a saved dataset folder) and open it."""
        current = self.query_one("#dataset-path", Input).value or str(Path.cwd())

        def chosen(path: Path | None) -> None:
            if path is not None:
                self.query_one("#dataset-path", Input).value = str(path)
                self.open(str(path))

        self.app.push_screen(PathDialog("Open a dataset", current, suffixes=datalib.FORMATS, folders=True),
                             chosen)

    @on(Button.Pressed, "#dataset-open")
    @on(Input.Submitted, "#dataset-path")
    def _open_typed(self, event: Any) -> None:
        path = self.query_one("#dataset-path", Input).value.strip()
        if path:
            # Out of the field: the pane's keys ([, ], /, v...) are keys again, not text.
            self.query_one("#dataset-table", PageTable).focus()
            self.open(path)

    @on(Button.Pressed, "#dataset-browse")
    def _browse(self) -> None:
        self.action_open_file()


def _call_text(call: Any) -> str:
    """One tool call of an assistant turn as the row view shows it: ``→ calls name({arguments})``."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(function, dict):
        function = {}
    arguments = function.get("arguments", "")
    shown = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f"→ calls {function.get('name', '?')}({shown})"


def _template_for_lint(config: Any, counter: Any) -> str | None:
    """The literal template rows are rendered through for length lint; None if it cannot resolve."""
    try:
        return prompts.resolve_template(config.prompt, counter.chat_template,
                                        eos_token=counter.eos_token or "")
    except prompts.TemplateError:
        return None
