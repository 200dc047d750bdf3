"""The template editor, driven like a person would: edit, see the render and token count, see lint."""

from __future__ import annotations

import re
import time

import pytest
from helpers.ui import PlayedWorker, events_drawn, make_config, panes_mounted, settle, workdir
from textual.widgets import Select, Static

from studio.core import events as ev
from studio.core import prompt as prompts
from studio.ui.app import StudioApp
from studio.ui.panes.template import TemplatePane
from studio.ui.widgets.template_editor import TemplateEditor

pytestmark = pytest.mark.anyio
SIZE = (120, 36)


def counts(app) -> str:
    return str(app.query_one("#template-counts", Static).render())


def total_tokens(app) -> int:
    return int(re.search(r"([\d,]+) tokens =", counts(app)).group(1).replace(",", ""))


def lint_text(app) -> str:
    return str(app.query_one("#template-lint", Static).render())


async def replace_template(pilot, text: str) -> None:
    """Select all in the editor and type ``text`` (newlines as Enter)."""
    editor = pilot.app.query_one(TemplateEditor)
    editor.focus()
    editor.select_all()
    await pilot.press("backspace")
    keys = []
    for char in text:
        keys.append({"\n": "enter", " ": "space", "{": "left_curly_bracket", "}": "right_curly_bracket",
                     "#": "number_sign", ":": "colon"}.get(char, char))
    await pilot.press(*keys)
    await settle(pilot, rounds=1)


