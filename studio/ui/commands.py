"""The command palette (ctrl+p): every action a key can do, and the ones without a key.

Entries are gathered, not listed by hand, so a new key binding shows up here by itself: the app's
bindings, every pane's bindings (run on that pane, after bringing it to the front; a binding's
tooltip is its help line), and one entry a theme.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from studio.ui.pane_slot import CONFIG_PANE, PANES, pane_class

if TYPE_CHECKING:
    from studio.ui.app import StudioApp


@dataclass(frozen=True)
class PaletteEntry:
    """One command: what the palette shows and what it runs."""

    title: str
    help: str
    run: Callable[[], object]


def palette_entries(app: StudioApp) -> list[PaletteEntry]:
    """Every action of the app and its panes, each once."""
    entries: list[PaletteEntry] = []
    seen: set[tuple[str, str]] = set()

    def add(owner: str, action: str, title: str, help_text: str, run: Callable[[], object]) -> None:
        if (owner, action) not in seen:
            seen.add((owner, action))
            entries.append(PaletteEntry(title, help_text, run))

    for binding in app.BINDINGS:
        help_text = binding.tooltip or f"key: {binding.key.split(',')[0]}"
        run = partial(app.call_next, app.run_action, binding.action)
        add("app", binding.action, binding.description, help_text, run)
    for tab, title, module, cls in [*PANES, CONFIG_PANE]:
        # The pane's class, not the pane: hidden panes are mounted a moment after start.
        bindings = pane_class(module, cls).BINDINGS

        def on_pane(action: str, tab: str = tab) -> None:
            app.call_next(app.run_pane_action, tab, action)

        for binding in bindings:
            help_text = binding.tooltip or f"{title} pane, key: {binding.key.split(',')[0]}"
            add(tab, binding.action, f"{title}: {binding.description}", help_text,
                partial(on_pane, binding.action))
    for name in sorted(app.available_themes):
        add("theme", name, f"Theme: {name}", "Switch the colour theme (remembered next time)",
            partial(setattr, app, "theme", name))
    return entries


class StudioCommands(Provider):
    """Studio's actions for the command palette."""

    def _entries(self) -> list[PaletteEntry]:
        # Registered only by StudioApp (its COMMANDS), so the app is one.
        return palette_entries(cast("StudioApp", self.app))

    async def discover(self) -> Hits:
        for entry in self._entries():
            yield DiscoveryHit(entry.title, entry.run, help=entry.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for entry in self._entries():
            score = matcher.match(entry.title)
            if score > 0:
                yield Hit(score, matcher.highlight(entry.title), entry.run, text=entry.title, help=entry.help)
