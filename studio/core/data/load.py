"""Datasets from disk or the hub: CSV / TSV / JSON / JSONL / Parquet files, saved HF datasets, hub ids.

``datasets`` does the reading (Arrow-backed and memory-mapped, so slicing 100k rows is cheap), but it
takes over a second to import, so it is imported inside the functions that need it: the UI imports
this module while painting its first frame. ``datasets`` never imports torch unless asked to format
rows as tensors, which nothing here does.

Every problem a person can fix is a one-line :class:`DataError` naming the file (and the line or
column) and what to do. Line numbers in files are 1-based, as editors show them.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core.paths import resolve_path

if TYPE_CHECKING:
    import datasets

FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
           ".parquet": "parquet", ".pq": "parquet", ".txt": "text"}
"""File extension -> ``datasets`` loader (``text``: plain text, one document a file, read here)."""

TEXT_COLUMN = "text"
"""The column a plain-text file's document is read into (with ``file``, its name)."""

SPLIT_NAMES = {"0": "train", "1": "validation", "2": "test", "train": "train", "validation": "validation",
               "valid": "validation", "val": "validation", "dev": "validation", "test": "test"}
"""Values accepted in a split column (Code Alpaca uses 0/1/2)."""

# Only owner/name counts as a hub id, so a mistyped file name fails at once instead of asking the hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(ValueError):
    """A data problem a person can fix; the message names the file (line/column) and what to do."""



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
                        ".json, .jsonl, .parquet, .txt or a folder saved with datasets.save_to_disk")
    if not path.is_file():  # a pipe or a device would block the read below, or never end
        raise DataError(f"{path}: not a regular file; save the data to a file and point data.path at it")
    try:
        with path.open("rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror or exc}); check its permissions") from None
    if not head.strip():
        raise DataError(f"{path}: the file is empty; add rows (CSV needs a header line first)")
    if kind != "parquet" and head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{path}: the file is UTF-16 text (what some editors call 'Unicode'); save it as UTF-8")
    if kind != "parquet" and b"\x00" in head:
        raise DataError(f"{path}: this is not a text {kind.upper()} file (it holds binary data); "
                        "check that the path points at the dataset")
    if kind != "parquet":
        # pyarrow reads invalid UTF-8 without complaint and fails later, when a row is decoded, far
        # from the file; checking the bytes first names the file and the line.
        problem = _utf8_problem(path)
        if problem:
            raise DataError(problem)
    if kind == "text":
        return _text_documents([path], path.parent)
    try:
        with _quiet_datasets():
            if kind == "csv":
                sep = "\t" if path.suffix.lower() == ".tsv" else ","
                # Every column as text, exactly as written: pandas would turn "007" into 7.0 and "NA"
                # into a missing value, silently changing what the model is trained on.
                features = datasets.Features({c: datasets.Value("string") for c in _csv_header(path, sep)})
                dataset = datasets.Dataset.from_csv(str(path), sep=sep, features=features, keep_default_na=False,
                                                    encoding="utf-8-sig")
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


def _text_documents(paths: list[Path], root: Path) -> datasets.Dataset:
    """Plain-text files as rows: each file is one document (``text``, read as UTF-8, a byte-order
    mark dropped) with its name relative to ``root`` (``file``). Training cuts a long document into
    blocks of data.max_seq_length tokens rather than dropping its tail (studio/core/data/encoding.py)."""
    import datasets

    texts: list[str] = []
    for path in paths:
        problem = _utf8_problem(path)
        if problem:
            raise DataError(problem)
        try:
            texts.append(path.read_text(encoding="utf-8-sig"))
        except OSError as exc:
            raise DataError(f"{path}: cannot read the file ({exc.strerror or exc}); check its permissions") from None
    return datasets.Dataset.from_dict({TEXT_COLUMN: texts, "file": [str(p.relative_to(root)) for p in paths]})


def _csv_header(path: Path, sep: str) -> list[str]:
    """The column names on a CSV file's first line; DataError when one is repeated or blank."""
    import csv

    try:
        # utf-8-sig: spreadsheet programs start CSV files with a byte-order mark, not part of the header.
        with path.open(newline="", encoding="utf-8-sig") as handle:
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
        problem = _utf8_problem(path) or _ragged_csv_row(path)
        if problem:
            return DataError(problem)
    if kind == "parquet":
        return DataError(f"{path}: not a readable Parquet file ({_first_line(exc)}); re-export it")
    detail = _first_line(exc.__cause__ or exc.__context__ or exc)
    if "no data" in detail:
        return DataError(f"{path}: the dataset has no rows; add some after the header line")
    return DataError(f"{path}: cannot read as {kind.upper()} ({detail}); check the file's format")


def _ragged_csv_row(path: Path) -> str | None:
    """The first CSV record whose field count differs from the header's, as a message."""
    import csv

    sep = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle, delimiter=sep)
        header = next(reader, [])
        for record in reader:
            if record and len(record) != len(header):
                # reader.line_num is the line the record ends on; a quoted newline spans several
                return (f"{path}: line {reader.line_num} has {len(record)} fields, the header has {len(header)}; "
                        f"put quotes around values that contain '{sep}' (or a newline)")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _utf8_problem(path: Path) -> str | None:
    """Where a file stops being UTF-8 text, as a message (None when it is UTF-8). Reads in chunks, so
    a large file costs no more memory than a small one."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as err:
                    # The decoder may hold back a few bytes of a previous chunk: count lines up to the
                    # bad byte in this one (a character split across chunks is at most 3 bytes back).
                    at = max(0, err.start - len(err.object) + len(chunk))
                    line += chunk.count(b"\n", 0, at)
                    bad = chunk[at] if at < len(chunk) else err.object[err.start]
                    return (f"{path}: line {line} is not UTF-8 text (byte 0x{bad:02x}); save the file as "
                            "UTF-8 (in a spreadsheet: 'CSV UTF-8'; in an editor: encoding UTF-8)")
                line += chunk.count(b"\n")
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"{path}: the file ends in the middle of a character (line {line}); save it as UTF-8"
    except OSError as exc:
        return f"{path}: cannot read the file ({exc.strerror or exc}); check its permissions"
    return None


def _find_json_problem(path: Path) -> str | None:
    """The first malformed line of a JSONL file (or position in a JSON document), as a message."""
    problem = _utf8_problem(path)
    if problem:
        return problem
    text = path.read_text(encoding="utf-8-sig")
    if text.lstrip().startswith("[") and path.suffix.lower() == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":
                return f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); fix the file"
            # "Extra data" after a first [...] line: JSON lines, named .json; read it line by line.
        else:
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
            shape = {list: "a JSON array [...]", str: "a JSON string", type(None): "null"}.get(
                type(value), "a bare number or true/false")
            return (f"{path}: line {number} is {shape}, not an object; JSONL wants one "
                    "{\"field\": value, ...} object per line, the same fields on every line")
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
                        "state.json) and holds no .csv/.json/.jsonl/.parquet/.txt files; point data.path at a file")
    texts = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if texts and not any(p.suffix.lower() in FORMATS and p.suffix.lower() != ".txt" for p in folder.iterdir()):
        return _text_documents(texts, folder)  # a folder of documents: one row a file
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
