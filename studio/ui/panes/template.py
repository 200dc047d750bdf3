"""The prompt-template editor: edit the template, see the selected row rendered as training text.

Typing re-renders after a short pause (debounced): the prompt and the response (the part the loss is
computed on) in different colours, the token count from the model's tokenizer, and where
``data.max_seq_length`` cuts. A row of a chat dataset renders as its conversation through the
tokenizer's chat template, every assistant turn coloured as loss. Lint from
:func:`studio.core.prompt.lint_template` shows under the editor. "Zero-shot" sends the rendered
prompt (a conversation: its turns before the last answer) to the worker (``Generate(adapter=False)``)
and streams the base model's answer; the worker loads the model on first use and reports its progress.
The worker is the followed run's when it loads the config's model, else a draft run's that Start
then trains (``StudioHost.run_for_config``).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.timer import Timer
from textual.widgets import Button, Label, ProgressBar, Select, Static, TextArea

from studio.core import events as ev
from studio.core import prompt as prompts
from studio.core.config import PromptConfig
from studio.core.data.pairs import is_preference
from studio.core.data.shapes import TRL_STANDARD_TEMPLATE
from studio.core.data.stats import template_column_issues
from studio.core.grpo.rows import is_grpo
from studio.core.prompt import chat as chats
from studio.ui.host import Pane
from studio.ui.messages import ConfigChanged, DatasetChanged, RowChanged, TokenizerChanged, WorkerEvents
from studio.ui.widgets.pair_view import pair_preview
from studio.ui.widgets.policy_prompt import policy_preview
from studio.ui.widgets.prompt_preview import count_line, legend, measure, preview_content, untrained_note
from studio.ui.widgets.template_editor import TemplateEditor

if TYPE_CHECKING:
    from studio.core.runs import RunDir

RENDER_DELAY_S = 0.15
"""Pause after the last keystroke before re-rendering."""
CUSTOM = "custom"
PRESET_LABELS = (("alpaca", "alpaca"), ("alpaca, no input", "alpaca_no_input"),
                 ("chat template", "chat"), ("raw text", prompts.RAW_TEXT), ("custom", CUSTOM))
EXAMPLE_ROW = {"instruction": "Reverse the word 'studio'.", "input": "", "output": "oiduts"}
"""Shown until the dataset browser has a row selected."""


def row_fields(row: dict[str, Any], mapping: dict[str, str], fields: list[str]) -> dict[str, Any]:
    """A raw dataset row as template fields: ``mapping`` (field -> column) first, then same names."""
    out = dict(row)
    for name in fields:
        column = mapping.get(name, name)
        if column in row:
            out[name] = row[column]
    return out


def conversation_of(row: dict[str, Any], mapping: dict[str, str]) -> list[chats.Turn] | None:
    """The row's conversation (its chat column, ``mapping['messages']`` when set), or None."""
    mapped = mapping.get(chats.CHAT_FIELD)
    for name, value in row.items():
        if (mapped is None or name == mapped) and chats.shape_of(value) is not None:
            try:
                return chats.parse_turns(value)
            except chats.ChatFormatError:
                return None
    return None


def line_of(text: str, offset: int) -> int:
    """1-based line of a character offset."""
    return text.count("\n", 0, offset) + 1


