"""A table of one page of a big dataset, drawn line by line straight from its strings.

Textual's DataTable renders every cell through Rich (a Padding around a Text, rendered to lines) and
throws its row cache away when a page turns: on a 100-row page that is most of a keypress's 100 ms.
The dataset browser only ever shows plain text cells a page at a time, so this table keeps the
page's cells as strings and draws each visible line as one Strip of a few Segments: turning a page
redraws the screenful in about a millisecond.

The cursor is a row cursor; moving it posts :class:`PageTable.RowHighlighted`, Enter or a click posts
:class:`PageTable.RowSelected` (the names DataTable uses). The header row stays put while the rows
scroll; wide pages scroll sideways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

MAX_COLUMN_WIDTH = 60
"""A column never grows wider than this many cells (the cells are cut short before this anyway)."""


def _plain(cell: str | Text) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _width(text: str, known: int) -> int:
    """Cells ``text`` takes, or ``known`` when it cannot be wider than that: a cell is at most two
    terminal cells a character, and plain ASCII exactly one, so most cells of a page skip measuring."""
    n = len(text)
    if n > known or (2 * n > known and not text.isascii()):
        return cell_len(text)
    return known


class PageTable(ScrollView, can_focus=True):
    """Rows of text cells under a fixed header, with a row cursor; refilled a page at a time."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor_page(-1)", "Page up", show=False),
        Binding("pagedown", "cursor_page(1)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First row", show=False),
        Binding("end", "cursor_to(-1)", "Last row", show=False),
        Binding("left", "scroll_left", "Scroll left", show=False),
        Binding("right", "scroll_right", "Scroll right", show=False),
        Binding("enter", "select_cursor", "Select row", show=False),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "page-table--header", "page-table--cursor", "page-table--even-row", "page-table--index",
    }

    DEFAULT_CSS = """
    PageTable {
        background: $surface;
        color: $foreground;
        & > .page-table--header { text-style: bold; background: $panel; color: $foreground; }
        & > .page-table--index { color: $text-muted; }
        & > .page-table--even-row { background: $surface-lighten-1 50%; }
        &:dark > .page-table--even-row { background: $surface-darken-1 40%; }
        & > .page-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
        &:focus > .page-table--cursor {
            background: $block-cursor-background;
            color: $block-cursor-foreground;
            text-style: $block-cursor-text-style;
        }
    }
    """

    class RowHighlighted(Message):
        """The cursor moved to ``cursor_row`` (an index into the shown page)."""

        def __init__(self, table: PageTable, cursor_row: int) -> None:
            super().__init__()
            self.table = table
            self.cursor_row = cursor_row

        @property
        def control(self) -> PageTable:
            return self.table

    class RowSelected(RowHighlighted):
        """Enter was pressed on, or the mouse clicked, row ``cursor_row``."""

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None,
                 disabled: bool = False) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._labels: list[str] = []
        self._widths: list[int] = []
        self._rows: list[list[str]] = []
        self.cursor_row = 0
        self._styles: tuple[bool, tuple[Style, ...]] | None = None

    # ---------------------------------------------------------------------------- content

    @property
    def row_count(self) -> int:
        """Rows on the page."""
        return len(self._rows)

    @property
    def columns(self) -> list[str]:
        """The column labels, left to right."""
        return list(self._labels)

    def add_column(self, label: str, *, key: str | None = None) -> None:
        """Add a column headed ``label`` (``key`` is accepted for DataTable's signature)."""
        self._labels.append(label)
        self._widths.append(min(MAX_COLUMN_WIDTH, cell_len(label)))
        for row in self._rows:
            row.append("")
        self._resized()

    def clear(self, columns: bool = False) -> PageTable:
        """Remove every row (and the columns too if ``columns``)."""
        self._rows = []
        self.cursor_row = 0
        if columns:
            self._labels, self._widths = [], []
        self._resized()
        return self

    def get_row_at(self, row: int) -> list[str]:
        """The cells of page row ``row``."""
        return list(self._rows[row])

    def show_rows(self, cells: Sequence[Sequence[str | Text]]) -> bool:
        """Show ``cells`` (one list per row, one str or Text per column) as the table's rows.

        Returns True when the page has as many rows as before: the cursor stays where it was and no
        RowHighlighted is posted. Otherwise (False) the cursor goes to the first row and says so.
        Columns only grow, so the layout holds still while paging.
        """
        same = bool(cells) and len(cells) == len(self._rows)
        n = len(self._labels)
        rows = []
        widths = self._widths
        for values in cells:
            row = [_plain(v) for v in values][:n]
            row += [""] * (n - len(row))
            for i, text in enumerate(row):
                if widths[i] < MAX_COLUMN_WIDTH:
                    widths[i] = min(MAX_COLUMN_WIDTH, _width(text, widths[i]))
            rows.append(row)
        self._rows = rows
        self._resized()
        if not same:
            self.cursor_row = 0
            if rows:
                self.post_message(self.RowHighlighted(self, 0))
        return same

    def _resized(self) -> None:
        # one space either side of each cell, as DataTable pads them
        width = sum(w + 2 for w in self._widths)
        self.virtual_size = Size(width, len(self._rows) + 1)
        self.refresh()

    # ----------------------------------------------------------------------------- cursor

    def move_cursor(self, *, row: int | None = None, column: int | None = None,
                    animate: bool = False, scroll: bool = True) -> None:
        """Put the cursor on page row ``row`` (clamped) and post RowHighlighted if it moved."""
        if row is None or not self._rows:
            return
        row = max(0, min(row, len(self._rows) - 1))
        previous, self.cursor_row = self.cursor_row, row
        if scroll:
            self._scroll_to_cursor()
        if row != previous:
            self._refresh_row(previous)
            self._refresh_row(row)
            self.post_message(self.RowHighlighted(self, row))

    def _scroll_to_cursor(self) -> None:
        visible = max(1, self.scrollable_content_region.height - 1)  # less the header
        top = round(self.scroll_offset.y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False, immediate=True)
        elif self.cursor_row >= top + visible:
            self.scroll_to(y=self.cursor_row - visible + 1, animate=False, immediate=True)

    def _refresh_row(self, row: int) -> None:
        y = row - round(self.scroll_offset.y) + 1
        if 1 <= y < self.size.height:
            self.refresh(Region(0, y, self.size.width, 1))

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(row=self.cursor_row + delta)

    def action_cursor_page(self, delta: int) -> None:
        self.move_cursor(row=self.cursor_row + delta * max(1, self.scrollable_content_region.height - 1))

    def action_cursor_to(self, row: int) -> None:
        self.move_cursor(row=row if row >= 0 else len(self._rows) - 1)

    def action_select_cursor(self) -> None:
        if self._rows:
            self.post_message(self.RowSelected(self, self.cursor_row))

    async def _on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return  # the header
        row = round(self.scroll_offset.y) + offset.y - 1
        if 0 <= row < len(self._rows):
            self.move_cursor(row=row)
            self.post_message(self.RowSelected(self, row))

    # ---------------------------------------------------------------------------- drawing

    def notify_style_update(self) -> None:
        """Theme, focus or CSS changed: the styles are looked up afresh."""
        self._styles = None
        super().notify_style_update()

    def _line_styles(self) -> tuple[Style, ...]:
        """(plain, header, cursor, even row, index column) styles, looked up once per focus state:
        walking the DOM for a widget's style costs more than drawing a whole line."""
        focused = self.has_focus
        if self._styles is None or self._styles[0] != focused:
            base = self.rich_style
            component = self.get_component_rich_style
            index = component("page-table--index", partial=True)
            even = base + component("page-table--even-row")
            styles = (base, base + component("page-table--header"), base + component("page-table--cursor"),
                      even, base + index, even + index)
            self._styles = (focused, styles)
        return self._styles[1]

    def render_line(self, y: int) -> Strip:
        """Line ``y`` of the widget: the header on line 0, rows under it."""
        width = self.scrollable_content_region.width
        scroll_x, scroll_y = self.scroll_offset
        base, header, cursor, even, base_index, even_index = self._line_styles()
        if y == 0:
            return self._line(self._labels, header, header, scroll_x, width)
        row = scroll_y + y - 1
        if row >= len(self._rows):
            return Strip.blank(width, base)
        if row == self.cursor_row:
            return self._line(self._rows[row], cursor, cursor, scroll_x, width)
        if row % 2:
            return self._line(self._rows[row], even, even_index, scroll_x, width)
        return self._line(self._rows[row], base, base_index, scroll_x, width)

    def _line(self, cells: Sequence[str], style: Style, first_style: Style, scroll_x: int, width: int) -> Strip:
        """One table line, ``width`` cells wide from column ``scroll_x``, as a single Strip."""
        widths = self._widths
        segments = [Segment(" " + set_cell_size(cells[0], widths[0]) + " ", first_style)] if cells else []
        rest = "".join(" " + set_cell_size(text, w) + " " for text, w in zip(cells[1:], widths[1:], strict=False))
        total = sum(w + 2 for w in widths)
        if scroll_x == 0 and total <= width:
            segments.append(Segment(rest + " " * (width - total), style))
            return Strip(segments, width)
        segments.append(Segment(rest, style))
        return Strip(segments, total).crop_extend(scroll_x, scroll_x + width, style)
