"""The chat pane: one prompt, two answers side by side — the base model (zero-shot) and the fine-tune.

Both answers come from the run's one worker: ``Generate(adapter=False)`` answers through peft's
``disable_adapter()``, ``Generate(adapter=True)`` with the adapter as it is now (during training too).
Each request has its own ``request_id``; streamed ``TokenGenerated`` events are matched by it.
The worker renders prompts with the run's template (its prompt part), exactly as training saw them:
the pane sends the person's text, or a held-out row's fields (``Generate.row``).

Held-out mode asks the worker to score N held-out rows (``ScoreHeldOut``: the test split, else the
validation split, greedy, both models), the same engine code as ``studio eval``; the table fills a
row per ``HeldOutRowScored`` event, and the worker saves ``eval.json`` and ``eval.csv`` in the run.

Longer than ~400 lines on purpose: free chat and held-out mode share the prompt settings, the request
ids and the run the events belong to, so splitting them would put one request's bookkeeping in two
places; the scoring itself is the engine's (engine/evaluate.py) and core/runs/scoring.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Checkbox, DataTable, Input, Label, Static

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.data.pairs import is_preference
from studio.core.prompt import chat
from studio.core.runs import RunDir, scoring
from studio.core.runs.cells import cell
from studio.ui.host import Pane
from studio.ui.messages import WorkerEvents

NO_ADAPTER = "No adapter yet: start training (Training pane, s). The base answer is on the left."


def row_label(row: dict[str, Any], response_field: str) -> str:
    """A held-out row's prompt fields in one line, for the table (the instruction is often the same
    on every row, so the last non-empty field comes first). A conversation shows its last user turn."""
    if chat.CHAT_FIELD in row:
        try:
            turns = chat.parse_turns(row[chat.CHAT_FIELD])
        except chat.ChatFormatError:
            turns = []
        asked = next((t.content.strip() for t in reversed(turns) if t.role == "user"), "")
        return f"{len(turns) + 1} turns · {asked}" if turns else str(row[chat.CHAT_FIELD])
    parts = [str(v).strip() for k, v in row.items() if k != response_field and str(v).strip()]
    return " · ".join(reversed(parts))


@dataclass
class Answer:
    """One streamed answer."""

    text: str = ""
    done: bool = False
    new_tokens: int = 0
    tokens_per_s: float = 0.0


@dataclass
class HeldOutRow:
    """One held-out row and both models' answers."""

    fields: dict[str, str]
    """The row's prompt fields (template field -> text), rendered by the worker."""
    target: str
    label: str = ""
    answers: dict[str, Answer] = field(default_factory=dict)
    margins: dict[str, float] = field(default_factory=dict)
    """Preference runs: log p(chosen) - log p(rejected) per model ("base", "tuned"); above 0 it
    prefers the chosen answer."""

    def score(self, side: str) -> scoring.Score | None:
        answer = self.answers.get(side)
        return scoring.score(answer.text, self.target) if answer and answer.done else None