async def test_editing_rerenders_the_row_with_counts_and_lint(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        index, row = app.selected
        assert index == 0
        render = str(app.query_one("#template-render", Static).render())
        assert "### Instruction:" in render and row["instruction"] in render and row["output"] in render
        assert "tokenizer: tok" in counts(app)
        before = total_tokens(app)

        await replace_template(pilot, "Q: {instruction}\nA: {output}")
        assert app.config.prompt.template == "Q: {instruction}\nA: {output}"
        render = str(app.query_one("#template-render", Static).render())
        assert render.startswith(f"Q: {row['instruction']}\nA: {row['output']}")
        after = total_tokens(app)
        assert after < before  # the alpaca preamble is gone
        assert app.query_one("#template-preset", Select).value == "custom"
        # The data's input column is in no placeholder: said, not "template looks right".
        assert "column input is in no placeholder: the model never sees it" in lint_text(app)
        assert "✓" not in lint_text(app)
        await replace_template(pilot, "Q: {instruction} {input}\nA: {output}")
        assert "✓ template looks right" in lint_text(app)

        # A typo in a field name: lint names it and suggests the right one.
        await replace_template(pilot, "Q: {instrucion}\nA: {output}")
        assert "unknown field {instrucion}: did you mean {instruction}?" in lint_text(app)
        assert "line 1" in lint_text(app)
        # ... and the editor colours it as unknown.
        editor = app.query_one(TemplateEditor)
        assert any(name == "unknown" for _, _, name in editor._highlights[0])

        # No separator before the response, and text after it.
        await replace_template(pilot, "{instruction}{output} thanks")
        text = lint_text(app)
        assert "nothing separates the prompt from the response" in text
        assert "text after {output}" in text


@pytest.mark.parametrize("preset", ["alpaca_no_input", "alpaca"])
async def test_a_template_that_drops_a_column_or_names_fields_the_data_lacks_is_linted(tmp_path, monkeypatch,
                                                                                      preset):
    """alpaca_no_input on rows with an input: the input is never seen. The chat sample (the app picks
    the chat preset for it): the editor's {instruction} / {output} form is no field of conversations.
    Neither "looks right"."""
    import shutil

    from studio.core.paths import sample_data_dir

    workdir(tmp_path, monkeypatch)
    data = "code_alpaca_sample.jsonl" if preset == "alpaca_no_input" else "code_chat_sample.jsonl"
    shutil.copy(sample_data_dir() / data, tmp_path / data)
    config = make_config(data)
    config.prompt.template = preset
    app = StudioApp(config, settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        await settle(pilot)
        deadline = time.monotonic() + 30
        while "conversations" not in lint_text(app) and preset == "alpaca":  # once the rows are read
            assert time.monotonic() < deadline, lint_text(app)
            await settle(pilot, rounds=1)
        text = lint_text(app)
        assert "looks right" not in text
        if preset == "alpaca_no_input":
            assert "⚠ line 1: column input is in no placeholder: the model never sees it; the alpaca preset " \
                   "shows {input} when a row has one" in text
        elif app.config.prompt.template == "chat":  # the dataset pane switched to it, as it does for chat data
            assert "ℹ line 1: the rows are conversations: each is rendered turn by turn" in text
            assert "{output}" in text and "not this data" in text
        else:
            assert "✗ line 1: the rows are conversations" in text and "{output}" in text
            assert "set prompt.template: chat" in text


async def test_prompt_and_response_counts_follow_the_tokenizer(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        await replace_template(pilot, "{instruction}\n{output}")
        _, row = app.selected
        tokenizer = app.counter.tokenizer
        prompt_ids = tokenizer.encode(row["instruction"] + "\n", add_special_tokens=False).ids
        response_ids = tokenizer.encode(row["output"], add_special_tokens=False).ids
        shown = counts(app)
        assert f"prompt {len(prompt_ids)} + response {len(response_ids)} + EOS 1" in shown
        assert total_tokens(app) == len(prompt_ids) + len(response_ids) + 1


async def test_max_length_cut_is_marked(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(max_len=24), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        assert "✂ cut at 24" in counts(app)
        assert "✂ max length 24 ✂" in str(app.query_one("#template-render", Static).render())
        # Raising max length in the config pane removes the cut.
        app.config.data.max_seq_length = 4096
        app.config_edited("data")
        await settle(pilot, rounds=1)
        assert "✂" not in counts(app)


async def test_presets_and_no_eos_lint(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        app.query_one("#template-preset", Select).value = "alpaca_no_input"
        await settle(pilot, rounds=1)
        assert app.config.prompt.template == "alpaca_no_input"
        assert app.query_one(TemplateEditor).text == prompts.resolve_template("alpaca_no_input")
        assert "### Input:" not in str(app.query_one("#template-render", Static).render())
        # f8 cycles to the next preset: the chat template, which this tokenizer lacks.
        app.query_one(TemplateEditor).focus()
        await pilot.press("f8")
        await settle(pilot, rounds=1)
        assert app.config.prompt.template == "alpaca_no_input"
        assert any("no chat template" in str(n.message) for n in app._notifications)

        app.config.prompt.add_eos = False
        app.config_edited("prompt")
        await settle(pilot, rounds=1)
        assert "add_eos is off" in lint_text(app)
        assert "EOS" not in counts(app).split("·")[1]


async def test_without_a_tokenizer_counts_are_labelled_approximate(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(model="nobody/no-such-model"), settings=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        assert "≈ approximate token counts" in counts(app)
        assert "no local tokenizer for no-such-model" in counts(app)
        assert total_tokens(app) > 0


async def test_zero_shot_sends_the_prompt_and_streams_the_answer(tmp_path, monkeypatch):
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    worker = PlayedWorker(app)  # the worker is exercised in the worker's own tests
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2", "ctrl+g")
        (command,) = worker.sent
        assert isinstance(command, ev.Generate) and command.adapter is False
        _, row = app.selected
        assert command.prompt.endswith("### Response:\n") and row["instruction"] in command.prompt
        pane = app.query_one(TemplatePane)
        rid = command.request_id
        worker.feed([ev.ModelLoading(stage="weights", fraction=0.5)])
        await events_drawn(pilot)
        assert "loading the model: weights" in str(app.query_one("#template-zero-label", Static).render())
        worker.feed([ev.ModelLoaded(base_model="tok"),
                     ev.TokenGenerated(request_id=rid, text="def "),
                     ev.TokenGenerated(request_id="someone-else", text="nope"),
                     ev.TokenGenerated(request_id=rid, text="f():")])
        await events_drawn(pilot)
        assert str(app.query_one("#template-zero-answer", Static).render()) == "def f():"
        worker.feed([ev.GenerationFinished(request_id=rid, text="def f(): pass", new_tokens=5,
                                           tokens_per_s=10.0)])
        await events_drawn(pilot)
        assert str(app.query_one("#template-zero-answer", Static).render()) == "def f(): pass"
        assert "5 tokens" in str(app.query_one("#template-zero-label", Static).render())
        assert pane._request is None


async def test_zero_shot_shows_a_warning_as_a_note_and_keeps_the_answer(tmp_path, monkeypatch):
    """A warning while the model loads (rows truncated) is not a failure: the answer that follows
    is shown, and the warning beside it."""
    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    worker = PlayedWorker(app)  # ctrl+g makes the run
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2", "ctrl+g")
        (command,) = worker.sent
        rid = command.request_id
        worker.feed([ev.WarningRaised(kind="data", message="3 rows were truncated to 512 tokens"),
                     ev.ModelLoaded(base_model="tok"), ev.TokenGenerated(request_id=rid, text="def "),
                     ev.GenerationFinished(request_id=rid, text="def f(): pass", new_tokens=5, tokens_per_s=10.0)])
        await events_drawn(pilot)
        label = str(app.query_one("#template-zero-label", Static).render())
        assert "failed" not in label
        assert "5 tokens" in label and "rows were truncated" in label
        assert str(app.query_one("#template-zero-answer", Static).render()) == "def f(): pass"
        # A real failure still reads as one.
        await pilot.press("ctrl+g")
        worker.feed([ev.WorkerFailed(kind="oom", message="out of memory")])
        await events_drawn(pilot)
        assert "the worker failed" in str(app.query_one("#template-zero-label", Static).render())


async def wait_for(pilot, condition, what: str, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def test_start_after_a_preview_trains_the_run_the_preview_made(tmp_path, monkeypatch):
    """ctrl+g makes a draft run for the config (its worker loads the model); Start then trains that
    same run: one run folder, the one the person has been looking at, not a second one."""
    from studio.core.runs import list_runs
    from studio.ui.panes.training import TrainingPane

    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2", "ctrl+g")
        (draft, started), = worker.opened
        assert started and isinstance(worker.sent[-1], ev.Generate)
        await pilot.press("4")
        app.query_one(TrainingPane).focus()
        await pilot.press("s")
        await pilot.pause()
        assert isinstance(worker.sent[-1], ev.StartTraining)
        assert worker.opened == [(draft, True)] and app.current_run == draft
        assert list_runs("runs") == [draft]
        assert draft.id in str(app.query_one("#training-status").render())
    assert list_runs("runs") == [draft]  # trained: it stays when Studio quits


async def test_a_draft_is_removed_when_start_trains_an_edited_config_or_studio_quits(tmp_path, monkeypatch):
    """A draft made for a config that was edited since is not what Start trains: Start makes a new
    run from the config as it is now and the draft goes; a draft never trained goes when Studio
    quits. Neither stays listed as "created 0"."""
    from studio.core.runs import list_runs
    from studio.ui.panes.training import TrainingPane

    workdir(tmp_path, monkeypatch)
    app = StudioApp(make_config(), settings=False)
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2", "ctrl+g")
        (draft, _), = worker.opened
        app.config.trainer.learning_rate /= 2
        app.config_edited("trainer")
        await pilot.press("4")
        app.query_one(TrainingPane).focus()
        await pilot.press("s")
        await pilot.pause()
        (_, _), (run, started) = worker.opened
        assert started and run != draft and isinstance(worker.sent[-1], ev.StartTraining)
        assert run.config().trainer.learning_rate == app.config.trainer.learning_rate
        await wait_for(pilot, lambda: not draft.path.exists(), "the draft's removal")
        assert list_runs("runs") == [run]
    app = StudioApp(make_config(), settings=False, initial_pane="template")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+g")
        (draft, _), = worker.opened
        assert draft.path.exists()
    for _ in range(100):
        if not draft.path.exists():
            break
        await anyio_sleep(0.05)
    assert list_runs("runs") == [run]


async def anyio_sleep(seconds: float) -> None:
    import anyio

    await anyio.sleep(seconds)


async def test_a_preview_uses_the_followed_run_when_it_loads_the_same_model(tmp_path, monkeypatch):
    """With a run followed (the newest, reopened) whose worker loads the config's model, the preview
    asks that run's worker: nothing new is made. Another model in the config needs a draft."""
    from helpers.ui import fixed_run

    workdir(tmp_path, monkeypatch)
    config = make_config()
    finished = fixed_run(tmp_path / "runs", "20260101-090000-finished", make_config())
    app = StudioApp(config, run=finished, settings=False, initial_pane="template")
    worker = PlayedWorker(app)
    async with app.run_test(size=SIZE) as pilot:
        await panes_mounted(pilot)  # (the run's event follower is a thread that never idles)
        await pilot.pause(0.3)
        await pilot.press("ctrl+g")
        assert app.current_run == finished and isinstance(worker.sent[-1], ev.Generate)
        assert worker.opened == [(finished, False)]  # followed from the start; no worker asked of it yet
        config.model.base_model = "another-model"
        app.config_edited("model")
        await pilot.press("ctrl+g")
        (draft, started), = worker.opened[1:]
        assert started and draft != finished and app.current_run == draft
        assert draft.config().model.base_model == "another-model"
