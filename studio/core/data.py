"""Datasets: load CSV / JSON / JSONL / Parquet / saved HF datasets, browse them, split them.

``datasets`` does the reading (Arrow-backed and memory-mapped, so slicing 100k rows is cheap), but it
takes over a second to import, so it is imported inside the functions that need it: the UI imports
this module while painting its first frame. ``datasets`` never imports torch unless asked to format
rows as tensors, which nothing here does. Length statistics and lint are in
:mod:`studio.core.datastats` (also importable from here).

Every problem a person can fix is a one-line :class:`DataError` naming the file (and the line, row or
column) and what to do. Row numbers in messages are 0-based positions in the table, as the dataset
browser shows them; line numbers in files are 1-based, as editors show them.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core import prompt as prompts
from studio.core.paths import resolve_path  # also data.resolve_path, as before

if TYPE_CHECKING:
    import datasets

    from studio.core.config import RunConfig

FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
           ".parquet": "parquet", ".pq": "parquet"}
"""File extension -> ``datasets`` loader."""

SPLIT_NAMES = {"0": "train", "1": "validation", "2": "test", "train": "train", "validation": "validation",
               "valid": "validation", "val": "validation", "dev": "validation", "test": "test"}
"""Values accepted in a split column (Code Alpaca uses 0/1/2)."""

# Only owner/name counts as a hub id, so a mistyped file name fails at once instead of asking the hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(ValueError):
    """A data problem a person can fix; the message names the file (line/column) and what to do."""


# ------------------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence ``datasets``' progress bars and error logs: the caller reports progress and errors."""
    import datasets
    import huggingface_hub.utils.logging as hub_logging

    bars = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    hub_verbosity = hub_logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    hub_logging.set_verbosity(hub_logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        hub_logging.set_verbosity(hub_verbosity)
        if bars:
            datasets.enable_progress_bars()


def load_table(path: str | Path, hub_split: str = "train", base_dir: str | Path | None = None
               ) -> datasets.Dataset:
    """Read a dataset: a CSV/JSON/JSONL/Parquet file, a ``save_to_disk`` folder, or a hub id.

    Relative paths are tried against the working directory, then ``base_dir``. A hub id (``owner/name``
    that is not a local path) is loaded with ``datasets.load_dataset(id, split=hub_split)``. CSV columns
    are read as text, exactly as written. Raises :class:`DataError` on anything unusable.
    """
    local = resolve_path(path, base_dir)
    if local is None:
        text = str(path)
        if Path(text).suffix.lower() in FORMATS or not _HUB_ID.match(text):
            where = f" (also looked in {base_dir})" if base_dir is not None else ""
            raise DataError(f"{text}: no such file{where}; check data.path (relative paths are "
                            "resolved from the working directory, then the config's folder)")
        return _load_hub(text, hub_split)
    if local.is_dir():
        dataset = _load_folder(local, hub_split)
    else:
        dataset = _load_file(local)
    if len(dataset) == 0:
        raise DataError(f"{local}: the dataset has no rows; add some (one per line for JSONL, "
                        "after the header for CSV)")
    return dataset


def _load_file(path: Path) -> datasets.Dataset:
    import datasets

    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unsupported file type '{path.suffix or '(none)'}'; use .csv, .tsv, "
                        ".json, .jsonl, .parquet or a folder saved with datasets.save_to_disk")
    try:
        with path.open("rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror or exc}); check its permissions") from None
    if not head.strip():
        raise DataError(f"{path}: the file is empty; add rows (CSV needs a header line first)")
    if kind != "parquet" and b"\x00" in head:
        raise DataError(f"{path}: this is not a text {kind.upper()} file (it holds binary data); "
                        "check that the path points at the dataset")
    try:
        with _quiet_datasets():
            if kind == "csv":
                sep = "\t" if path.suffix.lower() == ".tsv" else ","
                # Every column as text, exactly as written: pandas would turn "007" into 7.0 and "NA"
                # into a missing value, silently changing what the model is trained on.
                features = datasets.Features({c: datasets.Value("string") for c in _csv_header(path, sep)})
                dataset = datasets.Dataset.from_csv(str(path), sep=sep, features=features, keep_default_na=False)
            elif kind == "parquet":
                dataset = datasets.Dataset.from_parquet(str(path))
            else:
                dataset = datasets.Dataset.from_json(str(path))
    except DataError:
        raise
    except Exception as exc:  # datasets wraps parser errors in several exception types
        raise _explain_failure(path, kind, exc) from None
    if kind == "json":
        dataset = _unwrap_json_object(dataset)
    return dataset


