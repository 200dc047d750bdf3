"""The app shell: no torch in the UI process, keys and palette reach everything, themes persist,
the config is savable as YAML that `studio train` loads, events reach panes in batches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO
from helpers.ui import PlayedWorker, events_drawn, make_config, settle, workdir
from textual.widgets import TabbedContent, TextArea

from studio.cli.app import initial_config
from studio.core import events as ev
from studio.core.config import load_config
from studio.core.data import resolve_path
from studio.core.paths import themes_dir
from studio.core.runs import create_run
from studio.ui import theme as themes
from studio.ui.app import StudioApp
from studio.ui.commands import palette_entries
from studio.ui.messages import MemorySample
from studio.ui.pane_slot import PANES
from studio.ui.panes.template import TemplatePane
from studio.ui.panes.vram import VramPane
from studio.ui.widgets.block_gauge import BlockGauge
from studio.ui.widgets.config_editor import ConfigEditor

pytestmark = pytest.mark.anyio
SIZE = (120, 36)
ROOT = REPO


def test_the_running_app_never_imports_torch(tmp_path):
    """Start the app on the sample data, let it load the data, tokenizer and render, then look."""
    script = textwrap.dedent("""
        import asyncio, sys
        from studio.ui.app import StudioApp
        from studio.cli.app import initial_config
        from studio.ui.panes.dataset import DatasetPane

        async def main():
            config, path = initial_config(None, None)
            app = StudioApp(config, path, settings=False)
            async with app.run_test(size=(100, 30)) as pilot:
                for _ in range(600):
                    await pilot.pause(0.05)
                    summary = app.query("#lint-summary")  # the pane mounts just after the first frame
                    if summary and (app.query_one(DatasetPane).issues or summary.first().render().plain):
                        break
                await pilot.press("2")
                await pilot.pause(0.3)
                assert app.query_one(DatasetPane).table is not None
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                           ("torch", "transformers", "peft", "bitsandbytes"))
            print("HEAVY", heavy)

        asyncio.run(main())
    """)
    # The caller's PYTHONPATH stays after the repository: on a machine whose packages travel on it
    # (the GPU box), textual is found there; torch is never put on it by this test.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "STUDIO_CONFIG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "HOME": str(Path.home())}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY []" in proc.stdout


def test_bare_studio_opens_the_sample_data_with_the_default_model():
    config, path = initial_config(None, None)
    assert path is None  # Save asks where; the bundled sample is never overwritten
    assert config.model.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert Path(config.data.path).is_absolute() and Path(config.data.path).exists()


async def test_panes_are_reachable_by_key_and_mouse(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        tabs = app.query_one("#panes", TabbedContent)
        app.query_one("#dataset-table").focus()
        for n, (tab, *_rest) in enumerate(PANES, start=1):
            await pilot.press(str(n))
            assert tabs.active == tab
        await pilot.press("alt+6")  # the chat pane focuses its prompt box: alt+digit still switches
        assert tabs.active == "config"
        # Typing in an editor, digits are text; alt+digit still switches and escape leaves the editor.
        app.query_one(ConfigEditor).text_area.focus()
        await pilot.press("alt+2")
        assert tabs.active == "template"
        app.query_one("#template-editor").focus()
        await pilot.press("3")
        assert tabs.active == "template"
        await pilot.press("escape", "3")
        assert tabs.active == "vram"
        await pilot.click("#--content-tab-template")
        assert tabs.active == "template"
        await pilot.click("#--content-tab-dataset")
        assert tabs.active == "dataset"
        assert app.focused is app.query_one("#dataset-table")


async def test_a_text_field_says_how_to_leave_it_and_the_footer_keeps_the_pane_keys(tmp_path, monkeypatch):
    """Typing in a field, the footer says how to leave it (esc) and how to switch panes from there
    (alt+digit), and still lists the pane's keys, greyed out; Enter in the VRAM model field leaves
    it, so the next pane key is a key, not text; esc leaves the chat prompt."""
    from textual.widgets import Input

    from studio.ui.widgets.footer import StudioFooter

    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(pilot, rounds=1)
        footer = app.query_one(StudioFooter)

        def shown() -> dict[str, tuple[str, bool]]:
            return {e.description: (e.key_display, e.enabled) for e in footer.entries}

        await pilot.pause()
        assert shown()["Panes"] == ("1…6", True) and "Leave field" not in shown()
        await pilot.press("m")
        assert isinstance(app.focused, Input) and app.focused.id == "vram-model"
        await pilot.pause()
        assert shown()["Leave field"] == ("esc", True) and footer.entries[0].description == "Leave field"
        assert shown()["Panes"] == ("alt+1…6", True)
        assert shown()["Walkthrough"] == ("w", False)  # the field takes w: shown, greyed out
        assert "Leave field" in footer.render_line(0).text and "alt+1…6 Panes" in footer.render_line(0).text
        await pilot.press("t", "o", "k", "enter")
        assert not isinstance(app.focused, Input)
        await pilot.press("w")  # a key for the pane (this model folder has nothing to walk through)...
        assert app.query_one("#vram-model", Input).value == "tok"  # ...not text
        await pilot.press("m")  # and the pane's keys work: m puts the cursor back in the field
        assert isinstance(app.focused, Input) and app.focused.id == "vram-model"
        await pilot.press("escape")
        assert not isinstance(app.focused, Input)
        await pilot.press("5")
        await settle(pilot, rounds=1)
        assert isinstance(app.focused, Input) and app.focused.id == "chat-prompt"
        await pilot.press("escape")
        assert not isinstance(app.focused, Input)
        await pilot.press("1")
        assert app.query_one("#panes", TabbedContent).active == "dataset"


async def test_every_binding_has_an_id_a_description_and_a_palette_entry(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        titles = {entry.title for entry in palette_entries(app)}
        owners = [app, *app.panes]
        checked = 0
        for owner in owners:
            for binding in getattr(type(owner), "BINDINGS", []):
                assert binding.id, f"{type(owner).__name__} binding {binding.key} has no id"
                assert binding.description, f"{binding.id} has no description"
                assert any(binding.description in title for title in titles), binding.id
                checked += 1
        assert checked >= 15
        for needed in ("Open data", "Save config", "Load config", "Train", "Stop training", "Runs",
                       "Theme: studio-light"):
            assert any(needed in title for title in titles), needed

        # Running a palette entry does what its key does.
        entry = next(e for e in palette_entries(app) if e.title == "Config pane")
        entry.run()
        await pilot.pause()
        assert app.query_one("#panes", TabbedContent).active == "config"


async def test_palette_works_before_the_hidden_panes_have_mounted(tmp_path, monkeypatch):
    """The palette lists pane commands from the pane classes: a person may open it (or press a
    key) in the moment before the hidden panes are mounted; the entry then mounts its pane."""
    import studio.ui.pane_slot as pane_slot

    monkeypatch.setattr(pane_slot, "HIDDEN_PANES_DELAY_S", 60.0)  # hidden panes never arrive alone
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert [p.id for p in app.panes if p.id != "pane-config"] == ["pane-dataset"]
        entries = palette_entries(app)
        preset = next(e for e in entries if e.title == "Template: Next preset")
        before = app.config.prompt.template
        preset.run()
        await settle(pilot, rounds=2, panes=False)
        assert app.query_one("#panes", TabbedContent).active == "template"
        assert "pane-template" in [p.id for p in app.panes]
        assert app.config.prompt.template != before  # the action ran on the pane it mounted


async def test_stop_key_reaches_the_training_pane_even_before_it_mounts(tmp_path, monkeypatch):
    """F2 (and the palette's "Stop training") is the training pane's own stop, which asks first; the
    app mounts that pane if the key comes before it has."""
    import studio.ui.pane_slot as pane_slot

    monkeypatch.setattr(pane_slot, "HIDDEN_PANES_DELAY_S", 60.0)
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert "pane-training" not in [p.id for p in app.panes]
        called: list[str] = []
        from studio.ui.panes.training import TrainingPane

        monkeypatch.setattr(TrainingPane, "action_stop_training", lambda self: called.append(self.id))
        monkeypatch.setattr(TrainingPane, "check_action", lambda self, action, params: True)  # as if training
        await pilot.press("f2")
        await settle(pilot, rounds=1, panes=False)
        assert app.query_one("#panes", TabbedContent).active == "training"
        assert called == ["pane-training"]


def test_themes_are_tcss_variables_and_the_styles_use_only_variables():
    names = {t.name: t for t in themes.bundled_themes()}
    assert {"studio-dark", "studio-light"} <= set(names)
    assert names["studio-dark"].dark and not names["studio-light"].dark
    for theme in names.values():
        assert set(themes.STUDIO_VARIABLES) <= set(theme.variables), theme.name
    literal = re.compile(r":[^;{}]*(#[0-9a-fA-F]{3,8}\b|rgba?\()")
    styles = (ROOT / "studio" / "ui" / "app.tcss").read_text()
    assert not literal.search(styles), literal.search(styles)
    with pytest.raises(themes.ThemeFileError, match="needs '\\$primary"):
        themes.parse_theme("$dark: true;", "broken", "broken.tcss")
    assert len(list(themes_dir().glob("*.tcss"))) == len(names)


async def test_theme_choice_persists(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config())
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "studio-dark"
        app.theme = "studio-light"
        await settle(pilot, rounds=1)
    assert json.loads((tmp_path / "settings" / "settings.json").read_text())["theme"] == "studio-light"
    again = StudioApp(make_config())
    async with again.run_test(size=SIZE) as pilot:
        assert again.theme == "studio-light"
        await settle(pilot, rounds=1)


async def test_save_config_writes_yaml_that_studio_train_loads(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        # Edit in the config pane: a bad value is refused with its line, a good one is applied.
        await pilot.press("6")
        editor = app.query_one(ConfigEditor)
        yaml_text = editor.text_area.text
        editor.text_area.load_text(yaml_text.replace("  r: 16", "  r: -3"))
        await pilot.press("f5")
        status = str(editor.query_one("#config-status").render())
        assert "'lora.r' must be greater than 0" in status and "line" in status
        assert app.config.lora.r == 16
        editor.text_area.load_text(yaml_text.replace("  r: 16", "  r: 8"))
        await pilot.press("f5")
        assert app.config.lora.r == 8

        # Save asks where the first time.
        await pilot.press("ctrl+s")
        dialog_input = app.screen.query_one("#dialog-path")
        dialog_input.value = str(tmp_path / "mine.yaml")
        await pilot.press("enter")
        await pilot.pause()
    saved = load_config(tmp_path / "mine.yaml")
    assert saved.lora.r == 8
    assert saved.to_yaml() == app.config.to_yaml()
    # `studio train` would find the data from here.
    assert resolve_path(saved.data.path, tmp_path) is not None


async def test_the_title_says_edited_only_once_the_config_is_edited(tmp_path, monkeypatch):
    """The untouched bundled sample is 'sample config', not 'unsaved config'; an edit says so
    (and how to keep it); a save names the file and clears it."""
    monkeypatch.chdir(tmp_path)
    config, path = initial_config(None, None)
    app = StudioApp(config, path, config_name="sample config", settings=False, initial_pane="template")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        assert app.sub_title.endswith("· sample config") and "unsaved" not in app.sub_title
        await pilot.press("f8")  # the next template preset: an edit
        await settle(pilot, rounds=1)
        assert app.sub_title.endswith("· sample config (edited, ctrl+s saves)")
        app._save_config(tmp_path / "mine.yaml")
        assert app.sub_title.endswith(f"· {tmp_path / 'mine.yaml'}")


async def test_load_config_reports_errors_and_replaces_the_config(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: 4\n")
    good = tmp_path / "good.yaml"
    config = make_config()
    config.prompt.template = "alpaca_no_input"
    config.save(good)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        for path in (bad, good):
            await pilot.press("ctrl+l")
            app.screen.query_one("#dialog-path").value = str(path)
            await pilot.press("enter")
            await settle(pilot, rounds=1)
        assert any("bad.yaml: line 2: unknown key 'lora.rank'" in str(n.message) for n in app._notifications)
        assert app.config_path == good and app.config.prompt.template == "alpaca_no_input"
        assert app.query_one(ConfigEditor).text_area.text == app.config.to_yaml()
        assert "template: alpaca_no_input" in app.query_one(ConfigEditor).query_one(TextArea).text


async def test_events_reach_panes_in_batches_without_loss(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    seen: list[list[ev.Event]] = []
    original = TemplatePane.on_worker_events
    monkeypatch.setattr(TemplatePane, "on_worker_events",
                        lambda self, message: (seen.append(message.events), original(self, message)))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        worker = PlayedWorker(app)
        app.open_run(create_run(app.config))
        for step in range(300):
            worker.feed([ev.StepLogged(step=step, seq=step)])
        await events_drawn(pilot)
        delivered = [e.step for batch in seen for e in batch]
        assert delivered == list(range(300))  # nothing dropped, in order
        assert len(seen) <= 3  # a few batches, not one call per event


async def test_a_newer_memory_sample_replaces_one_still_waiting(tmp_path, monkeypatch):
    """Memory samples come every logged step: a pane that is behind draws only the newest, while
    every other event still arrives."""
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False, initial_pane="vram")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        run = create_run(app.config)
        app.open_run(run)
        pane = app.query_one(VramPane)
        drawn: list[int] = []
        original = VramPane.on_memory_sample
        monkeypatch.setattr(VramPane, "on_memory_sample",
                            lambda self, message: (drawn.append(message.sample.step), original(self, message)))
        # Three samples queued before the pane gets to run: only the last is handled.
        for step in (1, 2, 3):
            pane.post_message(MemorySample(run, ev.MemorySampled(step=step, categories={"weights": step << 30})))
        await pilot.pause(0.2)
        assert drawn == [3]
        assert pane.measured == {"weights": 3 << 30}
        assert app.query_one(BlockGauge).measured == {"weights": 3 << 30}


async def test_a_hidden_vram_pane_draws_the_measurement_when_shown(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, rounds=1)
        run = create_run(app.config)
        app.open_run(run)
        pane = app.query_one(VramPane)
        pane.post_message(MemorySample(run, ev.MemorySampled(step=1, categories={"weights": 2 << 30})))
        await pilot.pause(0.2)
        assert pane.measured == {"weights": 2 << 30}
        await pilot.press("3")
        await pilot.pause(0.2)
        assert app.query_one(BlockGauge).measured == {"weights": 2 << 30}


def test_the_app_implements_the_host_interface_the_panes_use():
    """Panes see the app only as a StudioHost (a cast, not a runtime check): every attribute and
    method of that Protocol must exist on StudioApp, with the same parameters."""
    import inspect

    from studio.ui.host import StudioHost

    app = StudioApp(make_config(), settings=False)
    for name in StudioHost.__annotations__:
        assert hasattr(app, name), name
    methods = [n for n, v in vars(StudioHost).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert "send_command" in methods and "open_run" in methods
    for name in methods:
        expected = list(inspect.signature(getattr(StudioHost, name)).parameters)[1:]
        assert list(inspect.signature(getattr(app, name)).parameters) == expected, name
