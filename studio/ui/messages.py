"""Notices the app sends down to its panes (they never bubble back up).

Panes change shared state through the app (``app.config_edited``, ``app.select_row``,
``app.send_command``); the app then tells every other pane with one of these messages.
A pane handles the ones it cares about with the usual ``on_<name>`` methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:  # the app's first frame does not import the run machinery
    from studio.core.runs import RunDir


class ConfigChanged(Message, bubble=False):
    """``app.config`` was edited (or replaced); ``section`` names what changed, or ``all``."""

    def __init__(self, section: str = "all") -> None:
        super().__init__()
        self.section = section


class RunChanged(Message, bubble=False):
    """The app now follows another run (or none); its events arrive again from the start."""

    def __init__(self, run: RunDir | None) -> None:
        super().__init__()
        self.run = run


class DatasetChanged(Message, bubble=False):
    """A dataset was opened: its path, column names and row count."""

    def __init__(self, path: str, columns: list[str], rows: int) -> None:
        super().__init__()
        self.path = path
        self.columns = columns
        self.rows = rows


class RowChanged(Message, bubble=False):
    """The row selected in the dataset browser (raw column -> value), for previews."""

    def __init__(self, index: int, row: dict[str, Any]) -> None:
        super().__init__()
        self.index = index
        self.row = row


class TokenizerChanged(Message, bubble=False):
    """The token counter for the current base model is ready (or fell back to an approximation)."""
