"""Snapshots of every pane of the app in each bundled theme, at the smallest supported terminal
(100x30) and a large one (160x50). Deterministic: the bundled sample data, a tokenizer trained here,
relative paths, no cursor blink, no toasts. The VRAM pane estimates a local Llama-2-7B-shaped config.json
on the 24 GB card, with GPU detection off, so it shows the same on a machine with a GPU.

Update after an intended change: pytest tests/ui/test_ui_snapshots.py --snapshot-update
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.ui import idle_workers, make_config, no_blink, workdir

from studio.core.memory import gpus
from studio.ui.app import StudioApp
from studio.ui.panes.vram import VramPane
from studio.ui.widgets.block_gauge import BlockGauge

THEMES = ("studio-dark", "studio-light")
SIZES = ((100, 30), (160, 50))


@pytest.fixture(scope="module")
def shared_workdir(tmp_path_factory):
    """One working directory for the module, so the data file is parsed once (datasets caches it)."""
    with pytest.MonkeyPatch.context() as patch:
        folder = workdir(tmp_path_factory.mktemp("snapshots"), patch)
    # A model folder the VRAM pane can size: Llama-2-7B's config.json numbers, the test tokenizer.
    shutil.copytree(folder / "tok", folder / "llama-7b")
    (folder / "llama-7b" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    return folder


def studio(theme: str, pane: str, model: str = "tok") -> StudioApp:
    app = StudioApp(make_config(model=model), settings=False, initial_pane=pane)
    app.theme = theme
    return app


async def ready(pilot) -> None:
    """The data, its statistics and lint and the template render are all done."""
    app = pilot.app
    # The tokenizer arrives in a thread after the first frame and starts the statistics and lint
    # again: wait for it first, or the snapshot can catch that second pass half done.
    while "tokenizer is loading" in app.counter.label:
        await pilot.pause(0.05)
    # Hidden panes mount just after the first frame; wait for the dataset pane's lint.
    while not (app.query("#lint-summary") and app.query_one("#lint-summary").render().plain):
        await pilot.pause(0.05)

    def busy() -> bool:
        return bool(app.query("#dataset-busy")) and bool(app.query_one("#dataset-busy").display)

    # Until quiet twice, 0.25 s apart: a later analysis pass (one a message started after the first
    # check) once showed its "statistics… 10%" in a snapshot taken under a loaded CI machine.
    for _ in range(2):
        await idle_workers(pilot)
        while busy():
            await pilot.pause(0.05)
            await idle_workers(pilot)
        await pilot.pause(0.25)  # the debounced template render
    while busy():
        await pilot.pause(0.05)
        await idle_workers(pilot)
    app.clear_notifications()
    no_blink(pilot.app)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("pane", ["dataset", "template", "config"])
def test_pane(pane, theme, size, snap_compare, shared_workdir, monkeypatch):
    monkeypatch.chdir(shared_workdir)
    assert snap_compare(studio(theme, pane), terminal_size=size, run_before=ready)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("keys", [(), ("w", "right", "right", "right", "right")], ids=["predicted", "walk-qlora"])
def test_vram_pane(keys, theme, size, snap_compare, shared_workdir, monkeypatch):
    """The predicted gauge of the config, and the walkthrough's NF4 QLoRA step (w, then 4 steps on)."""
    monkeypatch.chdir(shared_workdir)
    monkeypatch.setattr(gpus, "detect_gpus", list)  # the card list must not depend on this machine

    async def walk(pilot) -> None:
        await ready(pilot)
        await pilot.press(*keys)
        await pilot.pause()
        pane = pilot.app.query_one(VramPane)
        assert pilot.app.query_one(BlockGauge).predicted, "the pane estimated nothing"
        assert pane.step_index == (4 if keys else None)

    assert snap_compare(studio(theme, "vram", model="llama-7b"), terminal_size=size, run_before=walk)


def test_dataset_statistics(snap_compare, shared_workdir, monkeypatch):
    monkeypatch.chdir(shared_workdir)

    async def show_stats(pilot) -> None:
        await ready(pilot)
        await pilot.press("s")
        await pilot.pause()

    assert snap_compare(studio("studio-dark", "dataset"), terminal_size=(100, 30), run_before=show_stats)

