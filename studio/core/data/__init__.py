"""Datasets: loading, browsing, what a dataset holds, template fields, splits, statistics and lint.

Modules, each importing only those above it:

- ``load``: read CSV / TSV / JSON / JSONL / Parquet / saved / hub datasets (``load_table``, ``DataError``)
- ``browse``: slices, columns and search (``Table``, ``rows``, ``search``, ...)
- ``pairs``: preference pairs (DPO / ORPO): the chat shape flattened, pair lint, the word difference
- ``fields``: the template fields a run needs, read from their columns (``template_fields_for``,
  ``field_columns``, ``chat_column``: the column of a chat dataset)
- ``shapes``: what a dataset holds (instruction rows, conversations, TRL's pairs, raw text) and the
  prompt settings each trains with
- ``stats``: length statistics and lint (imported from here only when asked for: the heaviest)
- ``split``: the train / validation / test split (``load_splits``, ``Splits``, ``split_counts``)
- ``encoding``: training rows -> token ids and labels for every shape (the engine's and config check's)

This module gathers the public names callers use, so they import one place.
"""

from __future__ import annotations

from typing import Any

from studio.core.data.browse import Table, arrow_table, column_values, row_count, rows, search
from studio.core.data.fields import as_text, chat_column, field_columns, template_fields_for
from studio.core.data.load import FORMATS, SPLIT_NAMES, DataError, load_table
from studio.core.data.split import Splits, load_splits, split_counts
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
        from studio.core.data import stats

        return getattr(stats, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
