"""The training pane: start, pause, resume and stop a run, and watch it go.

Events arrive in batches as :class:`~studio.ui.messages.WorkerEvents` messages (memory samples as
:class:`~studio.ui.messages.MemorySample`); they are folded into a
:class:`~studio.ui.metrics.TrainingState` at once (cheap) but drawn at most ``REDRAW_HZ`` times a
second, so a fast run cannot flood the terminal. The pane never talks to the worker directly: it
asks the app through its :class:`~studio.ui.host.StudioHost` interface (``start_training``,
``send_command``, ``pick_run``). Its dialogs (stop? where to export?) are in
:mod:`studio.ui.widgets.dialogs`.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, ProgressBar, Static

from studio.core import events as ev
from studio.core.config import effective_batch
from studio.core.runs import RunDir
from studio.ui.host import Pane
from studio.ui.messages import MemorySample, WorkerEvents
from studio.ui.metrics import TrainingState, format_duration
from studio.ui.widgets.dialogs import ConfirmScreen, ExportScreen
from studio.ui.widgets.group_view import GroupView
from studio.ui.widgets.grpo_plot import KINDS as GRPO_PLOTS
from studio.ui.widgets.grpo_plot import GrpoPlot
from studio.ui.widgets.loss_plot import LearningRatePlot, LossPlot
from studio.ui.widgets.preference_plot import PreferencePlot

REDRAW_HZ = 4.0
"""Most redraws a second; events in between are folded in and drawn together."""

_BUTTON_ACTIONS = (("start_training", "training-start"), ("pause_training", "training-pause"),
                   ("resume_training", "training-resume"), ("stop_training", "training-stop"),
                   ("export", "training-export"))
"""(action, button id) of the buttons enabled only while their action makes sense."""

EXPORT_STEPS = {
    "adapter": "saving the adapter with its model card and prompt template",
    "merged": "merging the adapter into the base model (bf16 safetensors)",
    "gguf": "writing GGUF (f16), a LoRA GGUF and a Modelfile",
}
"""What the training pane's status line says while the worker exports, by format."""


