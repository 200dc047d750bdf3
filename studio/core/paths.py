"""Where Studio finds its bundled files and keeps its caches and settings."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def _bundled(name: str) -> Path:
    """A top-level folder of the project: beside the package in a checkout, inside it in a wheel."""
    inside = _PACKAGE / "_bundled" / name
    return inside if inside.exists() else _PACKAGE.parent / name


def sample_data_dir() -> Path:
    """The bundled sample dataset and its config."""
    return _bundled("sample_data")


def themes_dir() -> Path:
    """The bundled .tcss themes."""
    return _bundled("themes")


def cache_dir() -> Path:
    """Models Studio builds or converts (the tiny test model, the default model): $STUDIO_CACHE or
    ~/.cache/studio."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = Path(os.environ.get("STUDIO_CACHE") or xdg / "studio")
    path.mkdir(parents=True, exist_ok=True)
    return path


def settings_dir() -> Path:
    """The user's settings (theme choice): $STUDIO_CONFIG_DIR or ~/.config/studio."""
    xdg = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"))
    path = Path(os.environ.get("STUDIO_CONFIG_DIR") or xdg / "studio")
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_path(path: str | Path, base_dir: str | Path | None = None) -> Path | None:
    """A local data path: as given (relative to the working directory), else relative to ``base_dir``
    (the folder of the config that names it), else to the folder above it, so that a config kept in
    ``sample_data/`` may name ``sample_data/rows.jsonl`` the way it reads from the project root.
    None when none exists (a hub id, or a typo)."""
    candidate = Path(path).expanduser()
    if candidate.exists():
        return candidate
    if base_dir is not None and not candidate.is_absolute():
        base = Path(base_dir)
        for folder in (base, base.parent):
            if (folder / candidate).exists():
                return folder / candidate
    return None
