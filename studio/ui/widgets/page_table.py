"""A DataTable that shows one page of a big dataset and turns pages by rewriting its rows in place.

Textual's DataTable is built for tables that grow: clearing it and adding 100 rows measures every
cell again, and ``update_cell`` repaints the widget once per cell. Turning a page here writes the
new cells into the rows already there, grows a column only when a new cell is wider, and repaints
once: a page costs a few milliseconds instead of tens.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import RowKey


class PageTable(DataTable):
    """A DataTable of text cells, refilled a page at a time (see :meth:`show_rows`)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._page_keys: list[RowKey] = []

    def clear(self, columns: bool = False) -> PageTable:
        """Remove every row (and the columns too if ``columns``)."""
        self._page_keys = []
        super().clear(columns)
        return self

    def show_rows(self, cells: Sequence[Sequence[Text]]) -> bool:
        """Show ``cells`` (one list of Text per row, one Text per column) as the table's rows.

        Returns True when they replaced the rows in place (same number of rows: the cursor stays
        where it was, and no RowHighlighted is posted); False when the table was cleared and refilled.
        """
        if cells and len(cells) == self.row_count == len(self._page_keys) and self._rewrite(cells):
            return True
        super().clear()
        self._page_keys = self.add_rows(cells)
        return False

    def _rewrite(self, cells: Sequence[Sequence[Text]]) -> bool:
        # Private DataTable state: a Textual that renamed it gets the (slower) public route instead.
        data = getattr(self, "_data", None)
        if not isinstance(data, dict) or not hasattr(self, "_update_count"):
            return False
        columns = self.ordered_columns
        grew = False
        for row_key, values in zip(self._page_keys, cells, strict=True):
            data[row_key] = {column.key: value for column, value in zip(columns, values, strict=True)}
            for column, value in zip(columns, values, strict=True):
                if value.cell_len > column.content_width:
                    column.content_width = value.cell_len
                    grew = True
        # Render caches are keyed by the update count: a new count means every row renders afresh.
        self._update_count += 1
        self._clear_caches()
        if grew:
            self._require_update_dimensions = True  # the virtual width follows the wider column
            self.check_idle()
        self.refresh()
        return True