class TrainingPane(Pane, Vertical):
    """Controls, progress, eval metrics, failures and live curves of the app's current run."""

    DEFAULT_CSS = """
    TrainingPane { height: 1fr; padding: 0 1; }
    TrainingPane #training-controls { height: auto; }
    TrainingPane #training-controls Button { margin-right: 1; min-width: 10; }
    TrainingPane #training-status { height: 1; color: $text-muted; }
    TrainingPane #training-progress-row { height: 1; }
    TrainingPane #training-progress { width: 40; }
    TrainingPane #training-progress-line { width: 1fr; height: 1; padding-left: 1; }
    TrainingPane .training-line { height: 1; }
    TrainingPane #training-alert { height: auto; max-height: 4; color: $warning; }
    TrainingPane #training-alert.failed { color: $error; text-style: bold; }
    TrainingPane #training-plots { height: 1fr; }
    TrainingPane #training-loss-plot { width: 2fr; }
    TrainingPane #training-lr-plot { width: 1fr; }
    TrainingPane PreferencePlot { width: 1fr; display: none; }
    TrainingPane GrpoPlot { display: none; }
    TrainingPane #training-grpo-rewards { width: 2fr; }
    TrainingPane GroupView { display: none; }
    """

    BINDINGS = [
        Binding("s", "start_training", "Start", id="training.start",
                tooltip="Train the config being edited in a background worker"),
        Binding("p", "pause_training", "Pause", id="training.pause",
                tooltip="Pause after the current optimizer step (chat still works)"),
        Binding("r", "resume_training", "Resume", id="training.resume",
                tooltip="Continue a paused run, or an interrupted one from its checkpoint"),
        Binding("x", "stop_training", "Stop", id="training.stop",
                tooltip="Save a checkpoint and the adapter, then stop (asks first)"),
        Binding("o", "open_runs", "Runs", id="training.runs",
                tooltip="Pick a past run to open, or two to compare their loss curves"),
        Binding("e", "export", "Export", id="training.export",
                tooltip="Save the adapter (with a model card), merge it into the base (bf16), or write GGUF"),
        Binding("[", "older_group", "Older group", id="training.older_group",
                tooltip="GRPO: the group view shows the group sampled before this one"),
        Binding("]", "newer_group", "Newer group", id="training.newer_group",
                tooltip="GRPO: the next group, back to following the run live"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.state = TrainingState()
        self.redraws = 0
        """How many times the pane has repainted its numbers and plots (tests and the benchmark read it)."""
        self.redraw_seconds = 0.0
        """Total time spent in redraws (Python side: folding into widgets and building plots)."""
        self._last_redraw = 0.0
        self._redraw_pending = False
        self._export_line = ""
        self._asked: tuple[str, str, str] | None = None
        """(the status it was asked in, what the status line says meanwhile, the action) of a pause,
        resume or stop sent to the worker and not done yet: it takes effect after the current step,
        seconds later on a CPU, and the line says so at once."""
        self._allowed: tuple[bool, ...] = ()
        self._lines: dict[str, str] = {}
        """The text each one-line Static shows (see :meth:`_set_line`)."""

    def compose(self) -> ComposeResult:
        with Horizontal(id="training-controls"):
            yield Button("Start (s)", id="training-start", variant="success")
            yield Button("Pause (p)", id="training-pause")
            yield Button("Resume (r)", id="training-resume")
            yield Button("Stop (x)", id="training-stop", variant="error")
            yield Button("Runs (o)", id="training-runs")
            yield Button("Export (e)", id="training-export")
        yield Static("", id="training-status")
        with Horizontal(id="training-progress-row"):
            # A known total from the start: an indeterminate bar animates (repaints) without end.
            yield ProgressBar(total=1, show_eta=False, id="training-progress")
            yield Static("", id="training-progress-line")
        yield Static("", id="training-eval", classes="training-line")
        yield Static("", id="training-memory", classes="training-line")
        yield Static("", id="training-alert")
        with Horizontal(id="training-plots"):
            yield LossPlot(id="training-loss-plot")
            yield LearningRatePlot(id="training-lr-plot")
            # A DPO / ORPO run shows its preference curves in place of the learning rate.
            yield PreferencePlot("logps", id="training-pref-logps")
            yield PreferencePlot("margin", id="training-pref-margin")
            # A GRPO run shows its rewards, spread, length and KL in place of the loss and rate.
            for kind in GRPO_PLOTS:
                yield GrpoPlot(kind, id=f"training-grpo-{kind}")
        yield GroupView(id="training-group")

    def on_mount(self) -> None:
        run = self.host.current_run
        if run is not None:
            self.state.run_id = run.id
        self._redraw()

    def on_show(self) -> None:
        # Shown (its tab picked): take focus so the pane's keys (s, p, r, x, o, e) work at once.
        if self.app.focused is None or self not in self.app.focused.ancestors_with_self:
            self.focus()

    def focus_target(self) -> Button | None:
        """The first enabled button: the pane's keys work while any of its widgets has focus. The
        pane itself never takes focus: a container gaining or losing focus restyles everything in
        it (the plots included), tens of milliseconds for each Tab."""
        return next((b for b in self.query(Button) if not b.disabled and b.id and
                     b.id.startswith("training-")), None)

    def focus(self, scroll_visible: bool = True) -> TrainingPane:
        """Focus the pane's first enabled button (see :meth:`focus_target`)."""
        target = self.focus_target()
        if target is not None:
            target.focus(scroll_visible)
        return self

    # ------------------------------------------------------------------------ events in

    def reset_run(self, run: RunDir | None) -> None:
        """Forget the old run; the new run's events will arrive from the start of its log."""
        self.state = TrainingState(run_id=run.id if run else "")
        self._export_line = ""
        self._asked = None
        self._redraw()

    def on_worker_events(self, message: WorkerEvents) -> None:
        """Fold a batch of the run's events in; repaint soon (at most REDRAW_HZ times a second)."""
        if message.run != self.host.current_run:
            return  # queued before the app switched runs
        changed = self.state.apply_all(message.events)
        for event in message.events:
            if isinstance(event, ev.ExportProgress):
                self._export_line = f"exporting to {event.path}: {event.stage} {event.fraction:.0%}"
                changed = True
            elif isinstance(event, ev.ExportFinished):
                self._export_line = (f"exported to {event.path} in {event.seconds:.0f}s"
                                     if event.ok else f"export failed: {event.message}")
                changed = True
        if changed:
            self.schedule_redraw()

    def on_memory_sample(self, message: MemorySample) -> None:
        """The memory line follows the newest sample."""
        if message.run == self.host.current_run and self.state.apply(message.sample):
            self.schedule_redraw()

    def schedule_redraw(self) -> None:
        """Repaint once the redraw interval since the last repaint has passed."""
        if self._redraw_pending:
            return
        self._redraw_pending = True
        wait = 1.0 / REDRAW_HZ - (time.monotonic() - self._last_redraw)
        if wait > 0.001:
            self.set_timer(wait, self._redraw)
        else:
            self.call_later(self._redraw)

    def _redraw(self) -> None:
        started = time.perf_counter()
        self._redraw_pending = False
        self._last_redraw = time.monotonic()
        state = self.state
        run = self.host.current_run
        what = f"run {state.run_id or (run.id if run else '')}".strip() if (state.run_id or run) else "no run yet"
        parts = [what, state.status]
        if state.base_model:
            # A local model folder shows by its name; the full path is in the run's config.yaml.
            parts.append(Path(state.base_model).name if "/" in state.base_model and
                         Path(state.base_model).is_absolute() else state.base_model)
        if state.device:
            parts.append(state.device)
        if state.path:
            parts.append(state.path)
        if state.micro_batch_size:
            batch = f"micro-batch {state.micro_batch_size} × {state.gradient_accumulation_steps}"
            if state.gpus > 1:
                effective = effective_batch(state.micro_batch_size, state.gradient_accumulation_steps, state.gpus)
                batch += f" × {state.gpus} GPUs = {effective}"
            parts.append(batch)
        if self._asked is not None and self._asked[0] != state.status:
            self._asked = None  # done (or overtaken: the run finished or failed meanwhile)
        if self._asked is not None:
            parts.append(self._asked[1])
        if state.status == "loading" and state.loading_stage:
            # The stage says what it does ("loading the weights"): the status already said "loading".
            parts.append(f"{state.loading_stage} {state.loading_fraction:.0%}")
        if state.status == "no run" and run is None:
            parts = ["no run yet: press s to create one from the current config and train"]
        elif state.status == "no run":
            parts = [what, "created (nothing logged yet)"]
        self._set_line("#training-status", " · ".join(parts))
        bar = self.query_one(ProgressBar)
        if state.total_steps:
            bar.update(total=state.total_steps, progress=state.step)
        line = state.progress_line() if state.total_steps else ""
        if state.status in ("finished", "stopped") and state.elapsed_s:
            line += f" · took {format_duration(state.elapsed_s)}"
        self._set_line("#training-progress-line", line)
        self._set_line("#training-eval", state.eval_line())
        self._set_line("#training-memory", state.memory_line())
        lines = [state.failure_line()] if state.failure is not None else []
        lines += state.notices[-2:]
        if self._export_line:
            lines.append(self._export_line)
        self._set_line("#training-alert", "\n".join(line for line in lines if line))
        self.query_one("#training-alert", Static).set_class(state.status == "failed", "failed")
        grpo = state.grpo.active
        loss_plot = self.query_one(LossPlot)
        if loss_plot.display == grpo:  # a layout change only when the run's kind changes
            loss_plot.display = not grpo
            for widget in (*self.query(GrpoPlot), self.query_one(GroupView)):
                widget.display = grpo
            self.refresh_bindings()  # the group view's keys show for a GRPO run only
        if grpo:
            for plot in self.query(GrpoPlot):
                plot.show(state)
            self.query_one(GroupView).show(state.grpo.groups)
        else:
            loss_plot.show(state)
        preference = state.preference.active
        lr_plot, pref_plots = self.query_one(LearningRatePlot), list(self.query(PreferencePlot))
        if lr_plot.display != (not preference and not grpo):  # a layout change only when the kind changes
            lr_plot.display = not preference and not grpo
            for plot in pref_plots:
                plot.display = preference
        for plot in pref_plots if preference else [] if grpo else [lr_plot]:
            plot.show(state)
        self._sync_buttons()
        self.redraws += 1
        self.redraw_seconds += time.perf_counter() - started

    def _set_line(self, selector: str, text: str) -> None:
        """Show ``text`` in one of the pane's Statics, repainting it only when the text changed.

        ``Static.update`` re-lays out the whole screen by default (15-20 ms on the event loop here, four
        times a second in a running run, and a keypress waits behind it). The status, progress, eval
        and memory lines are one row high whatever they say, so a repaint is enough; the alert's height
        follows its (wrapped) lines, so it is laid out again, but only when it says something new."""
        if self._lines.get(selector) == text:
            return
        self._lines[selector] = text
        self.query_one(selector, Static).update(text, layout=selector == "#training-alert")

    def _sync_buttons(self) -> None:
        allowed = tuple(self.check_action(action, ()) is True for action, _ in _BUTTON_ACTIONS)
        if allowed == self._allowed:
            # Refreshing bindings makes the footer recompose all its keys (tens of ms on the event
            # loop): only when what is allowed changed, not on every redraw of a running run.
            return
        self._allowed = allowed
        for (_, button_id), ok in zip(_BUTTON_ACTIONS, allowed, strict=True):
            self.query_one(f"#{button_id}", Button).disabled = not ok
        self.refresh_bindings()

    # ------------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Offer only what makes sense now; the footer greys out the rest."""
        status = self.state.status
        active = status in ("training", "loading")
        if self._asked is not None and self._asked[2] == action and self._asked[0] == status:
            return None  # asked already: the worker does it after the current step
        if action == "start_training":
            return None if active or status == "paused" else True
        if action == "pause_training":
            return True if status == "training" else None
        if action == "resume_training":
            return True if status in ("paused", "interrupted", "stopped") else None
        if action == "stop_training":
            return True if status in ("training", "paused", "loading") else None
        if action == "export":
            return True if self.host.current_run is not None and not active else None
        if action in ("older_group", "newer_group"):
            return self.state.grpo.active  # hidden from the footer unless the run is a GRPO run
        return True

    def action_older_group(self) -> None:
        """The group view: show the group logged before the one shown (a GRPO run)."""
        self.query_one(GroupView).older()

    def action_newer_group(self) -> None:
        """The group view: show the group logged after the one shown; at the newest, follow the run."""
        self.query_one(GroupView).newer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        actions = {"training-start": "start_training", "training-pause": "pause_training",
                   "training-resume": "resume_training", "training-stop": "stop_training",
                   "training-runs": "open_runs", "training-export": "export"}
        action = actions.get(event.button.id or "")
        if action:
            event.stop()
            self.run_action(action)

    def action_start_training(self) -> None:
        """Train the config being edited (the app makes or reuses the run and starts its worker)."""
        if self.check_action("start_training", ()) is not True:
            return
        run = self.host.start_training()
        if run is None:
            return
        if self.state.run_id != run.id:
            self.state = TrainingState(run_id=run.id)
        # A draft's model may be loaded already (a preview): what it said of it stays shown.
        self.state.status = "loading"
        self.notify(f"Run {run.id}: the worker loads the model, then trains.")
        self._redraw()

    def action_pause_training(self) -> None:
        """Pause after the current optimizer step."""
        if self.check_action("pause_training", ()) is True:
            self.host.send_command(ev.Pause())
            self._ask("pausing after this step…", "pause_training")

    def action_resume_training(self) -> None:
        """Continue a paused run; an interrupted or stopped run resumes from its latest checkpoint."""
        if self.check_action("resume_training", ()) is not True:
            return
        if self.state.status == "paused":
            self.host.send_command(ev.Resume())
            self._ask("resuming…", "resume_training")
            return
        run = self.host.current_run
        if run is None or run.latest_checkpoint() is None:
            self.notify("No checkpoint to resume from: start a new run with s.", severity="warning")
            return
        self.host.send_command(ev.StartTraining(resume=True))  # (its worker is started if none is alive)

    def action_stop_training(self) -> None:
        """Ask, then stop: the worker saves a checkpoint and the adapter first."""
        if self.check_action("stop_training", ()) is not True:
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.host.send_command(ev.Stop())
                self._ask("stopping after this step (checkpoint and adapter first)…", "stop_training")

        self.app.push_screen(
            ConfirmScreen(f"Stop training run {self.state.run_id} at step {self.state.step}?\n"
                          "A checkpoint and the adapter are saved first; you can resume later (r).",
                          yes="Stop training", no="Keep training"),
            answered,
        )

    def _ask(self, saying: str, action: str) -> None:
        """A command is on its way: say so in the status line now, until the run's status changes."""
        self._asked = (self.state.status, saying, action)
        self._redraw()

    def action_open_runs(self) -> None:
        """Pick a past run to open, or two to compare."""
        self.host.pick_run()

    def action_export(self) -> None:
        """Save the adapter, or merge it into the base model, to a folder."""
        run = self.host.current_run
        if run is None or self.check_action("export", ()) is not True:
            return

        def chosen(result: tuple[str, str] | None) -> None:
            if result is None:
                return
            kind, path = result
            if Path(path).exists():
                self.notify(f"{path} already exists; choose a new folder.", severity="error")
                return
            self._export_line = f"{EXPORT_STEPS[kind]} -> {path} (the worker does it)"
            self.host.send_command(ev.ExportRun(path=path, format=kind, quant="f16", dtype="bfloat16"))
            self.schedule_redraw()

        self.app.push_screen(ExportScreen(run), chosen)

