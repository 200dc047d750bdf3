"""Plain YAML data -> config dataclasses, with errors that name the file, the line and the key.

:class:`Reader` builds any dataclass from nested dicts by its type hints (int, float, bool, str,
lists, mappings, optional values, nested dataclasses), refusing unknown keys with the nearest known
one. :mod:`studio.core.config` defines the dataclasses and checks their values; this module only
knows how to read them.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from typing import Any


class ConfigError(ValueError):
    """A config problem a person can fix; the message names the file, line and key."""


class ConfigNote(UserWarning):
    """Something about a config worth one line, not worth refusing it: an other tool's key name read
    as Studio's, a Ludwig section Studio does not act on. Issued with :func:`warnings.warn`; the CLI
    prints each as ``note: ...``."""


class KeyLines:
    """The YAML's key lines; renamed keys (aliases, Ludwig's names) keep the line they were written on."""

    def __init__(self, lines: dict[tuple[str, ...], int] | None = None) -> None:
        self._lines = dict(lines or {})

    def get(self, path: tuple[str, ...], default: int | None = None) -> int | None:
        return self._lines.get(path, default)

    def rename(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Errors about ``new`` point at the line where ``old`` was written."""
        if old in self._lines:
            self._lines.setdefault(new, self._lines[old])


class Reader:
    """Turns nested dicts into dataclasses, raising errors that name file, line and key."""

    def __init__(self, source: str, lines: dict[tuple[str, ...], int] | KeyLines):
        self.source = source
        self.lines = lines

    def note(self, path: tuple[str, ...], message: str) -> None:
        """Tell the person something about a key without refusing the config (see :class:`ConfigNote`)."""
        warnings.warn(ConfigNote(f"{self.where(path)}: {message}"), stacklevel=2)

    def where(self, path: tuple[str, ...]) -> str:
        line = self.lines.get(path)
        if line is None and path and path[-1].isdigit():
            # A list item: its first key's line (a mapping), else the list's own (a bare value).
            known = self.lines._lines if isinstance(self.lines, KeyLines) else self.lines
            inside = [n for p, n in known.items() if p[:len(path)] == path]
            line = min(inside) if inside else self.lines.get(path[:-1])
        return f"{self.source}: line {line}" if line else self.source

    def fail(self, path: tuple[str, ...], message: str) -> ConfigError:
        return ConfigError(f"{self.where(path)}: {message}")

    def unknown(self, path: tuple[str, ...], known: list[str]) -> ConfigError:
        key = path[-1]
        dotted = ".".join(path)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(known)}"
        return self.fail(path, f"unknown key '{dotted}': {hint}")

    def build(self, cls: type, data: Any, path: tuple[str, ...]) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            where = ".".join(path) or "the top level"
            raise self.fail(path, f"'{where}' must be a mapping of keys to values")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in data.items():
            key = str(key)
            if key not in fields:
                raise self.unknown((*path, key), list(fields))
            values[key] = self.coerce(hints[key], value, (*path, key))
        return cls(**values)

    def build_item(self, cls: type, value: Any, path: tuple[str, ...]) -> Any:
        """One section of a list of sections (``grpo.rewards``): a mapping, or a bare value that
        stands for the section's first field (``- exact_match`` is ``- {name: exact_match}``)."""
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = {dataclasses.fields(cls)[0].name: value}
        elif not isinstance(value, dict):
            raise self.fail(path, f"'{'.'.join(path)}' must be a mapping of keys to values or a name, got {value!r}")
        return self.build(cls, value, path)

    def coerce(self, hint: Any, value: Any, path: tuple[str, ...]) -> Any:
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, path)
        dotted = ".".join(path)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
        if value is None:
            if type(None) in options:
                return None
            raise self.fail(path, f"'{dotted}' needs a value")
        for option in options:
            if option is type(None):
                continue
            if dataclasses.is_dataclass(option):  # an optional section (``lora: null``)
                return self.build(option, value, path)
            item = typing.get_args(option)[0] if typing.get_origin(option) is list else None
            if dataclasses.is_dataclass(item) and isinstance(value, list):
                return [self.build_item(item, v, (*path, str(i))) for i, v in enumerate(value)]
            ok, converted = _convert(option, value)
            if ok:
                return converted
        wanted = " or ".join(_type_name(o) for o in options if o is not type(None))
        raise self.fail(path, f"'{dotted}' should be {wanted}, got {value!r}")


_UnionType = type(int | None)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "text"}.get(hint, str(hint))


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, list):
            return True, [str(v) for v in value]
        return False, None
    if origin is dict:
        if isinstance(value, dict):
            return True, {str(k): str(v) for k, v in value.items()}
        return False, None
    if hint is bool:
        return (True, value) if isinstance(value, bool) else (False, None)
    if hint is int:
        if isinstance(value, bool):
            return False, None
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if hint is float:
        if isinstance(value, bool):
            return False, None
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, None
    return False, None
