"""The footer of key bindings, rebuilt only when what it shows changes.

Textual's Footer recomposes all its keys whenever bindings *may* have changed: every focus move and
every ``refresh_bindings`` call. That costs tens of milliseconds on the event loop, and most of the
time the keys it would show are the same ones (tab between two buttons of one pane). This footer
compares what it would show with what it shows and skips the rebuild when nothing differs.
"""

from __future__ import annotations

from typing import Any

from textual.screen import Screen
from textual.widgets import Footer


class StudioFooter(Footer):
    """A Footer that skips rebuilding itself when its keys, labels and states are unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shown: tuple | None = None

    @staticmethod
    def shown_keys(screen: Screen) -> tuple:
        """What a footer on ``screen`` would show: each shown binding's key, action, label, state."""
        return tuple((binding.key, binding.action, binding.description, enabled, tooltip)
                     for _, binding, enabled, tooltip in screen.active_bindings.values()
                     if binding.show or binding.action == "command_palette")

    def bindings_changed(self, screen: Screen) -> None:
        """Rebuild (as Footer does) unless the keys to show are those already shown."""
        if not (screen.app.app_focus and self.is_attached and screen is self.screen):
            self._shown = None  # the footer did not rebuild: the next call must
            super().bindings_changed(screen)
            return
        shown = self.shown_keys(screen)
        if shown == self._shown:
            return
        self._shown = shown
        super().bindings_changed(screen)
