"""Studio's themes: TCSS variable files in themes/ turned into Textual themes, and the saved choice.

A theme file (``themes/<name>.tcss``) holds only variable declarations (``$primary: #5FA8F5;``).
The standard colour names build Textual's colour system; any other name (``$studio-response``)
becomes a theme variable the app's styles can use. The chosen theme is remembered in
``settings.json`` under :func:`studio.core.paths.settings_dir`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from textual.theme import Theme

from studio.core.paths import settings_dir, themes_dir

DEFAULT_THEME = "studio-dark"

# Theme fields that take a colour; everything else declared in a file goes to Theme.variables.
_COLOUR_FIELDS = ("primary", "secondary", "warning", "error", "success", "accent", "foreground",
                  "background", "surface", "panel", "boost")
_DECLARATION = re.compile(r"^\s*\$([A-Za-z0-9_-]+)\s*:\s*([^;]+?)\s*;", re.MULTILINE)
_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)

# Studio's own variables, with the standard colour each falls back to under a theme that does not
# define it (e.g. Textual's built-in themes, which the theme picker also offers).
STUDIO_VARIABLES = {
    "studio-prompt": "foreground-muted",
    "studio-response": "success",
    "studio-field": "accent",
    "studio-field-unknown": "error",
    "studio-truncated": "error",
}


class ThemeFileError(ValueError):
    """A theme file that cannot be read; the message names the file and the problem."""


def parse_theme(text: str, name: str, source: str = "theme") -> Theme:
    """Build a Theme from the variable declarations in ``text`` (a themes/*.tcss file)."""
    values = dict(_DECLARATION.findall(_COMMENT.sub("", text)))
    if "primary" not in values:
        raise ThemeFileError(f"{source}: a theme needs '$primary: <colour>;' (see themes/studio-dark.tcss)")
    dark_text = values.pop("dark", "true").lower()
    if dark_text not in ("true", "false"):
        raise ThemeFileError(f"{source}: '$dark' must be true or false, not {dark_text!r}")
    colours = {key: values.pop(key) for key in _COLOUR_FIELDS if key in values}
    return Theme(name=name, dark=dark_text == "true", variables=values, **colours)


def bundled_themes(folder: Path | None = None) -> list[Theme]:
    """Every theme in ``folder`` (default: the bundled themes/), sorted by name."""
    folder = folder or themes_dir()
    themes = []
    for path in sorted(folder.glob("*.tcss")):
        themes.append(parse_theme(path.read_text(encoding="utf-8"), path.stem, str(path)))
    return themes


def _settings_path() -> Path:
    return settings_dir() / "settings.json"


def load_theme_choice() -> str | None:
    """The theme name saved last time, or None (no file, or a file that cannot be read)."""
    try:
        value = json.loads(_settings_path().read_text(encoding="utf-8")).get("theme")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def save_theme_choice(name: str) -> None:
    """Remember ``name`` as the theme for the next start (other settings in the file are kept)."""
    path = _settings_path()
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(settings, dict):
            settings = {}
    except (OSError, ValueError):
        settings = {}
    settings["theme"] = name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
