"""Notices the app sends down to its panes (they never bubble back up).

Panes change shared state through the app (``app.config_edited``, ``app.select_row``,
``app.send_command``); the app then tells every other pane with one of these messages.
A pane handles the ones it cares about with the usual ``on_<name>`` methods.

The worker's events come down the same way: :class:`WorkerEvents` carries a batch (a few a second at
most, however fast the worker writes), and :class:`MemorySample` the newest memory measurement, which
a newer one replaces while it still waits in a pane's queue (a busy pane draws only the latest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:  # the app's first frame does not import the run machinery
    from studio.core import events as ev
    from studio.core.runs import RunDir


class ConfigChanged(Message, bubble=False):
    """``app.config`` was edited (or replaced); ``section`` names what changed, or ``all``."""

    def __init__(self, section: str = "all") -> None:
        super().__init__()
        self.section = section


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


class WorkerEvents(Message, bubble=False):
    """A batch of the followed run's events, in the order the worker wrote them (memory samples
    excepted: they come as :class:`MemorySample`). Nothing is dropped."""

    def __init__(self, run: RunDir, events: list[ev.Event]) -> None:
        super().__init__()
        self.run = run
        """The run they belong to: a batch still queued when the app switched runs is stale."""
        self.events = events


class MemorySample(Message, bubble=False):
    """The newest MemorySampled event of the followed run."""

    def __init__(self, run: RunDir, sample: ev.MemorySampled) -> None:
        super().__init__()
        self.run = run
        self.sample = sample

    def can_replace(self, message: Message) -> bool:
        """A newer sample of the same run and card (rank), queued right behind this one, makes this
        one stale."""
        return (isinstance(message, MemorySample) and message.run == self.run
                and message.sample.rank == self.sample.rank)
