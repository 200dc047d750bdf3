"""YAML read defensively: bounded alias expansion, no duplicate keys, and the line of every key.

A config is small, but YAML lets a small file describe a huge value: nine anchors that each repeat
the previous one nine times (the "billion laughs") expand to 10^9 values, and any code that walks
the result (checking it, dumping it) hangs. PyYAML shares aliased values instead of copying them,
so loading is cheap; the walk is not. So the document is composed into nodes first, its expanded
size is counted once per node (linear in the file), and a file whose expansion passes
:data:`MAX_VALUES` is refused before anything walks it. The same pass refuses a key written twice in
one mapping (PyYAML would silently keep the last), refuses nesting deeper than :data:`MAX_DEPTH`,
and records the line of each key for messages.

Plain Python and PyYAML only: the UI imports this.
"""

from __future__ import annotations

from typing import Any

import yaml

LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML was built with it (several times faster), else the pure-Python one."""

MAX_VALUES = 100_000
"""Most values (scalars, lists, mappings) a document may expand to, aliases counted as copies; a
Studio config has about a hundred."""

MAX_DEPTH = 50
"""Deepest nesting of lists and mappings accepted; a Studio config nests four deep. Deeper input would
exhaust Python's recursion limit in the walk and in PyYAML's constructor."""


class YamlError(ValueError):
    """The text is not YAML Studio will read; the message starts with ``<source>: line N``."""


def load(text: str, source: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    """Parse ``text`` into plain data and the 1-based line of each mapping key path.

    Raises :class:`YamlError` (naming ``source`` and the line) on a syntax error, a key repeated in
    one mapping, an alias that refers to itself, nesting past :data:`MAX_DEPTH`, or aliases
    expanding past :data:`MAX_VALUES`.
    """
    loader = LOADER(text)
    try:
        try:
            _check_depth(text, source)
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}: line {mark.line + 1}" if mark else source
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            if "nesting depth" in problem:  # PyYAML 6.0.4's scanner refuses deep nesting before we count it
                raise YamlError(f"{where}: the YAML nests more than {MAX_DEPTH} levels deep here; "
                                "a config needs a few") from None
            raise YamlError(f"{where}: not valid YAML ({problem}); check the indentation") from None
        except RecursionError:
            raise YamlError(f"{source}: the YAML is nested too deeply to read; flatten it") from None
        if node is None:
            return None, {}
        lines: dict[tuple[str, ...], int] = {}
        _Walk(source, lines).size(node, ())
        try:
            return loader.construct_document(node), lines
        except yaml.YAMLError as exc:  # a tag PyYAML's safe loader refuses (!!python/object)
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            where = f"{source}: line {mark.line + 1}" if mark else source
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise YamlError(f"{where}: {problem}; write plain values (text, numbers, lists, mappings)") from None
    finally:
        loader.dispose()


def _check_depth(text: str, source: str) -> None:
    """Refuse nesting past :data:`MAX_DEPTH` from the event stream, before anything recursive runs:
    libyaml's composer recurses in C and overflows the stack (a crash, not an exception) on a few
    hundred thousand ``[``."""
    depth = 0
    for event in yaml.parse(text, Loader=LOADER):
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlError(f"{source}: line {event.start_mark.line + 1}: the YAML nests more than "
                                f"{MAX_DEPTH} levels deep here; a config needs a few")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1


class _Walk:
    """One pass over the node graph: expanded sizes (memoised per node), duplicate keys, key lines."""

    def __init__(self, source: str, lines: dict[tuple[str, ...], int]):
        self.source = source
        self.lines = lines
        self.sizes: dict[int, int | None] = {}

    def fail(self, node: yaml.Node, message: str) -> YamlError:
        return YamlError(f"{self.source}: line {node.start_mark.line + 1}: {message}")

    def size(self, node: yaml.Node, path: tuple[str, ...] | None, depth: int = 0) -> int:
        """Values ``node`` expands to; ``path`` is its key path the first time it is met (lines are
        recorded then), None once it is reached again through an alias."""
        if depth > MAX_DEPTH:
            raise self.fail(node, f"the YAML nests more than {MAX_DEPTH} levels deep here; a config needs a few")
        key = id(node)
        if key in self.sizes:
            known = self.sizes[key]
            if known is None:
                raise self.fail(node, "an alias refers to the value that contains it; write the value out")
            return known
        self.sizes[key] = None
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value in node.value:
                name = str(key_node.value)
                if isinstance(key_node, yaml.ScalarNode):
                    if name in seen and name != "<<":
                        raise self.fail(key_node, f"key '{name}' appears twice in the same mapping; keep one")
                    seen.add(name)
                sub = (*path, name) if path is not None else None
                if sub is not None:
                    self.lines.setdefault(sub, key_node.start_mark.line + 1)
                total += self.size(key_node, None, depth + 1) + self.size(value, sub, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                total += self.size(item, (*path, str(i)) if path is not None else None, depth + 1)
        if total > MAX_VALUES:
            raise self.fail(node, f"YAML aliases here expand to more than {MAX_VALUES:,} values; a config "
                            "never needs that many: write the values out instead of repeating aliases")
        self.sizes[key] = total
        return total