def _csv_header(path: Path, sep: str) -> list[str]:
    """The column names on a CSV file's first line; DataError when one is repeated or blank."""
    import csv

    try:
        with path.open(newline="", encoding="utf-8") as handle:
            header = next(csv.reader(handle, delimiter=sep), [])
    except UnicodeDecodeError:
        raise DataError(_utf8_problem(path) or f"{path}: not UTF-8 text; save it as UTF-8") from None
    seen: set[str] = set()
    for number, name in enumerate(header, start=1):
        if not name.strip():
            raise DataError(f"{path}: line 1, column {number} has no name; give every column a header")
        if name in seen:
            raise DataError(f"{path}: line 1: column '{name}' appears twice in the header; rename one")
        seen.add(name)
    return header


def _explain_failure(path: Path, kind: str, exc: Exception) -> DataError:
    """A DataError saying where a file that ``datasets`` could not read goes wrong."""
    if kind == "json":
        found = _find_json_problem(path)
        if found:
            return DataError(found)
    if kind == "csv":
        problem = _utf8_problem(path)
        if problem:
            return DataError(problem)
    if kind == "parquet":
        return DataError(f"{path}: not a readable Parquet file ({_first_line(exc)}); re-export it")
    detail = _first_line(exc.__cause__ or exc.__context__ or exc)
    if "no data" in detail:
        return DataError(f"{path}: the dataset has no rows; add some after the header line")
    return DataError(f"{path}: cannot read as {kind.upper()} ({detail}); check the file's format")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _utf8_problem(path: Path) -> str | None:
    """Where a file stops being UTF-8 text, as a message (None when it is UTF-8)."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        return (f"{path}: line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x}); "
                "save the file as UTF-8")
    return None


def _find_json_problem(path: Path) -> str | None:
    """The first malformed line of a JSONL file (or position in a JSON document), as a message."""
    problem = _utf8_problem(path)
    if problem:
        return problem
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); fix the file"
        return f"{path}: the JSON array must hold one object per row ({{\"instruction\": ..., ...}})"
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            return (f"{path}: line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                    "fix or delete that line (JSONL wants one object per line)")
        if not isinstance(value, dict):
            return f"{path}: line {number} is not a JSON object; JSONL wants one {{...}} object per line"
    return None


def _unwrap_json_object(dataset: datasets.Dataset) -> datasets.Dataset:
    """A .json file holding one object of columns ({"col": [...]}) or of records ({"data": [...]})
    reads as a single row of lists; turn it into the rows it means."""
    import datasets

    if len(dataset) != 1:
        return dataset
    row = dataset[0]
    values = list(row.values())
    if not values or not all(isinstance(v, list) for v in values):
        return dataset
    if len(values) == 1 and values[0] and all(isinstance(r, dict) for r in values[0]):
        return datasets.Dataset.from_list(values[0])
    if len({len(v) for v in values}) == 1:
        return datasets.Dataset.from_dict(row)
    return dataset


def _load_folder(folder: Path, hub_split: str) -> datasets.Dataset:
    import datasets

    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        try:
            with _quiet_datasets():
                loaded = datasets.load_from_disk(str(folder))
        except Exception as exc:
            raise DataError(f"{folder}: cannot read the saved dataset ({_first_line(exc)}); save it again "
                            "with datasets' save_to_disk") from None
        if isinstance(loaded, datasets.DatasetDict):
            return _join_splits(folder, loaded, hub_split)
        return loaded
    if not any(p.suffix.lower() in FORMATS for p in folder.iterdir()):
        raise DataError(f"{folder}: this folder is not a saved dataset (no dataset_dict.json or "
                        "state.json) and holds no .csv/.json/.jsonl/.parquet files; point data.path at a file")
    try:
        with _quiet_datasets():
            return datasets.load_dataset(str(folder), split=hub_split)
    except Exception as exc:
        raise DataError(f"{folder}: cannot read the data files in this folder ({_first_line(exc)}); "
                        "point data.path at one file") from None


def _join_splits(source: Path | str, splits: Any, hub_split: str) -> datasets.Dataset:
    """A DatasetDict as one table with a ``split`` column (0/1/2), so its own splits are kept."""
    import datasets

    codes = {"train": 0, "validation": 1, "test": 2}
    known = {name: codes[SPLIT_NAMES[name]] for name in splits if name in SPLIT_NAMES and not name.isdigit()}
    if "train" not in known.values() and 0 not in known.values():
        if hub_split in splits:
            return splits[hub_split]
        raise DataError(f"{source}: no '{hub_split}' split (splits: {', '.join(splits)}); set data.hub_split")
    parts = []
    for name, code in known.items():
        part = splits[name]
        if "split" not in part.column_names:
            part = part.add_column("split", [code] * len(part))
        parts.append(part)
    return datasets.concatenate_datasets(parts)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's host answers: without this, a missing network costs ~25 s of retries."""
    import os
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def _load_hub(name: str, hub_split: str) -> datasets.Dataset:
    import datasets

    if not datasets.config.HF_HUB_OFFLINE and not _hub_reachable():
        raise DataError(f"{name}: not a local file, and the Hugging Face hub cannot be reached from here; "
                        "check the path, or the network (set HF_HUB_OFFLINE=1 to use cached hub datasets)")
    try:
        with _quiet_datasets():
            loaded = datasets.load_dataset(name, split=hub_split)
    except Exception as exc:
        raise DataError(f"{name}: not a local file, and loading it from the Hugging Face hub failed "
                        f"({_first_line(exc)}); check the path or id, and the network") from None
    if len(loaded) == 0:
        raise DataError(f"{name}: split '{hub_split}' has no rows; set data.hub_split")
    return loaded


