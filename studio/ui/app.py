"""The Studio app: composes the panes as tabs and routes state between them.

State lives here and nowhere else: the config being edited, the run being followed, the selected row,
the token counter. Panes see the app through :class:`studio.ui.host.StudioHost` (which this class
implements), change state through its methods (``config_edited``, ``select_row``, ``send_command``...)
and hear about changes through the messages in :mod:`studio.ui.messages`; the app calls a pane only
through :class:`studio.ui.host.Pane`. Which run is followed (the newest when Studio opens, a picked
one, a draft for a preview, the one Start trains) is decided by :mod:`studio.ui.run_choice`, the app
follows it (:meth:`StudioApp.open_run`). Anything slow (the worker
socket, the event log, the tokenizer) runs in a thread worker. The link to the run's worker is
:class:`studio.ui.worker_link.WorkerLink` (``self.link``): the worker's events reach the panes as
``WorkerEvents`` messages, batched a few times a second at most, however fast the worker writes them.
Panes are mounted into :class:`studio.ui.pane_slot.PaneSlot` placeholders after the first frame.
What is left here is routing: layout, shared state, focus and the app's actions.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.reactive import Reactive
from textual.screen import UPDATE_PERIOD, Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Header, TabbedContent, TabPane, Tabs

from studio.core.config import RunConfig
from studio.ui import theme as themes
from studio.ui.frame_timer import FrameTimer
from studio.ui.host import Pane
from studio.ui.messages import ConfigChanged, DatasetChanged, RowChanged, TokenizerChanged
from studio.ui.pane_slot import CONFIG_PANE, PANES, PaneSlot
from studio.ui.run_choice import RunChoice
from studio.ui.widgets.footer import StudioFooter
from studio.ui.widgets.token_counter import TokenCounter, approximate_counter, load_token_counter
from studio.ui.worker_link import WorkerLink

if TYPE_CHECKING:  # imported where used: not needed for the first frame (see PaneSlot)
    from textual.command import Provider

    from studio.core import events as ev
    from studio.core.runs import RunDir
    from studio.ui.widgets.config_editor import ConfigEditor

def _studio_commands() -> type[Provider]:
    """The palette's provider, imported when the palette first opens (textual.command is not
    needed for the first frame)."""
    from studio.ui.commands import StudioCommands

    return StudioCommands


class StudioScreen(Screen[None]):
    """The app's main screen: Textual's, except that moving focus does not repaint all of it.

    Textual's ``Screen.focused`` is a reactive that repaints the whole screen when it changes, so every
    Tab rendered every visible widget again (a full update, ~10 ms here, three times what the partial
    update of the widgets that did change costs). The widgets whose look depends on focus repaint
    themselves (their focus and blur handlers, and the styles that :focus and :focus-within select),
    and the footer repaints its keys, so nothing else needs drawing."""

    focused: Reactive[Widget | None] = Reactive(None, repaint=False)

    _frame_timer: FrameTimer | None = None

    @property
    def _update_timer(self) -> Timer:
        """The timer that paints the screen: a :class:`FrameTimer` (a key is painted in the next frame)."""
        if self._frame_timer is None:
            timer = FrameTimer(self, UPDATE_PERIOD, name="screen_update", callback=self._on_timer_update,
                               pause=True)
            timer._start()
            self._timers.add(timer)
            self._frame_timer = timer
        return self._frame_timer


class StudioApp(App[None]):
    """Studio's terminal UI."""

    TITLE = "Studio"
    CSS_PATH = "app.tcss"
    COMMANDS = App.COMMANDS | {_studio_commands}
    BINDINGS = [
        Binding("ctrl+o", "open_dataset", "Open data", id="app.open_dataset",
                tooltip="Open a CSV, JSON, JSONL or Parquet file or a saved dataset folder"),
        Binding("ctrl+s", "save_config", "Save config", id="app.save_config",
                tooltip="Save the config as YAML that 'studio train' runs"),
        Binding("ctrl+t", "start_training", "Train", id="app.start_training",
                tooltip="Start training the current config in a background worker"),
        Binding("ctrl+l", "load_config", "Load config", id="app.load_config", show=False,
                tooltip="Open a YAML config (Studio or Ludwig layout) to edit"),
        Binding("ctrl+r", "open_run", "Runs", id="app.open_run", show=False),
        Binding("f2", "stop_training", "Stop training", id="app.stop_training", show=False),
        Binding("f3", "change_theme", "Theme", id="app.change_theme", show=False),
        Binding("ctrl+q", "quit", "Quit", id="app.quit"),
        Binding("escape", "leave_editor", "Leave the editor", id="app.leave_editor", show=False,
                tooltip="Move focus out of a text editor, so 1-6 switch panes again"),
        *[Binding(f"{n},alt+{n}", f"show_pane('{tab}')", f"{title} pane", id=f"app.show_{tab}", show=False)
          for n, (tab, title, _, _) in enumerate(PANES, start=1)],
        Binding("6,alt+6", "show_pane('config')", "Config pane", id="app.show_config", show=False),
    ]

    def __init__(self, config: RunConfig, config_path: Path | None = None, run: RunDir | None = None,
                 *, initial_pane: str | None = None, follow_latest: bool = False, config_name: str = "new config",
                 settings: bool = True, freeze_gc: bool = False) -> None:
        """``config`` is edited in place; ``config_path`` is where Save writes (asks when None);
        ``run`` is followed from the start; else, with ``follow_latest``, the newest run of the
        config's runs folder (the ``studio`` command: a run survives quitting, and opening Studio
        again shows it). ``initial_pane`` is the tab shown first (``chat``...). ``config_name``
        names a config that has no file yet in the title (``sample config``).
        ``settings`` False neither reads nor saves the theme choice (tests and snapshots).
        ``freeze_gc`` moves everything alive once the panes are mounted out of the garbage
        collector's sight (the ``studio`` command does; a test process running many apps must not)."""
        super().__init__()
        self.initial_pane = initial_pane
        self.config = config
        self.config_path = config_path
        self.config_name = config_name
        self.unsaved_edits = False
        """True once the config was edited since it was loaded or saved (the title says so)."""
        self.current_run: RunDir | None = run
        self._follow_latest_run = follow_latest and run is None
        self.runs = RunChoice(self)
        """Which run is followed, and which one a request about the config goes to."""
        self.counter: TokenCounter = dataclasses.replace(
            approximate_counter(), label="≈ approximate token counts (the tokenizer is loading…)")
        self.selected: tuple[int, dict[str, Any]] | None = None
        self.dataset_columns: list[str] = []
        self._settings = settings
        self.link = WorkerLink(self)
        """Commands to the current run's worker and its events to the panes."""
        self._mounted_panes: set[str] = set()
        self._freeze_gc = freeze_gc
        for theme in themes.bundled_themes():
            self.register_theme(theme)
        saved = themes.load_theme_choice() if settings else None
        initial = saved if saved in self.available_themes else themes.DEFAULT_THEME
        # Set before the app runs without the theme watcher: it would re-parse every stylesheet once
        # more just before the first frame. The classes it sets are set here instead.
        self.set_reactive(App.theme, initial)
        dark = self.current_theme.dark
        self.update_classes({**{name: False for name in self.classes if name.startswith("-theme-")},
                             f"-theme-{initial}": True, "-dark-mode": dark, "-light-mode": not dark},
                            update=False)
        self.stylesheet.set_variables(self.get_css_variables())  # (nothing is parsed yet)

    # ------------------------------------------------------------------------------- layout

    def get_default_screen(self) -> Screen:
        return StudioScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Header()
        initial = self.initial_pane or "dataset"
        with TabbedContent(id="panes", initial=initial):
            # Panes are imported and mounted just after the first frame is on screen (the shown one
            # first): they cost nothing before the person sees the app.
            for n, (tab, title, module, cls) in enumerate(PANES, start=1):
                with TabPane(f"{n} {title}", id=tab):
                    yield PaneSlot(tab, module, cls, first=tab == initial, on_mounted=self.pane_mounted)
            tab, _, module, cls = CONFIG_PANE
            with TabPane("6 Config", id=tab):
                yield PaneSlot(tab, module, cls, first=initial == tab, on_mounted=self.pane_mounted)
        yield StudioFooter()

    def on_mount(self) -> None:
        self.sub_title = self._subtitle()
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.link.start()
        # The tokenizer thread imports `tokenizers` holding the GIL: it starts once the shown pane
        # is on screen (pane_mounted), or after a second at the latest.
        self._tokenizer_started = False
        self.set_timer(1.0, self._start_tokenizer)
        if self.current_run is not None:
            self.open_run(self.current_run)
        elif self._follow_latest_run:
            self.runs.follow_latest()

    def _start_tokenizer(self) -> None:
        if not self._tokenizer_started:
            self._tokenizer_started = True
            self.load_tokenizer()

    def pane_mounted(self, tab: str) -> None:
        """A pane just mounted into its slot: focus it if its tab is the one shown."""
        self.call_after_refresh(self._start_tokenizer)
        self._mounted_panes.add(tab)
        if self._freeze_gc and len(self._mounted_panes) == len(PANES) + 1:  # and the config tab
            # Everything built so far lives as long as the app: move it out of the collector's
            # sight. A full collection otherwise walks it all, a 50-90 ms stall of the event loop a
            # few times a minute (a keypress landing in one waits for it).
            self.call_after_refresh(gc.freeze)
        tabs = self.query_one("#panes", TabbedContent)
        focused = self.focused
        # Before the pane arrived, focus could only land on the tab bar (the screen's auto focus).
        # Focus is set at once: a deferred focus landing after a key picked another tab would
        # bring this one back to the front.
        if tabs.active == tab and (focused is None or not focused.is_attached or isinstance(focused, Tabs)):
            self._focus_pane(tab, now=True)

    def get_theme_variable_defaults(self) -> dict[str, str]:
        """Studio's own colour variables under a theme that lacks them (Textual's built-ins)."""
        colours = self.current_theme.to_color_system().generate()
        return {name: colours[fallback] for name, fallback in themes.STUDIO_VARIABLES.items()}

    def _theme_changed(self, theme: Any) -> None:
        if self._settings:
            themes.save_theme_choice(theme.name)

    def _subtitle(self) -> str:
        where = str(self.config_path) if self.config_path else self.config_name
        if self.unsaved_edits:
            where += " (edited, ctrl+s saves)"
        run = f" · run {self.current_run.id}" if self.current_run else ""
        return f"{self.config.model.base_model} · {where}{run}"

    def config_editor(self) -> ConfigEditor | None:
        """The config tab's editor; None in the moment before it is mounted (nothing typed in it
        yet, so there is nothing of it to apply)."""
        from studio.ui.widgets.config_editor import ConfigEditor

        try:
            return self.query_one("#pane-config", ConfigEditor)
        except NoMatches:
            return None

    @property
    def panes(self) -> list[Pane]:
        """The mounted panes (and the config editor), in tab order, whatever screen is on top (a
        dialog). A pane still mounting is left out (its widgets may not exist yet): it reads the
        app's state when it mounts."""
        if not self.screen_stack:
            return []
        return [w for w in self.screen_stack[0].query("PaneSlot > *") if isinstance(w, Pane) and w.is_mounted]

    def pane(self, tab: str) -> Pane | None:
        """Pane ``tab`` (``dataset``... ``config``), or None while it has not mounted yet."""
        try:
            found = self.screen_stack[0].query_one(f"#pane-{tab}") if self.screen_stack else None
        except NoMatches:
            return None
        return found if isinstance(found, Pane) else None

    def _broadcast(self, make: Any, origin: Widget | None = None) -> None:
        """Post a fresh message from ``make()`` to every pane but ``origin``."""
        for pane in self.panes:
            if pane is not origin:
                pane.post_message(make())

    # ------------------------------------------------------------------------ shared state

    def config_edited(self, section: str = "all", origin: Widget | None = None) -> None:
        """A pane changed ``self.config`` in place: tell the others (and reload the tokenizer when
        the model changed)."""
        self.unsaved_edits = True
        self.sub_title = self._subtitle()
        self._broadcast(lambda: ConfigChanged(section), origin)
        if section in ("model", "all"):
            self.load_tokenizer()

    def replace_config(self, config: RunConfig, path: Path | None = None) -> None:
        """Edit ``config`` from now on (a loaded file)."""
        self.config = config
        self.config_path = path
        self.config_edited("all")
        self.unsaved_edits = False
        self.sub_title = self._subtitle()

    def select_row(self, index: int, row: dict[str, Any], origin: Widget | None = None) -> None:
        """The dataset browser moved to row ``index``; previews follow it."""
        self.selected = (index, row)
        self._broadcast(lambda: RowChanged(index, row), origin)

    def dataset_opened(self, path: str, columns: list[str], rows: int, origin: Widget | None = None) -> None:
        """A dataset finished loading in the browser: it is now the config's data."""
        self.dataset_columns = list(columns)
        if self.config.data.path != path:
            self.config.data.path = path
            self.config_edited("data", origin)
        self._broadcast(lambda: DatasetChanged(path, list(columns), rows), origin)

    @work(thread=True, exclusive=True, group="tokenizer", exit_on_error=False,
          description="loading the tokenizer")
    def load_tokenizer(self) -> None:
        """Find the base model's tokenizer (no torch); fall back to the labelled approximation."""
        counter = load_token_counter(self.config.model.base_model, self.config.model.revision)
        self.call_from_thread(self._tokenizer_loaded, counter)

    def _tokenizer_loaded(self, counter: TokenCounter) -> None:
        self.counter = counter
        self._broadcast(TokenizerChanged)

    # ------------------------------------------------------------------------ the run

    def open_run(self, run: RunDir | None, start_worker: bool = False) -> None:
        """Follow ``run`` from now on: every pane forgets the old run (:meth:`Pane.reset_run`), and
        the new run's events replay from the start of its log, then arrive live. ``start_worker``
        starts its worker when none is alive. The config being edited is left as it is.

        The run followed before is let go: its worker is shut down if it never trained (it only
        answered previews or chat), so that the GPU is free, and a draft that never trained is
        removed with it (:mod:`studio.ui.run_choice`)."""
        previous = self.current_run
        self.link.leave(previous, run, discard=self.runs.leaving(previous, run))
        self.current_run = run
        self.sub_title = self._subtitle()
        for pane in self.panes:
            pane.reset_run(run)
        self.link.follow(run, start_worker)

    def pick_run(self) -> None:
        """The run picker: open a run (follow it) or compare two."""
        self.runs.pick()

    def run_for_config(self) -> RunDir | None:
        """The run whose worker answers for the config being edited (a zero-shot preview, chat
        before any run): the followed one when it loads the same model, else a draft."""
        return self.runs.for_config()

    def start_training(self) -> RunDir | None:
        """Train the config being edited: in the followed draft when it was made from this very
        config, else in a new run; its worker is started and sent StartTraining."""
        from studio.core import events as ev

        run = self.runs.for_training()
        if run is not None:
            self.send_command(ev.StartTraining())
        return run

    def send_command(self, command: ev.Command) -> None:
        """Send ``command`` to the current run's worker, starting it when none is alive (from a
        thread; queued until connected). With no run, to :meth:`run_for_config`'s."""
        if self.current_run is None and self.run_for_config() is None:
            return
        self.link.queue(command)
        self.link.deliver(start=True)

    # ------------------------------------------------------------------------------ actions

    def action_show_pane(self, tab: str) -> None:
        """Bring a pane to the front."""
        self.query_one("#panes", TabbedContent).active = tab

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Focus the shown pane's main widget, so its keys are live and listed in the footer."""
        if event.tabbed_content.id == "panes" and event.pane.id is not None:
            for slot in event.pane.query(PaneSlot):
                self.call_next(slot.fill)  # picked before its pane was mounted: mount it now
            self._focus_pane(event.pane.id)

    def action_leave_editor(self) -> None:
        """Leave a text field for a widget of its pane where keys are keys (digits switch panes
        again): the pane's main widget, unless that is the field itself (the chat prompt)."""
        pane = self.pane(self.query_one("#panes", TabbedContent).active)
        if pane is None:
            return
        widget = pane.focus_target()
        if widget is None or widget.check_consume_key("a", "a"):
            widget = pane.key_target()
        self.set_focus(widget)

    def _focus_pane(self, tab: str, now: bool = False) -> None:
        """Focus pane ``tab``'s main widget; ``now`` sets it at once instead of after the queue."""
        pane = self.pane(tab)
        if pane is None:
            return  # still mounting: it takes focus when it arrives (pane_mounted)
        widget = pane.focus_target()
        if widget is None:
            self.set_focus(None)
        elif now:
            self.set_focus(widget)
        else:
            widget.focus()

    def action_open_dataset(self) -> None:
        """Show the dataset browser's file picker."""
        self.call_next(self.run_pane_action, "dataset", "open_file")

    async def run_pane_action(self, tab: str, action: str) -> None:
        """Bring pane ``tab`` to the front and run its ``action``, mounting the pane first if the
        person got here before it arrived (a key or palette entry in the first moment)."""
        self.action_show_pane(tab)
        for slot in self.query(PaneSlot):
            if slot.spec[0] == tab:
                await slot.fill()
        pane = self.pane(tab)
        if pane is not None:
            await self.run_action(action, pane)

    def action_save_config(self) -> None:
        """Save the config as YAML; asks where the first time."""
        if self.config_path is not None:
            self._save_config(self.config_path)
            return
        from studio.ui.widgets.dialogs import PathDialog

        self.push_screen(PathDialog("Save the config as", "studio.yaml", must_exist=False),
                         lambda path: path and self._save_config(path))

    def _save_config(self, path: Path) -> None:
        editor = self.config_editor()
        if editor is not None and not editor.apply():
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.config.save(path)
        except OSError as exc:
            self.notify(f"{path}: cannot write ({exc.strerror}); pick another folder", severity="error")
            return
        self.config_path = path
        self.unsaved_edits = False
        self.sub_title = self._subtitle()
        self.notify(f"Saved {path}; train it with: studio train {path}", title="Config saved")

    def action_load_config(self) -> None:
        """Load a YAML config (Studio or Ludwig layout) and edit it."""
        from studio.core.config import ConfigError, load_config

        def load(path: Path | None) -> None:
            if path is None:
                return
            try:
                config = load_config(path)
            except ConfigError as exc:
                self.notify(str(exc), title="Config not loaded", severity="error", timeout=10)
                return
            self.replace_config(config, path)
            self.notify(f"Loaded {path}")

        from studio.ui.widgets.dialogs import PathDialog

        self.push_screen(PathDialog("Load a config", str(self.config_path or ""), must_exist=True), load)

    def action_start_training(self) -> None:
        """Train the current config (the training pane's Start: it shows the run from then on)."""
        editor = self.config_editor()
        if editor is not None and not editor.apply():
            return
        self.call_next(self.run_pane_action, "training", "start_training")

    def action_stop_training(self) -> None:
        """Checkpoint, save the adapter and stop the current run's training (the pane asks first)."""
        self.call_next(self.run_pane_action, "training", "stop_training")

    def action_open_run(self) -> None:
        """Pick a run from the runs folder and follow it (plots, chat), or compare two."""
        self.pick_run()

    def action_change_theme(self) -> None:
        """Pick a theme (the choice is remembered)."""
        self.search_themes()

    def on_unmount(self) -> None:
        draft = self.runs.draft()
        if draft is not None:
            self.link.retire(draft, discard=True)  # never trained: it must not stay listed
        self.link.close()