class TemplatePane(Pane, Vertical):
    """Template editor with a live render of the selected row and a zero-shot preview."""

    BINDINGS = [
        Binding("ctrl+g", "zero_shot", "Zero-shot preview", id="template.zero_shot",
                tooltip="Send the rendered prompt to the base model and show its answer"),
        Binding("f8", "next_preset", "Next preset", id="template.next_preset",
                tooltip="Cycle the template presets: alpaca, alpaca without input, chat template"),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._render_timer: Timer | None = None
        self._request: str | None = None
        self._answer = ""
        self._note = ""
        """A warning the worker gave while answering (shown beside the finished answer)."""
        self._columns: list[str] | None = None
        self._conversations = False
        """Whether the previewed row is a conversation (a chat dataset)."""
        self._setting_text = False
        self._dirty = False
        self._stale = True

    def compose(self) -> ComposeResult:
        with Horizontal(id="template-toolbar"):
            yield Label("preset", classes="template-label")
            yield Select([(label, value) for label, value in PRESET_LABELS], allow_blank=False,
                         value=CUSTOM, id="template-preset", compact=True)
            yield Static("", id="template-settings")
            yield Button("Zero-shot (ctrl+g)", id="template-zero-shot", compact=True)
        with Horizontal(id="template-body"):
            with Vertical(id="template-left"):
                yield TemplateEditor(id="template-editor")
                yield Static("", id="template-lint")
            with Vertical(id="template-right"):
                yield Static("", id="template-counts")
                yield Static(legend(), id="template-legend")
                with VerticalScroll(id="template-render-scroll"):
                    yield Static("", id="template-render")
                with Vertical(id="template-zero"):
                    with Horizontal(id="template-zero-head"):
                        yield Static("base model, zero-shot: press ctrl+g", id="template-zero-label")
                        bar = ProgressBar(total=100, show_eta=False, id="template-zero-progress")
                        bar.display = False  # shown while a zero-shot answer streams
                        yield bar
                    with VerticalScroll(id="template-zero-scroll"):
                        yield Static("", id="template-zero-answer")

    def on_mount(self) -> None:
        if not self.query("#template-editor"):
            return  # the app quit while this pane was mounting: its children are already gone
        self._columns = list(self.host.dataset_columns) or None
        self._load_template()

    # ----------------------------------------------------------------------- the template

    @property
    def editor(self) -> TemplateEditor:
        """The template text area."""
        return self.query_one("#template-editor", TemplateEditor)

    def focus_target(self) -> VerticalScroll:
        """What gets focus when the pane is shown: the rendered example (arrows scroll it; a click or
        Tab goes into the editor; digits still switch panes)."""
        return self.query_one("#template-render-scroll", VerticalScroll)

    def _load_template(self) -> None:
        """Show ``config.prompt.template`` (a preset shows its text) and select its preset."""
        config = self.host.config
        name = config.prompt.template
        text = self._preset_text(name) if name in prompts.PRESETS else name
        if text is None:
            text, name = prompts.resolve_template("alpaca", None), "alpaca"
        if text != self.editor.text:
            self._setting_text = True
            self.editor.load_text(text)
        select = self.query_one("#template-preset", Select)
        select.value = name if name in prompts.PRESETS else CUSTOM
        self._update_fields()
        self.schedule_render(0)

    def _preset_text(self, name: str) -> str | None:
        """A preset's literal text; None (and a notice) when it cannot be made (chat without one)."""
        counter = self.host.counter
        try:
            return prompts.resolve_template(
                PromptConfig(template=name, response_field=self.host.config.prompt.response_field),
                counter.chat_template, eos_token=counter.eos_token or "")
        except prompts.TemplateError as exc:
            self.notify(str(exc), title="Preset not available", severity="warning", timeout=8)
            return None

    @on(Select.Changed, "#template-preset")
    def _preset_chosen(self, event: Select.Changed) -> None:
        name = event.value
        app = self.host
        if not isinstance(name, str) or name == CUSTOM or name == app.config.prompt.template:
            return
        text = self._preset_text(name)
        if text is None:
            event.select.value = CUSTOM if app.config.prompt.template not in prompts.PRESETS \
                else app.config.prompt.template
            return
        if (name == prompts.RAW_TEXT) != (app.config.prompt.template == prompts.RAW_TEXT):
            # Raw text trains the `text` field whole; leaving it, the answer is `output` again.
            app.config.prompt.response_field = "text" if name == prompts.RAW_TEXT else "output"
            text = self._preset_text(name) or text
        app.config.prompt.template = name
        self._setting_text = True
        self.editor.load_text(text)
        app.config_edited("prompt", origin=self)
        self.schedule_render(0)

    def action_next_preset(self) -> None:
        """Cycle alpaca -> alpaca without input -> chat template."""
        current = self.host.config.prompt.template
        order = list(prompts.PRESETS)
        following = order[(order.index(current) + 1) % len(order)] if current in order else order[0]
        self.query_one("#template-preset", Select).value = following

    @on(TextArea.Changed, "#template-editor")
    def _edited(self, event: TextArea.Changed) -> None:
        if self._setting_text:
            self._setting_text = False
            return
        # Keystrokes only restart the timer; the config, the other panes and the render follow once
        # typing pauses, so a keypress costs the TextArea's own repaint and nothing more.
        self._dirty = True
        self.schedule_render()

    def _commit_edit(self) -> None:
        """Make the edited text the config's template (a preset's name when it matches one)."""
        self._dirty = False
        app = self.host
        text = self.editor.text
        preset = next((n for n in ("alpaca", "alpaca_no_input") if self._preset_text(n) == text), None)
        if app.config.prompt.template == (preset or text):
            return
        app.config.prompt.template = preset or text
        select = self.query_one("#template-preset", Select)
        if select.value != (preset or CUSTOM):
            select.value = preset or CUSTOM
        app.config_edited("prompt", origin=self)

    # -------------------------------------------------------------------------- rendering

    def schedule_render(self, delay: float = RENDER_DELAY_S) -> None:
        """Re-render after ``delay`` seconds unless another edit comes first."""
        if self._render_timer is not None:
            self._render_timer.stop()
        # A zero interval would make Textual's Timer divide by zero.
        self._render_timer = self.set_timer(max(delay, 0.01), self.render_preview)

    def _fields(self) -> list[str]:
        from studio.core.data import template_fields_for

        return template_fields_for(self.host.config)[0]

    def _update_fields(self) -> None:
        """Tell the editor which fields the data has (unknown ones are coloured)."""
        config = self.host.config
        self.editor.set_fields(self._known_fields(), config.prompt.response_field)
        settings = (f"response: {{{config.prompt.response_field}}} · EOS {'on' if config.prompt.add_eos else 'off'}"
                    f" · max {config.data.max_seq_length} tokens")
        if is_grpo(config):  # the policy writes the response: what it samples instead
            settings = (f"GRPO: {config.grpo.num_generations} completions of up to "
                        f"{config.grpo.max_completion_length} tokens · max {config.data.max_seq_length} tokens")
        self.query_one("#template-settings", Static).update(settings)

    def _known_fields(self) -> list[str] | None:
        """Field names a row provides: its columns, plus fields mapped onto them; None without data."""
        if self._columns is None:
            return None
        mapping = self.host.config.data.columns
        return [*self._columns, *(f for f, c in mapping.items() if c in self._columns)]

    def render_preview(self) -> None:
        """Render the selected row through the template: colours, counts, the cut, and the lint."""
        if self._dirty:
            self._commit_edit()
        if not self.is_on_screen:
            # Browsing rows in the dataset pane must not pay for a hidden preview; on_show catches up.
            self._stale = True
            return
        self._stale = False
        app = self.host
        config = app.config
        text = self.editor.text
        selected = app.selected
        row = row_fields(selected[1], config.data.columns, self._fields()) if selected else EXAMPLE_ROW
        self._conversations = conversation_of(row, config.data.columns) is not None
        try:
            rendered = self._render_row(text, row)
        except prompts.TemplateError as exc:
            self.query_one("#template-render", Static).update(
                Content.from_markup("[b $error]cannot render this conversation:[/] $m", m=str(exc)))
            self._show_lint(text)
            return
        raw = config.prompt.template == prompts.RAW_TEXT
        # Raw text is cut into blocks of max_seq_length tokens for training, never truncated.
        measured = measure(rendered, app.counter, 1 << 30 if raw else config.data.max_seq_length,
                           config.prompt.add_eos)
        where = f"row {selected[0]:,}" if selected else "example row (open a dataset to use yours)"
        counts = Content.from_markup("[b $accent]$where[/] · ", where=where) + count_line(measured, app.counter)
        if raw and measured.total > config.data.max_seq_length:
            blocks = -(-measured.total // config.data.max_seq_length)
            counts += Content(f"\n{blocks} blocks of data.max_seq_length ({config.data.max_seq_length}) tokens "
                              "train it; nothing is cut")
        if is_grpo(config):
            counts = Content.from_markup("[b $accent]$where[/] · [b]a GRPO prompt: the policy writes the "
                                         "answer[/]\n[dim]$label[/]", where=where, label=app.counter.label)
            # GRPO: no answer to learn; the prompt as the policy reads it, and what the rewards get.
            column = next((k for k, v in row.items() if chats.shape_of(v) is not None), None)
            content = policy_preview(text, row, config, app.counter, conversation_of(row, config.data.columns),
                                     column)
        elif is_preference(config) and selected:
            # A DPO / ORPO row trains on two texts: the chosen answer's and the rejected one's.
            try:
                content = pair_preview(text, row, config, app.counter)
            except (prompts.TemplateError, chats.ChatFormatError) as exc:
                content = Content.from_markup("[b $error]cannot render this pair:[/] $m", m=str(exc))
        else:
            content = preview_content(measured, app.counter.eos_token)
            note = untrained_note(measured)
            if note is not None:
                counts += Content("\n") + note
        self.query_one("#template-counts", Static).update(counts)
        self.query_one("#template-render", Static).update(content)
        self._show_lint(text)

    def _render_row(self, template: str, row: dict[str, Any]) -> prompts.Rendered:
        """``row`` as training text: a conversation (with its tools) through the tokenizer's chat
        template (loss on the assistant turns and their tool calls), anything else through ``template``."""
        config = self.host.config
        turns = conversation_of(row, config.data.columns)
        if turns is None:
            return prompts.render(template, row, config.prompt.response_field)
        counter = self.host.counter
        column = chats.find_tools_column(list(row), config.data.columns)
        try:
            tools = chats.parse_tools(row.get(column)) if column else None
        except chats.ChatFormatError as exc:
            raise prompts.TemplateError(str(exc)) from None
        return chats.ChatRenderer(counter.chat_template or "", eos_token=counter.eos_token or "").render(turns, tools)

    def _show_lint(self, text: str) -> None:
        config = self.host.config
        known = self._known_fields()
        fields = known if known is not None else prompts.template_fields(text)
        issues = prompts.lint_template(text, fields, config.prompt.response_field, config.prompt.add_eos)
        if self._conversations:
            # Conversations fill the chat template's turns themselves; its {field} form is for
            # instruction rows, so the data's columns are not its fields.
            issues = [i for i in issues if i.kind != "unknown_field"]
        trl_pairs = text == TRL_STANDARD_TEMPLATE.replace("{chosen}", "{" + config.prompt.response_field + "}")
        if is_grpo(config):  # the model writes the response: a template without one is right
            issues = [i for i in issues if i.kind not in ("no_response", "response_not_at_end", "no_eos",
                                                          "double_eos", "no_separator")]
        elif self._columns is not None and not trl_pairs:  # TRL's rejected column is the pair's other side
            issues += template_column_issues(config, self._columns, conversations=self._conversations)
        lint = self.query_one("#template-lint", Static)
        lint.set_class(any(i.severity == "error" for i in issues), "-error")
        if not issues:
            lint.update(Content.from_markup("[$success]✓ template looks right[/]"))
            return
        lines = []
        for issue in issues:
            mark = {"error": "✗", "warning": "⚠"}.get(issue.severity, "ℹ")
            lines.append(f"{mark} line {line_of(text, issue.offset)}: {issue.message}")
        lint.update("\n".join(lines))

    def on_show(self) -> None:
        if self._stale:
            self.render_preview()

    # ----------------------------------------------------------------------------- messages

    def on_row_changed(self, message: RowChanged) -> None:
        self.schedule_render()

    def on_dataset_changed(self, message: DatasetChanged) -> None:
        self._columns = message.columns
        self._update_fields()
        self.schedule_render(0)

    def on_config_changed(self, message: ConfigChanged) -> None:
        if message.section in ("prompt", "all"):
            self._load_template()
        self._update_fields()
        self.schedule_render()

    def on_tokenizer_changed(self, message: TokenizerChanged) -> None:
        self.schedule_render(0)

    # ---------------------------------------------------------------------------- zero-shot

    def action_zero_shot(self) -> None:
        """Ask the base model (no adapter) to answer the rendered prompt of the selected row."""
        app = self.host
        config = app.config
        selected = app.selected
        row = row_fields(selected[1], config.data.columns, self._fields()) if selected else EXAMPLE_ROW
        turns = conversation_of(row, config.data.columns)
        asked: dict[str, str] | None = None
        if turns is not None:
            # The worker renders the conversation up to its last assistant turn with the chat template.
            before, _ = chats.split_last_answer(turns)
            asked = {chats.CHAT_FIELD: json.dumps([t.as_message() for t in before], ensure_ascii=False)}
            prompt = ""
        else:
            prompt = prompts.render(self.editor.text, row, config.prompt.response_field).prompt
        if app.run_for_config() is None:  # the followed run's worker, or a draft's for this config
            return
        self._request = uuid.uuid4().hex[:12]
        self._answer = ""
        self._note = ""
        self.query_one("#template-zero-label", Static).update("base model, zero-shot: sending…")
        self.query_one("#template-zero-answer", Static).update("")
        app.send_command(ev.Generate(request_id=self._request, prompt=prompt, row=asked, adapter=False,
                                     max_new_tokens=config.generation.max_new_tokens,
                                     temperature=config.generation.temperature, top_p=config.generation.top_p))

    @on(Button.Pressed, "#template-zero-shot")
    def _zero_shot_pressed(self) -> None:
        self.action_zero_shot()

    def reset_run(self, run: RunDir | None) -> None:
        """A new run has no answer to our request; keep waiting only if it was sent to this run."""
        for bar in self.query("#template-zero-progress"):  # (none yet while the pane is mounting)
            bar.display = False

    def on_worker_events(self, message: WorkerEvents) -> None:
        """Model loading progress and the streamed answer to our zero-shot request."""
        if self._request is None or message.run != self.host.current_run or not self.query("#template-zero-label"):
            # No zero-shot request of ours is under way (the usual case while a run trains: checked
            # first, before querying the DOM five times a second), another run's, or not composed yet.
            return
        label = self.query_one("#template-zero-label", Static)
        bar = self.query_one("#template-zero-progress", ProgressBar)
        changed = False
        for event in message.events:
            if isinstance(event, ev.ModelLoading) and self._request:
                bar.display = True
                bar.update(progress=event.fraction * 100)
                label.update(f"loading the model: {event.stage}")
            elif isinstance(event, ev.ModelLoaded) and self._request:
                bar.display = False
                label.update(f"base model, zero-shot: {event.base_model} loaded, generating…")
            elif isinstance(event, ev.TokenGenerated) and event.request_id == self._request:
                self._answer += event.text
                changed = True
            elif isinstance(event, ev.GenerationFinished) and event.request_id == self._request:
                self._answer = event.text or self._answer
                changed = True
                done = f"base model, zero-shot: {event.new_tokens} tokens at {event.tokens_per_s:.1f}/s"
                label.update(Content.from_markup("$done · [b $warning]note:[/] $m", done=done, m=self._note)
                             if self._note else done)
                self._request = None
            elif isinstance(event, ev.WarningRaised) and self._request:
                # A warning (rows truncated, no 4-bit on this machine): the answer is still coming.
                self._note = event.message
                label.update(Content.from_markup("[b $warning]note:[/] $m", m=event.message))
            elif isinstance(event, ev.WorkerFailed) and self._request:
                bar.display = False
                label.update(Content.from_markup("[b $error]the worker failed:[/] $m", m=event.message))
                self._request = None
        if changed:
            self.query_one("#template-zero-answer", Static).update(
                Content.styled(self._answer, "$studio-response"))

