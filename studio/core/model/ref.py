"""What ``model.base_model`` names: a local folder or a hub id, and what is wrong with a local one.

A hub id is ``owner/name`` (or a bare ``name``); anything written as a path (``/abs``, ``./rel``,
``~/x``, ``a/b/c``) means a folder on this machine. When such a folder is missing, the useful answer
is about the folder, not the hub's rules for repo ids that transformers would quote.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_local(ref: str) -> bool:
    """Whether ``ref`` is written as a path rather than a hub id (``owner/name``)."""
    return ref.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(ref) or Path(ref).expanduser().exists()


def local_problem(ref: str) -> str | None:
    """A one-line message when ``ref`` is meant as a local model folder that cannot be used, else None."""
    if not looks_local(ref):
        return None
    folder = Path(ref).expanduser()
    if not folder.exists():
        parent = next((p for p in folder.parents if p.is_dir()), None)
        where = f" ({parent} exists, {folder.relative_to(parent)} does not)" if parent not in (None, Path("/"),
                                                                                               Path(".")) else ""
        return (f"{ref}: no such model folder{where}; check model.base_model: a folder saved with "
                "save_pretrained (holding config.json), or a hub id such as owner/name")
    if not folder.is_dir():
        return f"{ref}: this is a file, not a model folder; point model.base_model at the folder holding config.json"
    if not (folder / "config.json").is_file():
        return (f"{ref}: this folder has no config.json, so it is not a saved model; point model.base_model "
                "at the folder save_pretrained wrote")
    return None
