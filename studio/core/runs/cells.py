"""One table cell from any value: what every table Studio prints (``studio eval``, ``studio runs``,
the console's lines, the model card, the TUI's tables) does to text it did not write itself.

Rows of a dataset and a model's answers may hold anything. An escape sequence there must not reach
the terminal (it can move the cursor, recolour or clear the screen, retitle the window), and a line
break must not break the table's row, so both are handled here, once, for every table.

Plain Python: the UI and the CLI import this.
"""

from __future__ import annotations

ELLIPSIS = "…"
"""Ends a cell that was cut to its width."""

LINE_BREAK = "⏎ "
"""Stands for a line break inside a cell."""

_CONTROL_CHARACTERS = dict.fromkeys([*range(32), *range(127, 160)])
"""C0 and C1 control characters and DEL (ESC, BEL, a lone carriage return, ...): deleted."""


def cell(value: object, width: int | None = None) -> str:
    """``value`` as one line of a table cell: ``None`` as empty, line breaks shown as ``⏎``, tabs as a
    space, every other control character deleted, and cut to ``width`` characters ending in ``…``
    (not cut when ``width`` is None)."""
    text = "" if value is None else str(value)
    text = text.replace("\r\n", "\n").replace("\n", LINE_BREAK).replace("\t", " ")
    if not text.isprintable():
        text = text.translate(_CONTROL_CHARACTERS)
    if width is None or len(text) <= width:
        return text
    return text[: max(0, width - len(ELLIPSIS))] + ELLIPSIS
