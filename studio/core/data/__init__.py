"""Datasets: one import for loading, browsing, splitting, statistics and lint.

Each concept has its own module; this one gathers their public names so callers import one place:

- :mod:`studio.core.data.load`: read CSV / TSV / JSON / JSONL / Parquet / saved / hub datasets
  (``load_table``, ``DataError``, ``FORMATS``, ``SPLIT_NAMES``, ``resolve_path``)
- :mod:`studio.core.data.browse`: slices, columns and search (``Table``, ``rows``, ``search``, ...)
- :mod:`studio.core.data.split`: template fields and the train / validation / test split
  (``load_splits``, ``Splits``, ``template_fields_for``, ``field_columns``, ``split_counts``,
  ``chat_column``: the column of a chat dataset, see :mod:`studio.core.prompt.chat`)
- :mod:`studio.core.data.stats`: length statistics and lint (imported from here only when asked for,
  since it is the heaviest)
"""

from __future__ import annotations

from typing import Any

from studio.core.data.browse import Table, arrow_table, column_values, row_count, rows, search
from studio.core.data.load import FORMATS, SPLIT_NAMES, DataError, load_table
from studio.core.data.split import (
    Splits,
    as_text,
    chat_column,
    field_columns,
    load_splits,
    split_counts,
    template_fields_for,
)
from studio.core.paths import resolve_path

__all__ = [
    "FORMATS", "SPLIT_NAMES", "DataError", "Splits", "Table", "arrow_table", "as_text", "chat_column",
    "column_values",
    "field_columns", "load_splits", "load_table", "resolve_path", "row_count", "rows", "search",
    "split_counts", "template_fields_for",
]

_STATS = ("LengthStats", "length_stats", "ColumnStats", "column_stats", "DataIssue", "lint_rows",
          "lint_conversations")


def __getattr__(name: str) -> Any:
    """Statistics and lint live in :mod:`studio.core.data.stats`; they are importable from here too."""
    if name in _STATS:
        from studio.core.data import stats as datastats

        return getattr(datastats, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
