"""The footer of key bindings, drawn as one line: a focus move costs a repaint, not a rebuild.

Textual's Footer is a row of one widget per key, recomposed whenever the bindings may have changed
(every focus move): mounting and styling a dozen widgets and re-laying out the screen, tens of
milliseconds on the event loop for a Tab press. This footer keeps the keys it shows as data, draws
them as a single Strip, and repaints only when what it would show differs. A click on a key presses
that key; hovering one shows its tooltip.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.keys import key_to_character
from textual.screen import Screen
from textual.strip import Strip
from textual.widget import Widget


class FooterEntry(NamedTuple):
    """One key the footer shows."""

    key: str
    key_display: str
    description: str
    enabled: bool
    tooltip: str


PANES_KEY = "panes"
"""The key of the footer's one entry for every pane key: shown, never pressed (a click does nothing)."""


class StudioFooter(Widget):
    """The keys that work now (the focused widget's, its pane's and the app's), how to switch panes,
    and in a text field how to leave it, in one line."""

    ALLOW_SELECT = False
    COMPONENT_CLASSES: ClassVar[set[str]] = {"studio-footer--key", "studio-footer--description"}

    DEFAULT_CSS = """
    StudioFooter {
        dock: bottom;
        height: 1;
        background: $footer-background;
        color: $footer-foreground;
        & > .studio-footer--key {
            color: $footer-key-foreground;
            background: $footer-key-background;
            text-style: bold;
        }
        & > .studio-footer--description {
            color: $footer-description-foreground;
            background: $footer-description-background;
        }
    }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.entries: tuple[FooterEntry, ...] = ()
        """The keys shown, left to right; the pane keys and the command palette's key last (drawn at
        the right)."""
        self._spans: list[tuple[int, int, FooterEntry]] = []
        self._strip: tuple[int, Strip] | None = None

    @staticmethod
    def shown_keys(screen: Screen) -> tuple[FooterEntry, ...]:
        """What a footer on ``screen`` shows: one entry per action of a shown binding (the first key
        of it), then the pane keys (``1…6``), then the command palette's key.

        In a text field (it takes every printable key), first how to leave it (``esc``), and after
        the keys that work the pane's own keys the field now takes, greyed out: they are still there,
        one ``esc`` away, and pane switching reads ``alt+1…6``."""
        app = screen.app
        focused = screen.focused
        typing = focused is not None and focused.check_consume_key("a", "a")
        entries: list[FooterEntry] = []
        if typing:
            entries.append(FooterEntry("escape", "esc", "Leave field", True,
                                       "Move out of the text field: the pane's keys work again"))
        seen: set[str] = set()
        palette = None
        panes: list[str] = []
        for key, (_, binding, enabled, tooltip) in screen.active_bindings.items():
            if binding.action == "command_palette" and app.ENABLE_COMMAND_PALETTE:
                palette = FooterEntry(key, app.get_key_display(binding), binding.description, enabled,
                                      tooltip or binding.description)
            elif binding.action.startswith("show_pane("):
                panes.append(key)
            elif binding.show and binding.action not in seen:
                seen.add(binding.action)
                entries.append(FooterEntry(key, app.get_key_display(binding), binding.description,
                                           enabled, tooltip))
        if typing and focused is not None:
            for node in focused.ancestors:
                for key, bindings in node._bindings.key_to_bindings.items():
                    for binding in bindings:
                        if binding.show and binding.action not in seen and focused.check_consume_key(
                                key, key_to_character(key)):
                            seen.add(binding.action)
                            entries.append(FooterEntry(key, app.get_key_display(binding), binding.description,
                                                       False, "esc first: the text field takes this key"))
        if panes:
            digits = sorted(key.rpartition("+")[2] for key in panes)
            modifier = "alt+" if all(key.startswith("alt+") for key in panes) else ""
            entries.append(FooterEntry(PANES_KEY, f"{modifier}{digits[0]}…{digits[-1]}", "Panes", True,
                                       "Switch panes (the tabs above can be clicked too)"))
        return (*entries, palette) if palette else tuple(entries)

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self.bindings_changed)
        self.call_after_refresh(self.bindings_changed, self.screen)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def bindings_changed(self, screen: Screen) -> None:
        """Repaint if the keys to show differ from those shown."""
        if not self.is_attached or screen is not self.screen:
            return
        entries = self.shown_keys(screen)
        if entries != self.entries:
            self.entries = entries
            self._strip = None
            self.refresh()

    def notify_style_update(self) -> None:
        """Theme or CSS changed: draw again with the new colours."""
        self._strip = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        """The one line: keys from the left; the pane keys and the palette's key pinned at the right
        edge (they stay when a narrow terminal leaves other keys out)."""
        width = self.size.width
        if self._strip is not None and self._strip[0] == width:
            return self._strip[1]
        base = self.rich_style
        key_style = base + self.get_component_rich_style("studio-footer--key")
        text_style = base + self.get_component_rich_style("studio-footer--description")
        dim = Style(dim=True)
        pinned_keys = (PANES_KEY, self.app.COMMAND_PALETTE_BINDING)
        pinned = [entry for entry in self.entries if entry.key in pinned_keys]
        keys = [entry for entry in self.entries if entry.key not in pinned_keys]

        def piece(entry: FooterEntry) -> tuple[str, str, int]:
            key_text, description = f" {entry.key_display} ", f"{entry.description} "
            return key_text, description, cell_len(key_text) + cell_len(description)

        pinned_width = sum(piece(entry)[2] for entry in pinned)
        segments: list[Segment] = []
        spans: list[tuple[int, int, FooterEntry]] = []
        x = 0

        def draw(entry: FooterEntry) -> None:
            nonlocal x
            key_text, description, size = piece(entry)
            extra = None if entry.enabled else dim
            segments.extend([Segment(key_text, key_style + extra if extra else key_style),
                             Segment(description, text_style + extra if extra else text_style)])
            spans.append((x, x + size, entry))
            x += size

        for entry in keys:
            if x + piece(entry)[2] > width - pinned_width:
                break  # no room: the rightmost keys are left out rather than cut in half
            draw(entry)
        if pinned and x + pinned_width <= width:
            segments.append(Segment(" " * (width - x - pinned_width), base))
            x = width - pinned_width
            for entry in pinned:
                draw(entry)
        strip = Strip(segments, x).extend_cell_length(width, base)
        self._spans = spans
        self._strip = (width, strip)
        return strip

    def _entry_at(self, x: int) -> FooterEntry | None:
        return next((entry for start, end, entry in self._spans if start <= x < end), None)

    def on_click(self, event: events.Click) -> None:
        """A click on a key presses it."""
        entry = self._entry_at(event.x)
        if entry is not None and entry.enabled and entry.key != PANES_KEY:
            event.stop()
            self.app.simulate_key(entry.key)

    def on_mouse_move(self, event: events.MouseMove) -> None:
        entry = self._entry_at(event.x)
        self.tooltip = (entry.tooltip or entry.description) if entry is not None else None
