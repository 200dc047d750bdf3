"""The VRAM pane: where the GPU memory of this run goes, predicted and measured, as 1-GB squares.

It estimates from ``app.config`` (when mounted, when the config changes, and on
:meth:`VramPane.refresh_estimate`) in a thread, cached by (config, card); lets a person pick the card
(detected, or a known size); fills the measured grid from the worker's memory samples (nothing else
happens per sample: they arrive every logged step); and tells the memory story step by step:
full fp32 -> bf16 -> 8-bit -> LoRA -> NF4 QLoRA -> + checkpointing -> + paged 8-bit AdamW.
With ``auto`` micro-batch or checkpointing (the defaults) the estimate is of the plan a run would
choose on the card (core/memory/autoplan.py), whose choice and rejected alternatives are listed under the gauge.

The model field sizes another model with the config's other settings, without touching the config
(``u`` makes it the run's model): a hub id (its config.json fetched in a thread, cached; offline, a
bundled config or a one-line message), a model folder or a config.json path; empty, the run's own.

A run on several GPUs samples every card (MemorySampled.rank): the big gauge shows rank 0's
breakdown, and one line a card below it shows each card's memory in use against its capacity.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Input, Select, Static

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.memory import Estimate, WalkStep, autoplan, estimate, walkthrough
from studio.core.memory.gpus import GB, Gpu, capacity_choices, gpu_for_size
from studio.core.model.info import ModelInfo, ModelInfoError, load_model_info
from studio.core.model.ref import looks_local
from studio.core.model.source import find_model
from studio.ui.host import Pane
from studio.ui.messages import MemorySample, WorkerEvents
from studio.ui.widgets.block_gauge import BlockGauge

if TYPE_CHECKING:
    from studio.core.runs import RunDir

DEFAULT_CARD_GB = 24
"""Card shown when none is detected: the common 24 GB size."""
ESTIMATE_CACHE_SIZE = 16
"""(config, card) estimates kept: stepping back to a card or an edit already seen redraws at once."""


class VramPane(Pane, VerticalScroll):
    """Predicted vs measured GPU memory for the config being edited, with the walkthrough."""

    DEFAULT_CSS = """
    VramPane {
        padding: 0 1;
    }
    VramPane #vram-top {
        height: auto;
    }
    VramPane #vram-gpu {
        width: 32;
    }
    VramPane #vram-summary {
        width: 1fr;
        padding: 1 1 0 1;
        color: $foreground;
    }
    VramPane #vram-model-row {
        height: auto;
    }
    VramPane #vram-model {
        width: 48;
    }
    VramPane #vram-model-line {
        width: 1fr;
        padding: 1 1 0 1;
        color: $foreground-muted;
    }
    VramPane #vram-walk {
        height: auto;
        margin: 1 0 0 0;
        padding: 0 1;
        border-left: thick $accent;
        color: $foreground;
    }
    VramPane #vram-walk.-off {
        border-left: thick $panel;
        color: $foreground-muted;
    }
    VramPane #vram-cards {
        display: none;
        height: auto;
        padding: 0 1;
    }
    VramPane #vram-plan {
        height: auto;
        padding: 0 1;
    }
    VramPane #vram-notes {
        color: $foreground-muted;
        padding: 0 1;
    }
    VramPane .-does-not-fit {
        color: $error;
    }
    """

    BINDINGS = [
        Binding("w", "toggle_walkthrough", "Walkthrough", id="vram.walkthrough"),
        Binding("right,n", "walk(1)", "Next step", id="vram.next"),
        Binding("left,p", "walk(-1)", "Previous step", id="vram.previous"),
        Binding("m", "focus_model", "Model", id="vram.model"),
        Binding("u", "use_model", "Use model for run", id="vram.use_model"),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._cards: list[Gpu] = capacity_choices()
        default = next((g for g in self._cards if g.detected), gpu_for_size(DEFAULT_CARD_GB))
        self.gpu: Gpu = default
        self.current: Estimate | None = None
        self.steps: list[WalkStep] = []
        self.step_index: int | None = None
        self.measured: dict[str, int] | None = None
        self.model_ref: str = ""
        """What the model field holds ('' for the run's own model.base_model)."""
        self._estimates: dict[tuple[str, Gpu, str], tuple[Estimate | str, list[WalkStep], str, str]] = {}
        """(repr of the config, card, model field) -> (estimate or why none, walkthrough, which model
        it is for, the automatic plan's text), oldest first."""
        self.plan_text = ""
        """The automatic plan for the card (core/memory/autoplan.py's lines), '' when the config sets both keys."""
        self.cards: dict[int, ev.MemorySampled] = {}
        """The latest sample of each card (rank) of the run."""
        self.measured_device = ""
        """What the followed run's memory is measured on (``CPU``, the card's name); '' before it says."""
        self.measured_weights = ""
        """How the followed run holds its base weights (``NF4``, ``FP32``...), from its ModelLoaded."""

    def compose(self) -> ComposeResult:
        options = [(f"{g.name}{' (this machine)' if g.detected else ''}", k) for k, g in enumerate(self._cards)]
        selected = next(k for k, g in enumerate(self._cards) if g == self.gpu)
        with Horizontal(id="vram-top"):
            yield Select(options, value=selected, allow_blank=False, id="vram-gpu")
            yield Static("", id="vram-summary")
        with Horizontal(id="vram-model-row"):
            yield Input(placeholder="model: hub id, folder or config.json (Enter)", id="vram-model")
            yield Static("", id="vram-model-line")
        yield BlockGauge(id="vram-gauge")
        yield Static("", id="vram-plan")
        yield Static("", id="vram-cards")
        yield Static("", id="vram-walk", classes="-off")
        yield Static("", id="vram-notes")

    def on_mount(self) -> None:
        self.refresh_estimate()

    def on_config_changed(self, _message: object) -> None:
        """The app's config was edited: estimate again."""
        self.refresh_estimate()

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "vram-gpu" and isinstance(event.value, int):
            self.gpu = self._cards[event.value]
            self.refresh_estimate()

    # ----------------------------------------------------------------------------------- estimate

    def refresh_estimate(self) -> None:
        """Estimate ``app.config`` on the chosen card and redraw (the walkthrough too).

        The estimate reads the model's config.json and sizes a dozen plans (66-88 ms): it runs in a
        thread, once per (config, card); the same pair again is drawn from the cache at once.
        """
        if not self.query("#vram-summary"):  # the app is tearing the pane down: nothing to draw
            return
        key = self._estimate_key()
        if key in self._estimates:
            self._estimated(key, *self._estimates[key])
            return
        self._estimate(key, copy.deepcopy(self.host.config), self.gpu, self.model_ref)

    def _estimate_key(self) -> tuple[str, Gpu, str]:
        return (repr(self.host.config), self.gpu, self.model_ref)

    @work(thread=True, exclusive=True, exit_on_error=False, group="vram-estimate", description="estimating memory")
    def _estimate(self, key: tuple[str, Gpu, str], config: RunConfig, gpu: Gpu, model_ref: str) -> None:
        """Estimate in a thread (``config`` is a copy: the UI may edit the original meanwhile).
        With a model in the field, its config.json may come from the Hub: a network wait, here."""
        model_line = f"Model: {model_ref or config.model.base_model}"
        plan_text = ""
        try:
            info, model_line = model_for_estimate(config, model_ref)
            config, plan_text = planned(config, info, gpu.capacity)
            result: Estimate | str = estimate(config, info, gpu.capacity)
            steps = walkthrough(config, info, gpu.capacity)
        except (ModelInfoError, ValueError) as exc:
            result, steps = f"Cannot estimate: {exc}", []
        self.app.call_from_thread(self._estimated, key, result, steps, model_line, plan_text)

    def _estimated(self, key: tuple[str, Gpu, str], result: Estimate | str, steps: list[WalkStep],
                   model_line: str = "", plan_text: str = "") -> None:
        """Draw an estimate (or why there is none), unless the config, the card or the model changed
        since."""
        self._estimates[key] = (result, steps, model_line, plan_text)
        while len(self._estimates) > ESTIMATE_CACHE_SIZE:
            self._estimates.pop(next(iter(self._estimates)))
        found = self.query("#vram-summary")
        if not found or key != self._estimate_key():
            return  # torn down, or a newer estimate is on its way
        self._show_model(model_line)
        summary = found.first(Static)
        self.steps = steps
        self.plan_text = plan_text
        if self.step_index is not None and self.step_index >= len(steps):
            self.step_index = None
        if isinstance(result, str):
            self.current = None
            summary.update(result)
            summary.add_class("-does-not-fit")
        else:
            self.current = result
            summary.remove_class("-does-not-fit")
        self._draw()

    def _shown(self) -> Estimate | None:
        if self.step_index is not None and self.steps:
            return self.steps[self.step_index].estimate
        return self.current

    def _draw(self) -> None:
        gauge = self.query_one(BlockGauge)
        shown = self._shown()
        gauge.capacity = self.gpu.capacity
        gauge.capacity_name = self.gpu.name
        gauge.predicted = dict(shown.categories) if shown else None
        gauge.measured = dict(self.measured) if self.measured else None
        self._show_setups(shown)
        self._show_cards()
        walk = self.query_one("#vram-walk", Static)
        notes = self.query_one("#vram-notes", Static)
        self.query_one("#vram-plan", Static).update(self.plan_text if self.step_index is None else "")
        if shown is None:
            walk.update("")
            notes.update("")
            return
        plan = shown.plan
        verdict = "fits" if shown.fits else "does NOT fit"
        summary = self.query_one("#vram-summary", Static)
        summary.update(
            f"{shown.total / GB:.1f} GB {verdict} on {self.gpu.name}; largest micro-batch "
            f"{shown.max_micro_batch}; {plan.weights}"
            + (f" + {plan.expert_format} experts, " if plan.expert_format else ", ")
            + (f"LoRA r{plan.lora_r}" if plan.lora_r else "full fine-tune")
            + f", {plan.micro_batch} x {plan.seq_len} tokens; {plan.path} path"
            + ("" if shown.peak_phase == "training step" else f"; peak in the {shown.peak_phase}"))
        summary.set_class(not shown.fits, "-does-not-fit")
        if self.step_index is None:
            walk.update("Walkthrough: press w to step from full fp32 fine-tuning to paged QLoRA "
                        "(← → to step).")
            walk.add_class("-off")
        else:
            step = self.steps[self.step_index]
            walk.update(f"Step {self.step_index + 1}/{len(self.steps)}: {step.title} — "
                        f"{step.estimate.total / GB:.1f} GB\n{step.why}")
            walk.remove_class("-off")
        notes.update("\n".join(f"note: {n}" for n in shown.notes))

    # ------------------------------------------------------------------------------ model field

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the model field: size that model (empty: the run's own) with the config's other
        settings. The config is not changed."""
        if event.input.id != "vram-model":
            return
        event.stop()
        self.focus()  # out of the field: the pane's keys (w, u...) are keys again, not text
        self.model_ref = event.value.strip()
        self.query_one("#vram-model-line", Static).update(
            f"Reading {self.model_ref}…" if self.model_ref else "")
        self.refresh_estimate()

    def action_focus_model(self) -> None:
        """Put the cursor in the model field."""
        self.query_one("#vram-model", Input).focus()

    def _show_model(self, model_line: str) -> None:
        line = self.query("#vram-model-line")
        if line:
            line.first(Static).update(model_line)

    def action_use_model(self) -> None:
        """Make the model in the field the run's model.base_model (a hub id or a model folder)."""
        ref = self.model_ref
        if not ref or ref == self.host.config.model.base_model:
            self.notify("Type a model in the model field first (Enter), then u uses it for the run.")
            return
        if ref.endswith(".json"):
            self.notify(f"{ref} is a config.json alone: a run needs the model's folder or hub id.",
                        severity="warning")
            return
        self.host.config.model.base_model = ref
        self.host.config_edited("model", origin=self)
        self.notify(f"model.base_model is now {ref}")
        self.refresh_estimate()  # the other panes hear of the edit; this one is its origin

    # -------------------------------------------------------------------------------- walkthrough

    def action_toggle_walkthrough(self) -> None:
        """Start the walkthrough at its first step, or leave it (back to the config's estimate)."""
        self.step_index = None if self.step_index is not None or not self.steps else 0
        self._draw()

    def action_walk(self, delta: int) -> None:
        """Move the walkthrough one step forward or back (starting it if needed)."""
        if not self.steps:
            return
        if self.step_index is None:
            self.step_index = 0
        else:
            self.step_index = max(0, min(len(self.steps) - 1, self.step_index + delta))
        self._draw()

    # ------------------------------------------------------------------------------------- events

    def reset_run(self, run: RunDir | None) -> None:
        """Another run is followed: nothing of it is measured yet."""
        self.measured, self.cards = None, {}
        self.measured_device = self.measured_weights = ""
        if self.query("#vram-summary"):  # (composed: not while the pane is still mounting)
            self._draw()

    def on_worker_events(self, message: WorkerEvents) -> None:
        """A worker that names its card (WorkerStarted) makes that card the one estimated against;
        the device and weights the run loaded on (ModelLoaded) label its measurement."""
        if message.run != self.host.current_run:
            return
        setup = (self.measured_device, self.measured_weights)
        for event in message.events:
            if isinstance(event, ev.WorkerStarted) and event.gpu_capacity_bytes:
                self._use_card(Gpu(event.gpu_name or "this GPU", event.gpu_capacity_bytes, detected=True))
            elif isinstance(event, ev.ModelLoaded):
                self.measured_device = device_name(event.device, self.measured_device)
                self.measured_weights = precision_name(event.quantization or event.dtype)
        if setup != (self.measured_device, self.measured_weights) and self.query("#vram-summary"):
            self._show_setups(self._shown())

    def on_memory_sample(self, message: MemorySample) -> None:
        """Fill the measured grid from the newest sample: no estimate, only the gauge's squares."""
        sample = message.sample
        if message.run != self.host.current_run or not sample.categories:
            return
        self.cards[sample.rank] = sample
        if self.is_on_screen and len(self.cards) > 1:
            self._show_cards()
        if sample.rank != 0:
            return  # the big gauge is rank 0's; every card gets a line under it
        if sample.capacity and not self.gpu.detected:
            self._use_card(Gpu(sample.device or "this GPU", sample.capacity, detected=True))
        self.measured = dict(sample.categories)
        self.measured_device = device_name(sample.device, self.measured_device)
        if self.is_on_screen:  # hidden, the gauge catches up when shown (on_show)
            self._show_measured()

    def on_show(self) -> None:
        self._show_measured()
        self._show_cards()

    def _show_setups(self, shown: Estimate | None) -> None:
        """Label each grid with its setup, say why nothing is measured yet, and say so when the
        measurement's setup is not the prediction's (a CPU run in float32 against a GPU in NF4 is
        several times larger: not an error of the estimate)."""
        found = self.query(BlockGauge)
        if not found:
            return
        gauge = found.first()
        predicted = f"for {self.gpu.name}, {shown.plan.stored}" if shown else ""
        measured = ", ".join(part for part in (
            self.measured_device, f"{self.measured_weights} weights" if self.measured_weights else "") if part)
        gauge.predicted_setup = predicted
        gauge.measured_setup = f"on {measured}" if measured else ""
        if self.host.current_run is not None:
            gauge.measured_note = "nothing yet: the run's worker\nsamples its memory at every step"
        elif not any(card.detected for card in self._cards):
            gauge.measured_note = ("nothing: no GPU on this machine.\nThe prediction is for the card "
                                   "picked\nabove; a run here measures CPU memory.")
        else:
            gauge.measured_note = "nothing yet: a run measures its\nmemory as it trains (Training, s)"
        weights = shown.plan.weights.upper() if shown else ""
        differs = bool(shown and measured) and (
            self.measured_device == "CPU" or self.measured_weights not in ("", weights))
        gauge.setup_note = (f"Measured on {measured}, predicted {predicted}: different setups, so the sizes "
                            "differ; this is not the estimate's error." if differs else "")

    def _show_cards(self) -> None:
        cards = self.query("#vram-cards")
        if cards:
            cards.first(Static).display = len(self.cards) > 1
            cards.first(Static).update(cards_text(self.cards))

    def _show_measured(self) -> None:
        gauge = self.query(BlockGauge)
        if gauge:  # absent while the app tears the pane down
            gauge.first().measured = dict(self.measured) if self.measured else None
            self._show_setups(self._shown())

    def _use_card(self, gpu: Gpu) -> None:
        """Estimate against ``gpu`` from now on (a new estimate only when the card changed)."""
        if gpu != self.gpu:
            self.gpu = gpu
            self.refresh_estimate()


def model_for_estimate(config: RunConfig, model_ref: str) -> tuple[ModelInfo, str]:
    """The model to size (the field's, else the run's model.base_model) and a line saying which it
    is. Blocking: reads files and may fetch config.json from the Hub. ``config`` (a copy) gets LoRA
    target names the model has: on Phi-3, q/k/v_proj are its fused qkv_proj, gate/up its gate_up_proj."""
    run_model = config.model.base_model
    if model_ref and model_ref != run_model:
        source = find_model(model_ref)
        info = source.info
        line = f"Model: {model_ref}, from {source.where}; not the run's model ({run_model}): u uses it"
    else:
        try:
            info = load_model_info(run_model, config.model.revision)
        except ModelInfoError:
            if looks_local(run_model):
                raise
            info = find_model(run_model, config.model.revision).info  # Studio's cache, the Hub, bundled
        line = f"Model: {run_model} (the run's model.base_model)"
    if info.fused and config.lora is not None:
        config.lora.target_modules = list(info.lora_targets(config.lora.target_modules))
    return info, line


def planned(config: RunConfig, info: object, capacity: int) -> tuple[RunConfig, str]:
    """``config`` as a run would train it on a card of ``capacity`` bytes (``auto`` planned by
    core/memory/autoplan.py), and the plan's lines; with nothing fitting, the smallest plan and why."""
    resolved = autoplan.plan_or_smallest(config, info, capacity)
    return resolved.config, "\n".join(resolved.lines())


CARD_SQUARES = 40
"""Squares in one card's line: each is 1/40 of the card."""


def cards_text(cards: dict[int, ev.MemorySampled]) -> Text:
    """One line a card of a multi-GPU run: its memory in use (reserved) against its capacity as
    squares, and the numbers; empty for a run on one card."""
    text = Text()
    if len(cards) < 2:
        return text
    text.append("Each card (reserved / capacity):\n", style="bold")
    for rank in sorted(cards):
        sample = cards[rank]
        used = sample.reserved or sum(sample.categories.values())
        filled = min(CARD_SQUARES, round(CARD_SQUARES * used / sample.capacity)) if sample.capacity else 0
        text.append(f"GPU {rank}  ")
        text.append("■" * filled, style="bold")
        text.append("□" * (CARD_SQUARES - filled), style="dim")
        capacity = f" / {sample.capacity / GB:.1f} GB" if sample.capacity else ""
        text.append(f"  {used / GB:.2f} GB{capacity} at step {sample.step}\n")
    return text


def precision_name(name: str) -> str:
    """A loaded model's dtype or quantization as the estimate names weights: ``float32`` -> ``FP32``,
    ``bfloat16`` -> ``BF16``, ``nf4`` -> ``NF4``."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name).upper()


def device_name(device: str, known: str = "") -> str:
    """What a run measures on, for the gauge: ``CPU``, or the card's name (``known`` when the event
    names only ``cuda:0``)."""
    if device.startswith("cpu"):
        return "CPU"
    if device.startswith("cuda"):
        return known or "GPU"
    return device or known

