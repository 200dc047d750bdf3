"""What a pane may use of the app that hosts it: shared state, the methods that change it, the worker.

Panes never reach into :class:`~studio.ui.app.StudioApp` by name: they see it through
:class:`StudioHost`, a Protocol the app implements, via the typed :attr:`Hosted.host` property. The
protocol is the whole contract (docs/CONTRACTS.md, "Hosting"), so a pane's use of the app is checked
by a type checker and readable in one place, and the app is free to change everything else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # the first frame imports neither the run machinery nor the tokenizer
    from textual.app import App
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
        """Edit ``config`` from now on (a loaded file, a run's config)."""

    def select_row(self, index: int, row: dict[str, Any], origin: Widget | None = None) -> None:
        """The dataset browser moved to row ``index``."""

    def dataset_opened(self, path: str, columns: list[str], rows: int, origin: Widget | None = None) -> None:
        """A dataset finished loading in the browser: it is now the config's data."""

    def open_run(self, run: RunDir | None, start_worker: bool = False) -> None:
        """Follow ``run`` (panes' ``reset_run`` is called); start its worker when asked."""

    def send_command(self, command: Command) -> None:
        """Send ``command`` to the current run's worker (a run is made first when there is none)."""

    def action_save_config(self) -> None:
        """Save the config as YAML (asks where the first time)."""


class Hosted:
    """Mixin for widgets that live inside Studio: :attr:`host` is the app, typed as a StudioHost."""

    if TYPE_CHECKING:  # provided by the Widget this is mixed into

        @property
        def app(self) -> App[Any]: ...

    @property
    def host(self) -> StudioHost:
        """The app hosting this widget, through the interface panes may use."""
        # A cast, not an isinstance check: a runtime Protocol check walks every member on each call,
        # and panes read the host on hot paths (a keypress in the dataset browser).
        return cast("StudioHost", self.app)
