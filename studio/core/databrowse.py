"""Browsing a loaded dataset: slices, whole columns and search, all cheap on 100k rows (Arrow)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core.dataload import load_table

if TYPE_CHECKING:
    import datasets


def arrow_table(dataset: Any) -> Any:
    """The pyarrow Table behind a Dataset (or :class:`Table`), honouring any selection of rows."""
    dataset = getattr(dataset, "dataset", dataset)
    if getattr(dataset, "_indices", None) is None:
        return dataset.data.table
    return dataset.with_format("arrow")[:]


def _json_columns(dataset: Any) -> set[str]:
    """Columns ``datasets`` stored as JSON text because their values mix types (1 and "two")."""
    features = getattr(getattr(dataset, "dataset", dataset), "features", None) or {}
    return {name for name, feature in features.items() if type(feature).__name__ == "Json"}


def column_values(dataset: Any, name: str) -> list[Any]:
    """A whole column as Python values (mixed-type JSON columns decoded)."""
    values = arrow_table(dataset).column(name).to_pylist()
    if name in _json_columns(dataset):
        values = [None if v is None else json.loads(v) for v in values]
    return values


def row_count(dataset: Any) -> int:
    """Rows in a Dataset or Table (no data is read)."""
    return len(dataset)


def rows(dataset: Any, start: int, stop: int) -> list[dict[str, Any]]:
    """Rows ``start``..``stop`` (end exclusive) as dicts; cheap at any offset (an Arrow slice)."""
    start = max(0, start)
    stop = min(len(dataset), stop)
    if stop <= start:
        return []
    out = arrow_table(dataset).slice(start, stop - start).to_pylist()
    for name in _json_columns(dataset):
        for row in out:
            if row.get(name) is not None:
                row[name] = json.loads(row[name])
    return out


def search(dataset: Any, text: str, columns: Sequence[str] | None = None, limit: int | None = 1000) -> list[int]:
    """Row indices whose ``columns`` (all by default) contain ``text``, ignoring case; vectorised."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = arrow_table(dataset)
    names = list(columns) if columns else table.column_names
    if not text:
        found = range(table.num_rows)
        return list(found[:limit] if limit is not None else found)
    hit = None
    for name in names:
        column = table.column(name)
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            try:
                column = pc.cast(column, pa.string())
            except pa.ArrowNotImplementedError:  # nested values: not searchable as text
                continue
        match = pc.fill_null(pc.match_substring(column, text, ignore_case=True), False)
        hit = match if hit is None else pc.or_(hit, match)
    if hit is None:
        return []
    indices = pc.indices_nonzero(hit).to_pylist()
    return indices[:limit] if limit is not None else indices


@dataclass
class Table:
    """A loaded dataset for browsing: row count, slices and search, all cheap on 100k rows."""

    dataset: datasets.Dataset
    source: str
    """The path or hub id it came from, for messages."""

    @classmethod
    def open(cls, path: str | Path, hub_split: str = "train", base_dir: str | Path | None = None) -> Table:
        """Load ``path`` (see :func:`load_table`)."""
        return cls(load_table(path, hub_split, base_dir), str(path))

    @property
    def column_names(self) -> list[str]:
        """The dataset's columns, in file order."""
        return list(self.dataset.column_names)

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Rows ``start``..``stop`` as dicts."""
        return rows(self.dataset, start, stop)

    def row(self, index: int) -> dict[str, Any]:
        """One row as a dict."""
        return rows(self.dataset, index, index + 1)[0]

    def column(self, name: str) -> list[Any]:
        """A whole column as a list."""
        return column_values(self.dataset, name)

    def search(self, text: str, columns: Sequence[str] | None = None, limit: int | None = 1000) -> list[int]:
        """Indices of rows containing ``text`` (case-insensitive)."""
        return search(self.dataset, text, columns, limit)
