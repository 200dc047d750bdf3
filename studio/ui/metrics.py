"""Event streams reduced to what the training pane draws: plain Python, testable without Textual.

A :class:`TrainingState` is a fold over a run's events: feed it every event of ``events.jsonl`` in
order (then the live ones) and it holds the step, the ETA, the loss curves and the last failure.
Replaying a whole log and following it live give the same state, which is what lets a UI quit and
come back to the full history. Its lines are worded by studio/core/runs/report.py, as the CLI's are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from studio.core import events as ev
from studio.core.runs import report
from studio.core.runs.report import format_duration
from studio.ui.grpo_metrics import GrpoCurves
from studio.ui.series import Series

DEFAULT_SMOOTHING = 0.9
"""EMA weight of the past in the smoothed loss curve (TensorBoard's default is 0.6; a noisy
small-batch fine-tune reads better with more)."""


@dataclass
class PreferenceCurves:
    """A preference run's (DPO / ORPO) curves from its PreferenceLogged events: per logged step the
    pairs' summed log-probs, reward margin and accuracy, and the validation accuracy per evaluation.
    The training pane plots them in place of the learning rate."""

    chosen_logp: Series = field(default_factory=Series)
    rejected_logp: Series = field(default_factory=Series)
    reward_margin: Series = field(default_factory=Series)
    accuracy: Series = field(default_factory=Series)
    eval_accuracy: Series = field(default_factory=Series)
    last: ev.PreferenceLogged | None = None
    """The newest train-split event."""
    last_eval: ev.PreferenceLogged | None = None
    """The newest validation-split event."""

    @property
    def active(self) -> bool:
        """Whether the run logged any preference metrics (it is a DPO or ORPO run)."""
        return self.last is not None or self.last_eval is not None

    def add(self, event: ev.PreferenceLogged) -> None:
        """Fold one event in."""
        if event.split == "validation":
            self.last_eval = event
            self.eval_accuracy.add(event.step, event.accuracy)
            return
        self.last = event
        for series, value in ((self.chosen_logp, event.chosen_logp), (self.rejected_logp, event.rejected_logp),
                              (self.reward_margin, event.reward_margin), (self.accuracy, event.accuracy)):
            series.add(event.step, value)

    def truncate(self, after_step: float) -> None:
        """Drop points past ``after_step`` (a resumed run redoes those steps)."""
        for series in (self.chosen_logp, self.rejected_logp, self.reward_margin, self.accuracy, self.eval_accuracy):
            series.truncate(after_step)

    def eval_line(self) -> str:
        """The newest evaluation's preference metrics (the newest step's before any evaluation)."""
        event = self.last_eval or self.last
        return report.preference_line(event) if event is not None else ""


def ema(values: Iterable[float], smoothing: float = DEFAULT_SMOOTHING) -> list[float]:
    """Exponential moving average with bias correction, so the first points are not pulled to 0."""
    out: list[float] = []
    avg = 0.0
    for n, value in enumerate(values, start=1):
        avg = smoothing * avg + (1 - smoothing) * value
        out.append(avg / (1 - smoothing**n))
    return out


@dataclass
class TrainingState:
    """Everything the training pane shows, folded from a run's events.

    ``status`` is one of: ``no run``, ``idle`` (worker up, nothing training), ``loading``,
    ``training``, ``paused``, ``finished``, ``stopped``, ``interrupted`` (the worker went away
    mid-run), ``failed``. ``version`` grows on every
    change, so a view can skip redrawing when nothing moved.
    """

    run_id: str = ""
    base_model: str = ""
    status: str = "no run"
    step: int = 0
    total_steps: int = 0
    epoch: float = 0.0
    eta_s: float | None = None
    elapsed_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_seen: int = 0
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    gpus: int = 1
    """GPUs training data-parallel (the effective batch is micro x accumulation x gpus)."""
    loss: Series = field(default_factory=Series)
    eval_loss: Series = field(default_factory=Series)
    learning_rate: Series = field(default_factory=Series)
    last_eval: ev.EvalLogged | None = None
    preference: PreferenceCurves = field(default_factory=PreferenceCurves)
    """DPO / ORPO runs' curves (empty for SFT)."""
    grpo: GrpoCurves = field(default_factory=GrpoCurves)
    """GRPO runs' rewards, lengths, KL and sampled groups (empty otherwise)."""
    base_eval: ev.EvalLogged | None = None
    """The base model's evaluation (step 0, before training): the "before" of the eval curve."""
    memory: ev.MemorySampled | None = None
    loading_stage: str = ""
    loading_fraction: float = 0.0
    device: str = ""
    path: str = ""
    """The run's training path as the pane says it: "fast path", or "plain path" and what rules the
    fast one out (its ModelLoaded); '' before the model loads."""
    failure: ev.WorkerFailed | None = None
    notices: list[str] = field(default_factory=list)
    adapter_path: str = ""
    checkpoint_step: int = 0
    best_eval_loss: float | None = None
    smoothing: float = DEFAULT_SMOOTHING
    version: int = 0
    _smoothed_cache: tuple[int, list[float]] = field(default=(-1, []), repr=False, compare=False)

    # -------------------------------------------------------------------------- folding

    def apply(self, event: ev.Event) -> bool:
        """Fold one event in; True when something the pane draws changed."""
        handler = getattr(self, "_on_" + type(event).__name__, None)
        if handler is None:
            return False
        handler(event)
        self.version += 1
        return True

    def apply_all(self, events: Iterable[ev.Event]) -> bool:
        """Fold many events; True when any of them changed the state."""
        changed = False
        for event in events:
            changed = self.apply(event) or changed
        return changed

    def _on_WorkerStarted(self, event: ev.WorkerStarted) -> None:
        self.device = event.gpu_name or event.device
        if self.status in ("no run", "failed", "training", "paused", "loading"):
            # A fresh worker on a run that was mid-training means the old one died; it waits for
            # a command now (a resume sends RunStarted next).
            self.status = "idle"

    def _on_WorkerStopped(self, event: ev.WorkerStopped) -> None:
        if self.status in ("training", "paused", "loading"):
            self.status = "interrupted"

    def _on_ModelLoading(self, event: ev.ModelLoading) -> None:
        self.loading_stage, self.loading_fraction = event.stage, event.fraction
        if self.status in ("no run", "idle"):
            self.status = "loading"

    def _on_ModelLoaded(self, event: ev.ModelLoaded) -> None:
        self.loading_stage, self.loading_fraction = "", 1.0
        self.base_model = event.base_model or self.base_model
        self.device = self.device or event.device
        if event.path:
            self.path = report.path_line(event) if event.path == "plain" else f"{event.path} path"
        if self.status == "loading":
            self.status = "idle"

    def _on_RunStarted(self, event: ev.RunStarted) -> None:
        self.run_id = event.run_id or self.run_id
        self.base_model = event.base_model or self.base_model
        self.total_steps = event.total_steps
        self.micro_batch_size = event.micro_batch_size
        self.gradient_accumulation_steps = event.gradient_accumulation_steps
        self.gpus = max(1, event.gpus)
        self.status = "training"
        self.failure = None
        if event.resumed_from_step:
            # The steps after the checkpoint are about to be redone; drop their old points.
            for series in (self.loss, self.eval_loss, self.learning_rate):
                series.truncate(event.resumed_from_step)
            self.preference.truncate(event.resumed_from_step)
            self.grpo.truncate(event.resumed_from_step)
            self.step = event.resumed_from_step
            self.notices.append(f"resumed from the checkpoint at step {event.resumed_from_step}")
        else:
            self.step = 0

    def _on_StepLogged(self, event: ev.StepLogged) -> None:
        self.step = event.step
        self.total_steps = event.total_steps or self.total_steps
        self.epoch = event.epoch
        self.eta_s = event.eta_s if event.eta_s > 0 else self._estimate_eta(event)
        self.elapsed_s = event.elapsed_s
        self.tokens_per_s = event.tokens_per_s
        self.tokens_seen = event.tokens_seen
        if math.isfinite(event.loss):
            self.loss.add(event.step, event.loss)
        self.learning_rate.add(event.step, event.learning_rate)
        if self.status not in ("paused",):
            self.status = "training"

    def _estimate_eta(self, event: ev.StepLogged) -> float | None:
        if event.step <= 0 or event.elapsed_s <= 0 or not event.total_steps:
            return None
        return event.elapsed_s / event.step * max(0, event.total_steps - event.step)

    def _on_EvalLogged(self, event: ev.EvalLogged) -> None:
        self.last_eval = event
        if not math.isfinite(event.loss):
            return
        self.eval_loss.add(event.step, event.loss)
        if event.step == 0:
            self.base_eval = event  # the untrained model: a baseline, not a "best" of the fine-tune
            return
        if self.best_eval_loss is None or event.loss < self.best_eval_loss:
            self.best_eval_loss = event.loss

    def _on_PreferenceLogged(self, event: ev.PreferenceLogged) -> None:
        self.preference.add(event)

    def _on_GrpoStepLogged(self, event: ev.GrpoStepLogged) -> None:
        self.grpo.add(event)

    def _on_GrpoGroupSampled(self, event: ev.GrpoGroupSampled) -> None:
        self.grpo.add_group(event)

    def _on_MemorySampled(self, event: ev.MemorySampled) -> None:
        if event.rank == 0:  # a multi-GPU run's other cards are the VRAM pane's
            self.memory = event

    def _on_CheckpointSaved(self, event: ev.CheckpointSaved) -> None:
        self.checkpoint_step = event.step

    def _on_TrainingPaused(self, event: ev.TrainingPaused) -> None:
        self.status = "paused"

    def _on_TrainingResumed(self, event: ev.TrainingResumed) -> None:
        self.status = "training"

    def _on_BatchSizeReduced(self, event: ev.BatchSizeReduced) -> None:
        self.micro_batch_size = event.micro_batch_size
        self.gradient_accumulation_steps = event.gradient_accumulation_steps
        self.notices.append(report.batch_reduced_line(event))

    def _on_TrainingFinished(self, event: ev.TrainingFinished) -> None:
        self.step = event.step or self.step
        self.status = "stopped" if event.stopped else "finished"
        self.adapter_path = event.adapter_path
        self.eta_s = 0.0 if not event.stopped else self.eta_s
        if event.best_eval_loss is not None:
            self.best_eval_loss = event.best_eval_loss

    def _on_WorkerFailed(self, event: ev.WorkerFailed) -> None:
        self.failure = event  # the alert's headline; a failed request leaves the run's status alone
        if event.fatal:
            self.status = "failed"

    def _on_WarningRaised(self, event: ev.WarningRaised) -> None:
        self.notices.append(report.warning_line(event))

    # -------------------------------------------------------------------------- views

    @property
    def smoothed_loss(self) -> list[float]:
        """The train loss smoothed by :func:`ema` (cached per version)."""
        if self._smoothed_cache[0] != self.version:
            self._smoothed_cache = (self.version, ema(self.loss.values, self.smoothing))
        return self._smoothed_cache[1]

    @property
    def progress(self) -> float:
        """Fraction of the optimizer steps done, 0..1."""
        return min(1.0, self.step / self.total_steps) if self.total_steps else 0.0

    @property
    def adapter_ready(self) -> bool:
        """True once an adapter exists to answer with (saved, or being trained in the worker)."""
        return bool(self.adapter_path) or self.step > 0

    def progress_line(self) -> str:
        """``step 120/300 · epoch 0.40 · ETA 1m05s · 850 tok/s``."""
        total = self.total_steps or "?"
        parts = [f"step {self.step}/{total}", f"epoch {self.epoch:.2f}", f"ETA {format_duration(self.eta_s)}"]
        if self.tokens_per_s:
            parts.append(report.format_rate(self.tokens_per_s))
        return " · ".join(parts)

    def memory_line(self) -> str:
        """Device memory in use (and capacity when known)."""
        mem = self.memory
        if mem is None:
            return "memory: --"
        return f"memory ({mem.device}): {report.memory_text(mem)}"

    def eval_line(self) -> str:
        """The last evaluation: loss, perplexity and token accuracy."""
        if self.preference.active:
            return self.preference.eval_line()
        if self.grpo.active:
            return self.grpo.eval_line()
        if self.last_eval is None:
            return "eval: none yet"
        return report.eval_line(self.last_eval)

    def failure_line(self) -> str:
        """What went wrong and what to do, or an empty string."""
        return "" if self.failure is None else report.failure_line(self.failure)


def fold(events: Iterable[ev.Event], smoothing: float = DEFAULT_SMOOTHING) -> TrainingState:
    """A TrainingState built from ``events`` (a run's whole log, say)."""
    state = TrainingState(smoothing=smoothing)
    state.apply_all(events)
    return state