# ------------------------------------------------------------------------------------ browsing


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


# -------------------------------------------------------------------------------------- splits


@dataclass
class Splits:
    """Rows for training, validation and test; each row a dict keyed by template field names."""

    train: list[dict[str, str]]
    validation: list[dict[str, str]]
    test: list[dict[str, str]]
    indices: dict[str, list[int]] = field(default_factory=dict)
    """Each split's row positions in the loaded table (for the browser and for lint)."""

    def counts(self) -> dict[str, int]:
        """Rows per split."""
        return {"train": len(self.train), "validation": len(self.validation), "test": len(self.test)}


def template_fields_for(config: RunConfig) -> tuple[list[str], set[str]]:
    """The fields the prompt needs from each row, and which of them may be absent (rendered empty).

    ``input`` is optional for the alpaca and chat presets: rows without one use the no-input wording.
    """
    name, answer = config.prompt.template, config.prompt.response_field
    if name in ("alpaca", "chat"):
        return ["instruction", "input", answer], {"input"}
    if name == "alpaca_no_input":
        return ["instruction", answer], set()
    fields = prompts.template_fields(name)
    return fields + ([answer] if answer not in fields else []), set()


def field_columns(
    dataset: Any, fields: Sequence[str], columns: Mapping[str, str], source: str,
    optional: set[str] = frozenset(), reserved: Sequence[str] = (),
) -> dict[str, list[str]]:
    """Each template field's values (as text), read from its mapped column.

    Raises :class:`DataError` naming a missing column, the columns present, and the mapping to add.
    ``reserved`` columns (the split column) are never suggested.
    """
    table = arrow_table(dataset)
    present = table.column_names
    out: dict[str, list[str]] = {}
    for name in fields:
        column = columns.get(name, name)
        if column not in present:
            if name in optional and name not in columns:
                out[name] = [""] * table.num_rows
                continue
            # Suggest a column no other field uses: the one most like the field's name, else the first.
            used = {columns.get(f, f) for f in fields} | set(reserved)
            free = [c for c in present if c not in used]
            close = difflib.get_close_matches(column, free, n=1, cutoff=0.3)
            guess = close[0] if close else free[0] if free else "<column>"
            raise DataError(f"{source}: no column '{column}' for the template field '{name}' (columns: "
                            f"{', '.join(present)}); map it in the config with data.columns: "
                            f"{{{name}: {guess}}}")
        out[name] = [as_text(v) for v in column_values(dataset, column)]
    return out


