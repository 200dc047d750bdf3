"""The config pane: the run config being edited, as the YAML that `studio train` reads.

The text is the config's :meth:`~studio.core.config.RunConfig.to_yaml`; edits are checked with the
same parser as ``studio train`` (:func:`~studio.core.config.parse_config`), so an error here names
the line and key exactly as the CLI would. Other panes' edits (template, data path, column mapping)
appear here as they happen.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.timer import Timer
from textual.widgets import Button, Static, TextArea

from studio.core.config import ConfigError, RunConfig, parse_config
from studio.ui.host import Pane
from studio.ui.messages import ConfigChanged

SECTIONS = ("model", "quantization", "lora", "prompt", "data", "trainer", "generation", "distributed")


def changed_sections(old: RunConfig, new: RunConfig) -> list[str]:
    """Names of the config sections that differ (``run`` for the top-level keys)."""
    changed = [name for name in SECTIONS if getattr(old, name) != getattr(new, name)]
    if (old.output_dir, old.name) != (new.output_dir, new.name):
        changed.append("run")
    return changed


class ConfigEditor(Pane, Vertical):
    """YAML of ``app.config``: edit, apply (F5), save (ctrl+s, from the app)."""

    BINDINGS = [
        Binding("f5", "apply", "Apply edits", id="config.apply",
                tooltip="Check the YAML and make it the config the other panes use"),
        Binding("f4", "revert", "Revert edits", id="config.revert",
                tooltip="Throw away edits not applied yet"),
    ]

    def compose(self) -> ComposeResult:
        yield Static("", id="config-status")
        yield TextArea("", id="config-yaml", show_line_numbers=True, tab_behavior="indent",
                       soft_wrap=False)
        with Horizontal(id="config-buttons"):
            yield Button("Apply (F5)", id="config-apply", variant="primary", compact=True)
            yield Button("Revert (F4)", id="config-revert", compact=True)
            yield Button("Save (ctrl+s)", id="config-save", compact=True)

    def on_mount(self) -> None:
        self._synced = ""
        self._reload_timer: Timer | None = None
        self.load_from_app()

    def focus_target(self) -> Button:
        """What gets focus when the pane is shown: Apply (Tab or a click goes into the YAML; digits
        still switch panes)."""
        return self.query_one("#config-apply", Button)

    @property
    def text_area(self) -> TextArea:
        """The YAML editor."""
        return self.query_one("#config-yaml", TextArea)

    def load_from_app(self) -> None:
        """Show the app's config (edits not applied are replaced)."""
        self._synced = self.host.config.to_yaml()
        self.text_area.load_text(self._synced)
        self._status()

    def _status(self, error: str = "") -> None:
        status = self.query_one("#config-status", Static)
        status.set_class(bool(error), "-error")
        if error:
            status.update(error)
            return
        path = self.host.config_path
        saved = f"saved as {path}" if path else "not saved yet (ctrl+s)"
        dirty = " · edits not applied (F5 applies)" if self.dirty else ""
        status.update(f"The config 'studio train' runs · {saved}{dirty}")

    @property
    def dirty(self) -> bool:
        """True when the text has edits that are not in the app's config yet."""
        return self.text_area.text != self._synced

    def apply(self) -> bool:
        """Parse the text and make it the app's config; False (and the error shown) if it is invalid."""
        if not self.dirty:
            return True
        try:
            config = parse_config(self.text_area.text, source="config pane")
        except ConfigError as exc:
            self._status(f"⚠ {exc}")
            self.app.notify(str(exc), title="Config not applied", severity="error", timeout=8)
            return False
        app = self.host
        sections = changed_sections(app.config, config)
        app.config = config
        self._synced = config.to_yaml()
        self.text_area.load_text(self._synced)
        for section in sections:
            app.config_edited(section, origin=self)
        self._status()
        return True

    def action_apply(self) -> None:
        if self.apply():
            self.notify("Config applied")

    def action_revert(self) -> None:
        self.load_from_app()

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        self._status()

    def on_config_changed(self, message: ConfigChanged) -> None:
        if self.dirty:
            self._status("The config changed in another pane; F4 shows it (your edits here are not applied)")
        elif self._reload_timer is None:
            # Several edits in a row (typing in the template) redraw the YAML once.
            self._reload_timer = self.set_timer(0.3, self._reload)

    def _reload(self) -> None:
        self._reload_timer = None
        if not self.dirty:
            self.load_from_app()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "config-apply":
            self.action_apply()
        elif event.button.id == "config-revert":
            self.action_revert()
        else:
            self.host.action_save_config()
