"""Moving focus repaints only what changed (StudioScreen): the terminal still ends up showing what a
full repaint of the screen would show, after every Tab, on every pane."""

from __future__ import annotations

import pytest
from helpers.ui import no_blink, panes_mounted
from rich.console import Console
from rich.segment import ControlType

from studio.core.config import RunConfig
from studio.ui.app import StudioApp, StudioScreen

pytestmark = pytest.mark.anyio
SIZE = (100, 30)


class Terminal:
    """Cells as the app's updates leave them: each update's segments written at their cursor moves."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.width, self.height = size
        self.cells = [[("", None)] * self.width for _ in range(self.height)]
        self.console = Console(width=self.width, height=self.height, color_system="truecolor")

    def write(self, update) -> None:
        x = y = 0
        for segment in self.console.render(update):
            if segment.control:
                for control in segment.control:
                    if control[0] == ControlType.CURSOR_MOVE_TO:
                        x, y = control[1], control[2]
                continue
            for char in segment.text:
                if char == "\n":
                    x, y = 0, y + 1
                    continue
                if 0 <= y < self.height and 0 <= x < self.width:
                    self.cells[y][x] = (char, segment.style)
                x += 1


async def test_every_tab_leaves_the_screen_as_a_full_repaint_draws_it(tmp_path) -> None:
    app = StudioApp(RunConfig(output_dir=str(tmp_path / "runs")), settings=False)
    shown = Terminal(SIZE)
    display = app._display

    def recording(screen, update) -> None:
        display(screen, update)
        if update is not None and screen is app.screen:
            shown.write(update)

    app._display = recording
    async with app.run_test(size=SIZE) as pilot:
        no_blink(app)
        await panes_mounted(pilot)
        assert isinstance(app.screen, StudioScreen)
        for pane in ("4", "3", "5", "2", "1"):
            await pilot.press("escape", pane)
            await pilot.pause(0.3)
            moved = set()
            for _ in range(6):
                before = app.focused
                await pilot.press("tab")
                await pilot.pause(0.1)
                moved.add(app.focused is not before)
                full = Terminal(SIZE)
                full.write(app.screen._compositor.render_update(full=True))
                differing = [y for y in range(SIZE[1]) if shown.cells[y] != full.cells[y]]
                assert not differing, (f"pane {pane}, focus on {app.focused!r}: rows {differing} not repainted; "
                                       f"shown {''.join(c for c, _ in shown.cells[differing[0]])!r}, "
                                       f"full {''.join(c for c, _ in full.cells[differing[0]])!r}")
            assert moved == {True}  # each Tab moved focus, so each compared a real focus change