def as_text(value: Any) -> str:
    """A cell as training text: None is empty, 3.0 is "3", other values their str()."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def load_splits(config: RunConfig, base_dir: str | Path | None = None,
                dataset: datasets.Dataset | None = None) -> Splits:
    """Load ``config.data`` and split it: by the split column when the data has one (0 train,
    1 validation, 2 test), otherwise a shuffle seeded by ``trainer.seed`` into ``val_fraction`` /
    ``test_fraction``; then ``sample_ratio`` of the training rows are kept.

    ``base_dir`` is the config file's folder (relative data paths are tried there after the working
    directory); ``dataset`` skips loading when the caller already has the table.
    """
    data = config.data
    if dataset is None:
        if not data.path:
            raise DataError("data.path is not set; name a CSV/JSON/JSONL/Parquet file, a saved dataset "
                            "folder or a hub id (or pass --data PATH)")
        dataset = load_table(data.path, data.hub_split, base_dir)
    source = str(data.path or "dataset")
    if len(dataset) == 0:
        raise DataError(f"{source}: the dataset has no rows; add some")
    fields, optional = template_fields_for(config)
    values = field_columns(dataset, fields, data.columns, source, optional,
                           reserved=[data.split_column] if data.split_column else [])
    total = len(dataset)
    table_rows = [dict(zip(values, row, strict=True)) for row in zip(*values.values(), strict=True)]

    if data.split_column and data.split_column in dataset.column_names:
        parts: dict[str, list[int]] = {"train": [], "validation": [], "test": []}
        for index, value in enumerate(column_values(dataset, data.split_column)):
            name = SPLIT_NAMES.get(as_text(value).strip().lower())
            if name is None:
                raise DataError(f"{source}: row {index}, column '{data.split_column}': split value {value!r} "
                                "is not 0/1/2 (train/validation/test); fix it or set data.split_column: null")
            parts[name].append(index)
    else:
        order = list(range(total))
        random.Random(config.trainer.seed).shuffle(order)
        n_test = _share(total, data.test_fraction)
        n_val = min(_share(total, data.val_fraction), total - n_test - 1)
        parts = {"test": sorted(order[:n_test]), "validation": sorted(order[n_test:n_test + n_val]),
                 "train": sorted(order[n_test + n_val:])}
    if not parts["train"]:
        raise DataError(f"{source}: no training rows after splitting (split column "
                        f"'{data.split_column}' has no 0s?); mark some rows 0 or lower the fractions")
    if data.sample_ratio < 1:
        keep = max(1, round(len(parts["train"]) * data.sample_ratio))
        rng = random.Random(config.trainer.seed + 1)
        parts["train"] = sorted(rng.sample(parts["train"], keep))
    return Splits(
        train=[table_rows[i] for i in parts["train"]],
        validation=[table_rows[i] for i in parts["validation"]],
        test=[table_rows[i] for i in parts["test"]],
        indices=parts,
    )


def _share(total: int, fraction: float) -> int:
    """Rows for a held-out fraction: at least one when asked for any, never all."""
    if fraction <= 0 or total < 2:
        return 0
    return min(total - 1, max(1, round(total * fraction)))


def split_counts(dataset: Any, split_column: str = "split") -> dict[str, int] | None:
    """Rows per split named by the split column, or None when the data has no such column."""
    table = arrow_table(dataset)
    if split_column not in table.column_names:
        return None
    counts = {"train": 0, "validation": 0, "test": 0, "other": 0}
    for value in column_values(dataset, split_column):
        counts[SPLIT_NAMES.get(as_text(value).strip().lower(), "other")] += 1
    return counts


_STATS = ("LengthStats", "length_stats", "ColumnStats", "column_stats", "DataIssue", "lint_rows")


def __getattr__(name: str) -> Any:
    """Statistics and lint live in :mod:`studio.core.datastats`; they are importable from here too."""
    if name in _STATS:
        from studio.core import datastats

        return getattr(datastats, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
