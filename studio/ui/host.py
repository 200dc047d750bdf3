"""The contract between the app and its panes, both ways, in one place.

- :class:`StudioHost`: what a pane may use of the app (shared state, the methods that change it, the
  run and its worker). Panes never reach into :class:`~studio.ui.app.StudioApp` by name: they see it
  through the typed :attr:`Pane.host` property.
- :class:`Pane`: what the app calls on a pane. Every pane (and the config editor) is built on it, and
  the app calls its methods directly, never by probing a pane for one.

Everything else goes down as messages (:mod:`studio.ui.messages`). The protocol is the whole contract,
so a pane's use of the app is checked by a type checker and readable here, and the app is free to
change everything else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # the first frame imports neither the run machinery nor the tokenizer
    from textual.app import App
    from textual.css.query import DOMQuery
    from textual.message import Message
    from textual.widget import Widget

    from studio.core.config import RunConfig
    from studio.core.events import Command
    from studio.core.runs import RunDir
    from studio.ui.widgets.token_counter import TokenCounter


class StudioHost(Protocol):
    """The app as its panes see it."""

    config: RunConfig
    """The config being edited; panes edit it in place and then call :meth:`config_edited`."""
    config_path: Path | None
    """Where Save writes (None until the person picks a file)."""
    current_run: RunDir | None
    """The run being followed: its events reach the panes, commands go to its worker."""
    counter: TokenCounter
    """The base model's tokenizer (or a labelled approximation) for token counts."""
    selected: tuple[int, dict[str, Any]] | None
    """The dataset row selected in the browser: (row index, raw column -> value)."""
    dataset_columns: list[str]
    """Column names of the open dataset (empty before one is open)."""

    def config_edited(self, section: str = "all", origin: Widget | None = None) -> None:
        """``config`` was edited in place: tell the other panes (``section`` names what changed)."""

    def replace_config(self, config: RunConfig, path: Path | None = None) -> None:
        """Edit ``config`` from now on (a loaded file)."""

    def select_row(self, index: int, row: dict[str, Any], origin: Widget | None = None) -> None:
        """The dataset browser moved to row ``index``."""

    def dataset_opened(self, path: str, columns: list[str], rows: int, origin: Widget | None = None) -> None:
        """A dataset finished loading in the browser: it is now the config's data."""

    def open_run(self, run: RunDir | None, start_worker: bool = False) -> None:
        """Follow ``run`` (every pane's :meth:`Pane.reset_run` is called); start its worker when asked."""

    def pick_run(self) -> None:
        """The run picker: open a run (follow it) or compare two."""

    def run_for_config(self) -> RunDir | None:
        """The run whose worker answers for the config being edited (a zero-shot preview, chat
        before any run); None (with a notice) when no run folder can be made."""

    def start_training(self) -> RunDir | None:
        """Train the config being edited in a run of its own; the run, or None (with a notice)."""

    def send_command(self, command: Command) -> None:
        """Send ``command`` to the current run's worker (a run is made first when there is none)."""

    def action_save_config(self) -> None:
        """Save the config as YAML (asks where the first time)."""


class Pane:
    """A tab's content, as the app drives it. A pane class mixes this in before its container
    (``class TrainingPane(Pane, Vertical)``) and overrides what it needs.

    A mixin rather than a Widget subclass: Textual gives every Widget subclass its own ``can_focus``,
    which would hide the container's (a focusable VerticalScroll would stop taking focus)."""

    if TYPE_CHECKING:  # provided by the Widget this is mixed into

        @property
        def app(self) -> App[Any]: ...

        @property
        def focusable(self) -> bool: ...

        @property
        def is_mounted(self) -> bool: ...

        def query(self, selector: str) -> DOMQuery[Widget]: ...

        def post_message(self, message: Message) -> bool: ...

    @property
    def host(self) -> StudioHost:
        """The app hosting this pane, through the interface panes may use."""
        # A cast, not an isinstance check: a runtime Protocol check walks every member on each call,
        # and panes read the host on hot paths (a keypress in the dataset browser).
        return cast("StudioHost", self.app)

    def focus_target(self) -> Widget | None:
        """The widget focused when the pane's tab is shown (None: nothing to focus). By default
        :meth:`key_target`: in a text field, digits would be typed instead of switching panes."""
        return self.key_target()

    def key_target(self) -> Widget | None:
        """Where the pane's keys are keys, not text (``escape`` leaves a text field for it): the pane
        when it takes focus, else its first focusable widget that is not a text field."""
        from textual.widgets import Select

        if self.focusable:
            return cast("Widget", self)
        return next((w for w in self.query("*") if w.focusable and not isinstance(w, Select)
                     and not w.check_consume_key("a", "a")), None)

    def reset_run(self, run: RunDir | None) -> None:
        """The app follows ``run`` from now on (None: no run). Forget what belonged to the old one:
        the new run's events arrive from the start of its log. By default there is nothing to forget."""
