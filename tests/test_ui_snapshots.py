"""Snapshots of every pane of the app in each bundled theme, at the smallest supported terminal
(100x30) and a large one (160x50). Deterministic: the bundled sample data, a tokenizer trained here,
relative paths, no cursor blink, no toasts.

Update after an intended change: pytest tests/test_ui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import pytest
from ui_helpers import idle_workers, make_config, no_blink, workdir

from studio.ui.app import StudioApp

THEMES = ("studio-dark", "studio-light")
SIZES = ((100, 30), (160, 50))


@pytest.fixture(scope="module")
def shared_workdir(tmp_path_factory):
    """One working directory for the module, so the data file is parsed once (datasets caches it)."""
    with pytest.MonkeyPatch.context() as patch:
        folder = workdir(tmp_path_factory.mktemp("snapshots"), patch)
    return folder


def studio(theme: str, pane: str) -> StudioApp:
    app = StudioApp(make_config(), settings=False, initial_pane=pane)
    app.theme = theme
    return app


async def ready(pilot) -> None:
    """The data, its statistics and lint and the template render are all done."""
    app = pilot.app
    # Hidden panes mount just after the first frame; wait for the dataset pane's lint.
    while not (app.query("#lint-summary") and app.query_one("#lint-summary").render().plain):
        await pilot.pause(0.05)
    await idle_workers(pilot)
    await pilot.pause(0.25)  # the debounced template render
    app.clear_notifications()
    no_blink(pilot.app)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("pane", ["dataset", "template", "config"])
def test_pane(pane, theme, size, snap_compare, shared_workdir, monkeypatch):
    monkeypatch.chdir(shared_workdir)
    assert snap_compare(studio(theme, pane), terminal_size=size, run_before=ready)


def test_dataset_statistics(snap_compare, shared_workdir, monkeypatch):
    monkeypatch.chdir(shared_workdir)

    async def show_stats(pilot) -> None:
        await ready(pilot)
        await pilot.press("s")
        await pilot.pause()

    assert snap_compare(studio("studio-dark", "dataset"), terminal_size=(100, 30), run_before=show_stats)