class ChatPane(Pane, Vertical):
    """Prompt box, settings, the two answer columns and the held-out table."""

    DEFAULT_CSS = """
    ChatPane { height: 1fr; padding: 0 1; }
    ChatPane #chat-settings { height: auto; }
    ChatPane #chat-settings { height: 1; margin-top: 1; }
    ChatPane #chat-settings Label { padding: 0 1 0 2; }
    ChatPane #chat-settings Input { width: 7; }
    ChatPane #chat-settings Checkbox { margin-left: 2; }
    ChatPane #chat-prompt-row { height: auto; }
    ChatPane #chat-prompt { width: 1fr; }
    ChatPane #chat-answers { height: 1fr; min-height: 6; }
    ChatPane .chat-column { width: 1fr; border: round $primary-background; padding: 0 1; }
    ChatPane .chat-column > Label { text-style: bold; }
    ChatPane .chat-answer { height: 1fr; }
    ChatPane .chat-speed { height: 1; color: $text-muted; }
    ChatPane #chat-status { height: auto; color: $text-muted; }
    ChatPane #chat-status.error { color: $error; }
    ChatPane #chat-heldout-box { height: 1fr; display: none; }
    ChatPane #chat-heldout-box.shown { display: block; }
    ChatPane #chat-heldout-totals { height: auto; }
    """

    BINDINGS = [
        Binding("f5", "heldout", "Held-out", id="chat.heldout",
                tooltip="Answer N held-out rows with both models and score them"),
        Binding("f6", "toggle_greedy", "Greedy on/off", id="chat.greedy",
                tooltip="Switch between greedy decoding and sampling"),
        Binding("f7", "focus_prompt", "Prompt", id="chat.prompt",
                tooltip="Put the cursor in the prompt box: Enter asks both models"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.answers: dict[str, Answer] = {}
        """Streamed answers by request id."""
        self.sides: dict[str, str] = {}
        """request id -> "base" or "tuned" for the current question."""
        self.adapter_ready = False
        self.heldout: list[HeldOutRow] = []
        self._heldout_request: str | None = None
        self._round = 0
        self._dirty = False
        self._idle_extra: str | None = ""
        """What follows the idle status line now shown (None while it shows something else), so
        the line can be rewritten when the adapter appears."""

    def compose(self) -> ComposeResult:
        gen = self._config().generation
        with Horizontal(id="chat-settings"):
            yield Label("max tokens")
            yield Input(str(gen.max_new_tokens), id="chat-max-tokens", type="integer", compact=True)
            yield Label("temperature")
            yield Input(str(gen.temperature), id="chat-temperature", type="number", compact=True)
            yield Label("top-p")
            yield Input(str(gen.top_p), id="chat-top-p", type="number", compact=True)
            yield Checkbox("greedy (f6)", gen.temperature == 0, id="chat-greedy", compact=True)
            yield Label("held-out rows")
            yield Input("10", id="chat-heldout-n", type="integer", compact=True)
        with Horizontal(id="chat-prompt-row"):
            yield Input(placeholder="Ask both models; Enter sends", id="chat-prompt")
            yield Button("Ask", id="chat-ask", variant="primary")
            yield Button("Held-out (f5)", id="chat-heldout")
        yield Static("", id="chat-status")
        with Horizontal(id="chat-answers"):
            for side, title in (("base", "base (zero-shot)"), ("tuned", "fine-tuned")):
                with Vertical(classes="chat-column", id=f"chat-{side}"):
                    yield Label(title)
                    with VerticalScroll(classes="chat-answer"):
                        yield Static("", id=f"chat-{side}-text")
                    yield Static("", id=f"chat-{side}-speed", classes="chat-speed")
        with Vertical(id="chat-heldout-box"):
            yield DataTable(id="chat-heldout-table", zebra_stripes=True)
            yield Static("", id="chat-heldout-totals")

    def on_mount(self) -> None:
        self.reset_run(self.host.current_run)
        self._show_idle()
        self._paint()
        self.set_interval(0.1, self._paint_if_dirty)

    def focus_target(self) -> Input:
        """The prompt box, unlike other panes' text fields: typing asks at once (the pane's keys are
        F-keys, and alt+digit switches panes from here)."""
        return self.query_one("#chat-prompt", Input)

    # ------------------------------------------------------------------------ state

    def _config(self) -> RunConfig:
        """The run's config when a run is open (its template trained the adapter), else the app's."""
        run = self.host.current_run
        if run is not None:
            try:
                return run.config()
            except ValueError:
                pass
        return self.host.config

    def reset_run(self, run: RunDir | None) -> None:
        """A new run: forget the answers; the adapter exists if the run saved one or a checkpoint."""
        self.answers, self.sides = {}, {}
        self.heldout, self._heldout_request = [], None
        self.adapter_ready = run is not None and run.adapter() is not None
        if self.is_mounted:
            self.query_one("#chat-heldout-box").remove_class("shown")
            self._show_idle()
            self._paint()

    def _idle_status(self) -> str:
        run = self.host.current_run
        where = f"run {run.id}" if run else "no run yet (asking starts a worker for the current config)"
        adapter = "adapter ready" if self.adapter_ready else "no adapter yet (base model only)"
        return f"{where} · {adapter}"

    def _set_status(self, text: str, error: bool = False) -> None:
        self._idle_extra = None
        status = self.query_one("#chat-status", Static)
        status.update(text)
        status.set_class(error, "error")

    def _show_idle(self, extra: str = "") -> None:
        """The idle status line (which run, whether it has an adapter), then ``extra``."""
        self._set_status(self._idle_status() + extra)
        self._idle_extra = extra

    def on_worker_events(self, message: WorkerEvents) -> None:
        """The run's events: answers, whether an adapter exists, failures."""
        if message.run == self.host.current_run:
            self.handle_events(message.events)

    def handle_events(self, events: list[ev.Event]) -> None:
        """Stream answers by request id; learn when an adapter exists; show generation failures."""
        for event in events:
            if isinstance(event, (ev.StepLogged, ev.CheckpointSaved)) or (
                    isinstance(event, ev.TrainingFinished) and event.adapter_path):
                if not self.adapter_ready:
                    self.adapter_ready = True
                    self._dirty = True
                    if self._idle_extra is not None:  # the line said "no adapter yet": it has one now
                        self._show_idle(self._idle_extra)
            elif isinstance(event, ev.TokenGenerated):
                answer = self.answers.get(event.request_id)
                if answer is not None and not answer.done:
                    answer.text += event.text
                    self._dirty = True
            elif isinstance(event, ev.GenerationFinished):
                self._finished(event)
            elif isinstance(event, ev.HeldOutRowScored) and event.request_id == self._heldout_request:
                self._heldout_row(event)
            elif isinstance(event, ev.HeldOutFinished) and event.request_id == self._heldout_request:
                self._heldout_finished(event)
            elif isinstance(event, ev.WorkerFailed) and self._waiting() and (
                    event.fatal or event.kind in ("crash", "oom")):
                # Warnings while the model loads (truncated rows, no 4-bit on CPU) are the training
                # pane's to show; here only what stopped an answer.
                self._set_status(f"The worker could not answer: {event.message}", error=True)

    def _waiting(self) -> bool:
        return any(not a.done for a in self.answers.values())

    def _finished(self, event: ev.GenerationFinished) -> None:
        answer = self.answers.get(event.request_id)
        if answer is None or answer.done:
            return
        # The final text is authoritative: a client that joined mid-stream missed some tokens.
        answer.text = event.text or answer.text
        answer.done, answer.new_tokens, answer.tokens_per_s = True, event.new_tokens, event.tokens_per_s
        self._dirty = True
        if event.request_id in self.sides and not any(not self.answers[r].done for r in self.sides):
            self._show_idle(" · answered")

    def _paint_if_dirty(self) -> None:
        if self._dirty:
            self._paint()

    def _paint(self) -> None:
        self._dirty = False
        by_side = {side: self.answers.get(rid) for rid, side in self.sides.items()}
        for side in ("base", "tuned"):
            answer = by_side.get(side)
            text = self.query_one(f"#chat-{side}-text", Static)
            speed = self.query_one(f"#chat-{side}-speed", Static)
            if answer is None:
                text.update(NO_ADAPTER if side == "tuned" and not self.adapter_ready else "")
                speed.update("")
                continue
            shown = answer.text if answer.text.strip() or not answer.text else f"(only whitespace: {answer.text!r})"
            text.update(shown + ("" if answer.done else " ▌"))
            speed.update(f"{answer.new_tokens} tokens · {answer.tokens_per_s:.1f} tok/s" if answer.done
                         else "streaming…")
        if self.heldout:
            self._paint_heldout()

    # ------------------------------------------------------------------------ asking

    def _settings(self) -> dict[str, Any] | None:
        """max_new_tokens / temperature / top_p from the inputs, or None (with a message) if invalid."""
        try:
            max_new = int(self.query_one("#chat-max-tokens", Input).value)
            temperature = float(self.query_one("#chat-temperature", Input).value)
            top_p = float(self.query_one("#chat-top-p", Input).value)
        except ValueError:
            self._set_status("Generation settings: max new tokens must be a whole number, temperature and "
                             "top-p numbers", error=True)
            return None
        if max_new <= 0 or temperature < 0 or not 0 < top_p <= 1:
            self._set_status("Generation settings: max new tokens > 0, temperature >= 0, 0 < top-p <= 1",
                             error=True)
            return None
        if self.query_one("#chat-greedy", Checkbox).value:
            temperature = 0.0
        return {"max_new_tokens": max_new, "temperature": temperature, "top_p": top_p}

    def _ensure_run(self) -> bool:
        """Before any run is followed, the app makes one from the config so that a worker can answer."""
        return self.host.current_run is not None or self.host.run_for_config() is not None

    def _request(self, prompt: str, adapter: bool, request_id: str, settings: dict[str, Any],
                 row: dict[str, str] | None = None) -> None:
        self.answers[request_id] = Answer()
        self.host.send_command(ev.Generate(request_id=request_id, prompt=prompt, adapter=adapter, row=row,
                                          **settings))

    def ask(self, text: str) -> bool:
        """Send ``text`` to both models (the worker renders it with the run's template); False if
        nothing was sent."""
        prompt = text.strip()
        settings = self._settings()
        if not prompt or settings is None or not self._ensure_run():
            return False
        self._round += 1
        stamp = f"chat-{self._round}-{time.monotonic_ns() % 10**8}"
        self.sides = {f"{stamp}-base": "base"}
        self._request(prompt, False, f"{stamp}-base", settings)
        if self.adapter_ready:
            self.sides[f"{stamp}-tuned"] = "tuned"
            self._request(prompt, True, f"{stamp}-tuned", settings)
        self._show_idle(" · asking…")
        self._paint()
        return True

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "chat-prompt":
            self.action_ask()
        else:  # a setting typed: back to the prompt, where typing asks
            self.action_focus_prompt()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "chat-ask":
            event.stop()
            self.action_ask()
        elif event.button.id == "chat-heldout":
            event.stop()
            self.action_heldout()

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        if event.checkbox.id == "chat-greedy":
            self.query_one("#chat-temperature", Input).disabled = event.value

    def action_ask(self) -> None:
        """Ask both models the prompt in the box."""
        self.ask(self.query_one("#chat-prompt", Input).value)

    def action_toggle_greedy(self) -> None:
        """Switch greedy decoding on or off."""
        greedy = self.query_one("#chat-greedy", Checkbox)
        greedy.value = not greedy.value

    def action_focus_prompt(self) -> None:
        """Put the cursor in the prompt box."""
        self.query_one("#chat-prompt", Input).focus()

    # ------------------------------------------------------------------------ held-out

    def action_heldout(self) -> None:
        """Score N held-out rows with both models (in the worker) and show them as a table."""
        try:
            count = int(self.query_one("#chat-heldout-n", Input).value)
        except ValueError:
            count = 0
        if count <= 0:
            self._set_status("Held-out rows must be a whole number above 0", error=True)
            return
        settings = self._settings()
        if settings is None or not self._ensure_run():
            return
        self.heldout = []
        self._heldout_request = f"heldout-{time.monotonic_ns()}"
        table = self.query_one("#chat-heldout-table", DataTable)
        table.clear(columns=True)
        table.add_columns("#", "prompt", "target", "base", "exact/sim", "fine-tuned", "exact/sim")
        run = self.host.current_run
        if is_preference(run.config() if run is not None else self.host.config):
            # Which answer each model prefers: the log-prob margin of chosen over rejected.
            table.add_columns("rejected", "prefers chosen: base → tuned")
        self.query_one("#chat-heldout-totals", Static).update("")
        self.query_one("#chat-heldout-box").add_class("shown")
        self._set_status(f"Held-out: answering {count} rows (test split, else validation; greedy)…")
        self.host.send_command(ev.ScoreHeldOut(request_id=self._heldout_request, rows=count,
                                              adapter=self.adapter_ready,
                                              max_new_tokens=settings["max_new_tokens"]))

    def _heldout_row(self, event: ev.HeldOutRowScored) -> None:
        """One scored row from the worker: a table line now, the totals on the next paint."""
        fields = dict(event.fields)
        item = HeldOutRow(fields, event.target, row_label(fields, ""))
        item.answers["base"] = Answer(event.base, done=True)
        if event.tuned is not None:
            item.answers["tuned"] = Answer(event.tuned, done=True)
        self.heldout.append(item)
        tuned = "…" if event.tuned is not None else "no adapter"
        table = self.query_one("#chat-heldout-table", DataTable)
        cells = [str(event.index + 1), cell(item.label, 28), cell(item.target, 20), "…", "", tuned, ""]
        if len(table.ordered_columns) > len(cells):
            item.margins = {side: m for side, m in (("base", event.base_margin), ("tuned", event.tuned_margin))
                            if m is not None}
            cells += [cell(event.rejected or "", 20), margin_cell(item.margins)]
        table.add_row(*cells, key=str(len(self.heldout) - 1))
        self._set_status(f"Held-out: {event.index + 1}/{event.total} {event.split} rows answered…")
        self._dirty = True

    def _heldout_finished(self, event: ev.HeldOutFinished) -> None:
        self._heldout_request = None
        self._paint_heldout()
        if event.ok:
            self._set_status(f"Held-out done: {event.rows} {event.split} rows; saved {event.path} and eval.csv")
        else:
            self._set_status(f"Held-out: {event.message}", error=True)

    def _paint_heldout(self) -> None:
        table = self.query_one("#chat-heldout-table", DataTable)
        if table.row_count != len(self.heldout):
            return
        columns = [c.key for c in table.ordered_columns]
        for i, item in enumerate(self.heldout):
            for side, text_col, score_col in (("base", 3, 4), ("tuned", 5, 6)):
                answer = item.answers.get(side)
                if answer is None:
                    continue
                table.update_cell(str(i), columns[text_col], cell(answer.text or "…", 20))
                result = item.score(side)
                if result is not None:
                    table.update_cell(str(i), columns[score_col],
                                      f"{'✓' if result.exact else '✗'} {result.similarity:.2f}")
        self.query_one("#chat-heldout-totals", Static).update(self.totals_line())

    def totals(self) -> dict[str, scoring.Totals]:
        """Exact-match rate and mean similarity per model over the rows answered so far."""
        out = {}
        for side in ("base", "tuned"):
            scores = [s for s in (item.score(side) for item in self.heldout) if s is not None]
            if scores:
                out[side] = scoring.totals(scores)
        return out

    def totals_line(self) -> str:
        """``base: exact 0.0% · similarity 0.21 (10 rows) | fine-tuned: …``."""
        names = {"base": "base", "tuned": "fine-tuned"}
        parts = [f"{names[side]}: {t.line()}" for side, t in self.totals().items()]
        preferred = {side: [item.margins[side] > 0 for item in self.heldout if side in item.margins]
                     for side in names}
        if preferred["base"]:
            parts.append("prefers chosen: " + " → ".join(
                f"{names[side]} {sum(won) / len(won):.0%}" for side, won in preferred.items() if won))
        return "totals — " + " | ".join(parts) if parts else ""


def margin_cell(margins: dict[str, float]) -> str:
    """``✗ -12.3 → ✓ +8.1``: which answer the base and the fine-tune prefer, and by how much."""
    return " → ".join(f"{'✓' if m > 0 else '✗'} {m:+.1f}" for m in margins.values())
