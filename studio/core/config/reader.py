"""Plain YAML data -> config dataclasses, with errors that name the file, the line and the key.

:class:`Reader` builds any dataclass from nested dicts by its type hints (int, float, bool, str,
lists, mappings, optional values, nested dataclasses), refusing unknown keys with the nearest known
one. :mod:`studio.core.config` defines the dataclasses and checks their values; this module only
knows how to read them.

A config's mistakes are all reported at once: :meth:`Reader.report` records one and reading goes on
(a key that cannot be read keeps its default), and :meth:`Reader.check` raises one
:class:`ConfigError` holding every problem, one line each. Only what stops reading altogether (YAML
that does not parse) is raised on the spot.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
import warnings
from typing import Any


class ConfigError(ValueError):
    """Config problems a person can fix, one line each naming the file, line and key.

    ``ConfigError("x.yaml: line 2: ...")`` is one problem; a list gives several (``str()`` joins them
    with newlines; :attr:`problems` keeps them apart for a front end that prefixes each line).
    """

    def __init__(self, problems: str | list[str]):
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def error_lines(exc: BaseException) -> str:
    """``error: ...`` for each line of an error (each problem of a ConfigError), as the CLI prints it."""
    return "\n".join(f"error: {line}" for line in (str(exc).splitlines() or [""]))


class ConfigNote(UserWarning):
    """Something about a config worth one line, not worth refusing it: an other tool's key name read
    as Studio's, a Ludwig section Studio does not act on. Issued with :func:`warnings.warn`; the CLI
    prints each as ``note: ...``."""


class KeyLines:
    """The YAML's key lines; renamed keys (aliases, Ludwig's names) keep the line they were written on."""

    def __init__(self, lines: dict[tuple[str, ...], int] | None = None) -> None:
        self._lines = dict(lines or {})
        self._origins: dict[tuple[str, ...], tuple[str, ...]] = {}

    def get(self, path: tuple[str, ...], default: int | None = None) -> int | None:
        return self._lines.get(path, default)

    def rename(self, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        """Errors about ``new`` point at the line where ``old`` was written."""
        if old in self._lines:
            self._lines.setdefault(new, self._lines[old])
        self._origins.setdefault(new, self.origin(old))

    def point(self, path: tuple[str, ...], at: tuple[str, ...]) -> None:
        """Errors about ``path`` (a key the file does not write) point at the line of ``at``."""
        if at in self._lines:
            self._lines.setdefault(path, self._lines[at])

    def origin(self, path: tuple[str, ...]) -> tuple[str, ...]:
        """The key as the file wrote it (an alias or Ludwig's name) for Studio's ``path``."""
        return self._origins.get(path, path)


class Reader:
    """Turns nested dicts into dataclasses, raising errors that name file, line and key."""

    def __init__(self, source: str, lines: dict[tuple[str, ...], int] | KeyLines):
        self.source = source
        self.lines = lines
        self._problems: list[tuple[int, int, str]] = []
        self._reported: set[tuple[str, ...]] = set()

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
        """A one-problem ConfigError about ``path``, for a mistake that stops reading."""
        return ConfigError(f"{self.where(path)}: {message}")

    def report(self, path: tuple[str, ...], message: str) -> None:
        """Record a problem about ``path`` and go on reading. One problem a key: a key already
        reported (under Studio's name or the name the file wrote) is not reported again, so one
        Ludwig ``batch_size: 0`` is one line although it sets two of Studio's keys."""
        origin = self.lines.origin(path) if isinstance(self.lines, KeyLines) else path
        if origin in self._reported:
            return
        self._reported.add(origin)
        if origin != path:
            message += f" (the config writes it '{'.'.join(origin)}')"
        line = self.lines.get(path) or 1 << 30
        self._problems.append((line, len(self._problems), f"{self.where(path)}: {message}"))

    @property
    def problems(self) -> list[str]:
        """Every problem reported so far, one line each, in the order of the file's lines (those
        about a key the file does not write, last)."""
        return [text for _line, _order, text in sorted(self._problems)]

    def reported(self, path: tuple[str, ...]) -> bool:
        """Whether a problem about ``path`` has been reported."""
        origin = self.lines.origin(path) if isinstance(self.lines, KeyLines) else path
        return origin in self._reported

    def check(self) -> None:
        """Raise one ConfigError with every problem reported (in the order found), if any."""
        if self.problems:
            raise ConfigError(self.problems)

    def unknown(self, path: tuple[str, ...], known: list[str]) -> str:
        """The message for an unknown key, with the nearest known one."""
        key = path[-1]
        dotted = ".".join(path)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(known)}"
        return f"unknown key '{dotted}': {hint}"

    def build(self, cls: type, data: Any, path: tuple[str, ...]) -> Any:
        """``cls`` from a mapping; keys that cannot be read are reported and keep their defaults."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            where = ".".join(path) or "the top level"
            self.report(path, f"'{where}' must be a mapping of keys to values")
            return cls()
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in data.items():
            key = str(key)
            if key not in fields:
                self.report((*path, key), self.unknown((*path, key), list(fields)))
                continue
            try:
                values[key] = self.coerce(hints[key], value, (*path, key))
            except _Unreadable as bad:
                self.report((*path, key), str(bad))
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
        """``value`` as the type ``hint`` names; raises _Unreadable (reported by :meth:`build`)."""
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, path)
        dotted = ".".join(path)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
        if value is None:
            if type(None) in options:
                return None
            raise _Unreadable(f"'{dotted}' needs a value")
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
        raise _Unreadable(f"'{dotted}' should be {wanted}, got {value!r}")


class _Unreadable(ValueError):
    """A value of the wrong type; :meth:`Reader.build` reports it and the key keeps its default."""


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
