"""Where a pane will be: its module is imported and the pane mounted after the first frame.

Kept apart from the app so that ``app.py`` stays a router: this is the one place that knows how a
pane's module is found and when it is mounted.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

from textual.containers import Container

from studio.ui.host import Pane

# (tab id, tab title, module under studio/ui/panes, class): the order is the key order 1..5.
PANES = (
    ("dataset", "Dataset", "dataset", "DatasetPane"),
    ("template", "Template", "template", "TemplatePane"),
    ("vram", "VRAM", "vram", "VramPane"),
    ("training", "Training", "training", "TrainingPane"),
    ("chat", "Chat", "chat", "ChatPane"),
)
CONFIG_PANE = ("config", "Config", "studio.ui.widgets.config_editor", "ConfigEditor")
"""The sixth tab: the config as YAML (a widget, not a pane module)."""

HIDDEN_PANES_DELAY_S = 0.6
"""Hidden panes are imported and mounted this long after start: after the shown pane is painted."""


def pane_class(module: str, cls: str) -> type[Pane]:
    """Class ``cls`` of ``module`` (a module of studio/ui/panes, or a full dotted path), imported."""
    name = module if "." in module else f"studio.ui.panes.{module}"
    found = getattr(importlib.import_module(name), cls)
    if not issubclass(found, Pane):
        raise TypeError(f"{name}.{cls} is not a studio.ui.host.Pane")
    return found


def make_pane(tab: str, module: str, cls: str) -> Pane:
    """Pane ``tab``, an instance of :func:`pane_class`."""
    return pane_class(module, cls)(id=f"pane-{tab}")


class PaneSlot(Container):
    """Where a pane will be: its module is imported and the pane mounted after the first frame.

    The first frame (title, tab bar, footer) is on screen before any pane's module is imported or
    its widgets styled; the shown pane follows a moment later, the hidden ones after it.
    """

    DEFAULT_CSS = "PaneSlot { height: 1fr; }"

    def __init__(self, tab: str, module: str, cls: str, first: bool = False,
                 on_mounted: Callable[[str], None] | None = None) -> None:
        """Pane ``tab`` will be class ``cls`` of ``module`` (see :func:`make_pane`); ``first``: it is
        the shown one, mounted right after the first frame; ``on_mounted`` is told the tab once the
        pane is mounted (the app's ``pane_mounted``)."""
        super().__init__()
        self.spec = (tab, module, cls)
        self.first = first
        self.on_mounted = on_mounted
        self.filled = False
        self._mounted = asyncio.Event()

    def on_mount(self) -> None:
        if self.first:
            self.call_after_refresh(self.fill)
        else:
            # Hidden panes wait until the shown one has been painted (or their tab is picked).
            self.set_timer(HIDDEN_PANES_DELAY_S, self.fill)

    async def fill(self) -> None:
        """Import and mount the pane (once); a second call waits until the first has mounted it."""
        if self.filled:
            await self._mounted.wait()
            return
        self.filled = True
        await self.mount(make_pane(*self.spec))
        self._mounted.set()
        if self.on_mounted is not None:
            self.on_mounted(self.spec[0])
