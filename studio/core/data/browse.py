"""Browsing a loaded dataset: slices, whole columns and search, all cheap on 100k rows (Arrow)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core.data.load import load_table

if TYPE_CHECKING:
    import datasets


def arrow_table(dataset: Any) -> Any:
    """The pyarrow Table behind a Dataset (or :class:`Table`), honouring any selection of rows."""
    dataset = getattr(dataset, "dataset", dataset)
    if getattr(dataset, "_indices", None) is None:
        return dataset.data.table
    return dataset.with_format("arrow")[:]


def _holds_json(feature: Any) -> bool:
    """Whether a column's feature stores JSON text anywhere inside it."""
    if type(feature).__name__ == "Json":
        return True
    if isinstance(feature, dict):
        return any(_holds_json(f) for f in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and _holds_json(inner)


def _json_columns(dataset: Any) -> dict[str, Any]:
    """Columns ``datasets`` stored (in part) as JSON text because their values mix types (1 and
    "two"), or objects whose keys differ row to row (messages with and without tool calls), with
    their features."""
    features = getattr(getattr(dataset, "dataset", dataset), "features", None) or {}
    return {name: feature for name, feature in features.items() if _holds_json(feature)}


def _decode(feature: Any, value: Any) -> Any:
    if type(feature).__name__ == "Json":
        return None if value is None else json.loads(value)
    from datasets.features.features import decode_nested_example

    return decode_nested_example(feature, value)


def column_values(dataset: Any, name: str) -> list[Any]:
    """A whole column as Python values (JSON stored inside it decoded)."""
    values = arrow_table(dataset).column(name).to_pylist()
    feature = _json_columns(dataset).get(name)
    if feature is not None:
        values = [_decode(feature, v) for v in values]
    return values


def first_value(dataset: Any, name: str, look: int = 64) -> Any:
    """A column's first non-empty value among its first ``look`` rows (JSON inside it decoded), or None."""
    column = arrow_table(dataset).column(name)
    feature = _json_columns(dataset).get(name)
    for i in range(min(len(column), look)):
        value = column[i].as_py()
        if value not in (None, "", []):
            return _decode(feature, value) if feature is not None else value
    return None


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
    for name, feature in _json_columns(dataset).items():
        for row in out:
            if row.get(name) is not None:
                row[name] = _decode(feature, row[name])
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
