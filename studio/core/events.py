"""The worker protocol: typed events (past tense) and commands (imperative), one JSON object each.

Events are what happened; the worker appends every one to ``RUN_DIR/events.jsonl`` and sends it to
connected clients. Commands are what a client asks the worker to do. Both are frozen dataclasses so
that a UI can hold them without fear of another thread changing them, and both round-trip through
JSON with :func:`to_json` / :func:`from_json` (the ``type`` key names the class).

Plain Python only: the UI imports this module, so it must never pull in torch.

Longer than ~400 lines on purpose: it is the whole wire format in one place (every class registers
in the one table :func:`from_dict` reads), and each message is a few documented fields.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of every event and command; subclasses register themselves by class name."""

    kind_of_message: ClassVar[str] = "message"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    def to_dict(self) -> dict[str, Any]:
        """The message as a JSON-ready dict, with its class name under ``type``."""
        data = {"type": type(self).__name__}
        data.update(dataclasses.asdict(self))
        return data


@dataclass(frozen=True)
class Event(Message):
    """Something that happened. ``seq`` orders events within a run; ``time`` is a Unix timestamp."""

    kind_of_message: ClassVar[str] = "event"
    seq: int = -1
    time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Command(Message):
    """Something a client asks the worker to do."""

    kind_of_message: ClassVar[str] = "command"


# ----------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class WorkerStarted(Event):
    """The worker process is up and listening."""

    pid: int = 0
    device: str = "cpu"
    gpu_name: str = ""
    gpu_capacity_bytes: int = 0


@dataclass(frozen=True)
class WorkerStopped(Event):
    """The worker exited cleanly."""

    reason: str = ""


@dataclass(frozen=True)
class RunStarted(Event):
    """Training began (or resumed, when ``resumed_from_step`` > 0)."""

    run_id: str = ""
    base_model: str = ""
    total_steps: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    resumed_from_step: int = 0
    gpus: int = 1
    """Processes (GPUs) training data-parallel; accumulation is each one's."""
    effective_batch_size: int = 0
    """Rows (packed rows when packing) per optimizer step over every GPU: micro x accumulation x gpus
    (0 in logs written before it was recorded)."""


@dataclass(frozen=True)
class ModelLoading(Event):
    """Progress while the model loads; ``fraction`` is 0..1."""

    stage: str = ""
    fraction: float = 0.0


@dataclass(frozen=True)
class ModelLoaded(Event):
    """The base model (and adapter) are in memory and ready."""

    base_model: str = ""
    device: str = "cpu"
    dtype: str = ""
    quantization: str = ""
    total_params: int = 0
    trainable_params: int = 0
    load_seconds: float = 0.0
    path: str = ""
    """The training path the run takes: ``fast`` (studio/engine/fast) or ``plain`` (transformers +
    PEFT); '' in event logs written before Studio recorded it."""
    path_reason: str = ""
    """Why: what the fast path runs, or what rules it out (core/plan.py's choose_path)."""


@dataclass(frozen=True)
class StepLogged(Event):
    """One optimizer step finished."""

    step: int = 0
    total_steps: int = 0
    epoch: float = 0.0
    loss: float = 0.0
    learning_rate: float = 0.0
    grad_norm: float = 0.0
    tokens_per_s: float = 0.0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    eta_s: float = 0.0
    mfu: float = 0.0
    expert_tokens: list[int] = field(default_factory=list)
    """A mixture of experts on the fast path: the token copies each expert took since the last
    StepLogged, summed over the sparse layers (a balanced router gives each about the same); [] otherwise."""


@dataclass(frozen=True)
class EvalLogged(Event):
    """Loss, perplexity and next-token accuracy on the validation split, over response tokens."""

    step: int = 0
    loss: float = 0.0
    perplexity: float = 0.0
    token_accuracy: float = 0.0
    rows: int = 0
    method: str = "sft"
    """``sft``: ``loss`` is the responses' cross-entropy and ``perplexity`` its exp. ``dpo`` / ``orpo``:
    ``loss`` is the preference loss (its PreferenceLogged says more); ``perplexity`` and
    ``token_accuracy`` are the chosen answers', not derived from that loss."""


@dataclass(frozen=True)
class PreferenceLogged(Event):
    """A preference run's (DPO / ORPO) step or evaluation, averaged over its pairs.

    DPO's rewards are ``beta * (log p - log p_reference)`` of each answer; ORPO's are ``beta`` times
    the answer's mean token log-prob. Log-probs are summed over each answer's tokens."""

    step: int = 0
    split: str = "train"
    """``train`` (the optimizer step's pairs) or ``validation`` (the evaluation's)."""
    method: str = "dpo"
    loss: float = 0.0
    reward_margin: float = 0.0
    """Mean of chosen reward minus rejected reward."""
    chosen_logp: float = 0.0
    rejected_logp: float = 0.0
    accuracy: float = 0.0
    """Fraction of pairs whose chosen reward is above the rejected one's."""
    pairs: int = 0


@dataclass(frozen=True)
class GrpoStepLogged(Event):
    """A GRPO run's step (its sampled groups; emitted just before the step's StepLogged) or
    evaluation (one greedy completion per held-out prompt). Rewards are means over the completions."""

    step: int = 0
    split: str = "train"
    """``train`` (the optimizer step's groups) or ``validation`` (the evaluation's prompts)."""
    rewards: dict[str, float | None] = field(default_factory=dict)
    """Each reward's mean (over the completions it applied to; None if it applied to none), by label."""
    reward: float = 0.0
    """Mean total reward (each completion's weighted sum of its rewards)."""
    reward_std: float = 0.0
    """Mean standard deviation of the total within a group (0 on validation): the spread GRPO learns from."""
    zero_spread: float = 0.0
    """Fraction of groups whose completions all scored the same: they teach nothing this step."""
    completion_length: float = 0.0
    """Mean completion length in tokens (the stop token included)."""
    truncated: float = 0.0
    """Fraction of completions cut at ``grpo.max_completion_length``."""
    kl: float | None = None
    """Mean per-token KL divergence from the base model (None when ``grpo.beta`` is 0: not computed)."""
    completions: int = 0
    prompts: int = 0


@dataclass(frozen=True)
class GrpoGroupSampled(Event):
    """One prompt's group from a GRPO step: its completions with each reward's score (the newest
    group of every logged step, so the run's history can be browsed back)."""

    step: int = 0
    prompt: str = ""
    """The prompt as the policy saw it."""
    completions: list[dict[str, Any]] = field(default_factory=list)
    """Per completion: ``text``, ``total``, ``scores`` (label -> value or None), ``advantage``,
    ``tokens`` and ``stopped`` (False: cut at the length limit)."""


@dataclass(frozen=True)
class MemorySampled(Event):
    """Device memory, in bytes: totals from the allocator and a breakdown by category.

    ``categories`` uses the estimator's keys: weights, lora, gradients, optimizer, activations,
    overhead.
    """

    step: int = 0
    device: str = "cpu"
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    capacity: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    rank: int = 0
    """Which process (GPU) of a data-parallel run this sample is from; each samples its own card."""


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint was written (atomically) to ``path``."""

    step: int = 0
    path: str = ""


@dataclass(frozen=True)
class TrainingPaused(Event):
    """Training is paused after ``step``; generation still works."""

    step: int = 0


@dataclass(frozen=True)
class TrainingResumed(Event):
    """Training continues after a pause."""

    step: int = 0


@dataclass(frozen=True)
class BatchSizeReduced(Event):
    """Out of memory: the micro-batch was halved and accumulation doubled (same effective batch)."""

    step: int = 0
    old_micro_batch_size: int = 0
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    message: str = ""
    estimated_bytes: int = 0
    """What core/memory/ estimated for the micro-batch that failed (0: no estimate, e.g. on a CPU)."""
    capacity_bytes: int = 0
    """The card's memory that estimate was held against (0: unknown)."""


@dataclass(frozen=True)
class AutoPlanChosen(Event):
    """``trainer.micro_batch_size`` / ``gradient_checkpointing: auto`` resolved on a CUDA card at
    the start of a run (core/memory/autoplan.py): the plan chosen and the faster ones rejected, with why."""

    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    gradient_checkpointing: bool = True
    effective_batch_size: int = 0
    path: str = ""
    """The training path the estimates were for: ``fast`` or ``plain``."""
    estimated_bytes: int = 0
    """The chosen plan's estimated total (peak reserved plus the CUDA context)."""
    capacity_bytes: int = 0
    """The card's memory the plan was made for (free memory plus this process's context)."""
    headroom_bytes: int = 0
    rejected: list[str] = field(default_factory=list)
    """The faster alternatives rejected, each ``micro-batch 32 x 1, checkpointing: needs ...``."""
    recorded: bool = False
    """True when the values are the run's own from its start (a resumed run), not planned now."""
    message: str = ""
    """Set when the plan could not be made and the CPU values were used: why."""


@dataclass(frozen=True)
class TrainingFinished(Event):
    """Training ended: completed, or stopped by request (``stopped``)."""

    step: int = 0
    stopped: bool = False
    adapter_path: str = ""
    train_loss: float = 0.0
    best_eval_loss: float | None = None
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class GenerationStarted(Event):
    """A generation request began; ``adapter`` False means the base model (zero-shot)."""

    request_id: str = ""
    adapter: bool = False
    prompt: str = ""


@dataclass(frozen=True)
class TokenGenerated(Event):
    """A piece of streamed text for a generation request."""

    request_id: str = ""
    text: str = ""


@dataclass(frozen=True)
class GenerationFinished(Event):
    """A generation request ended."""

    request_id: str = ""
    adapter: bool = False
    text: str = ""
    new_tokens: int = 0
    tokens_per_s: float = 0.0


class WorkerState(StrEnum):
    """What a worker is doing (:class:`StatusReported`'s ``state``)."""

    IDLE = "idle"
    LOADING = "loading"
    TRAINING = "training"
    PAUSED = "paused"
    EXPORTING = "exporting"
    SCORING = "scoring"
    """Answering held-out rows while not training."""
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def in_training(self) -> bool:
        """Loading, training or paused: a training is under way."""
        return self in (WorkerState.LOADING, WorkerState.TRAINING, WorkerState.PAUSED)

    @property
    def busy(self) -> bool:
        """Doing a job (a training, an export, held-out scoring): such a worker is never displaced
        for another run."""
        return self.in_training or self in (WorkerState.EXPORTING, WorkerState.SCORING)


@dataclass(frozen=True)
class StatusReported(Event):
    """Answer to :class:`Status`: what the worker is doing now."""

    state: WorkerState = WorkerState.IDLE
    step: int = 0
    total_steps: int = 0
    run_id: str = ""
    model_loaded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", WorkerState(self.state))  # JSON carries it as its value


@dataclass(frozen=True)
class ExportProgress(Event):
    """Progress of an :class:`ExportRun` or :class:`Embed` request; ``fraction`` is 0..1."""

    path: str = ""
    stage: str = ""
    fraction: float = 0.0


@dataclass(frozen=True)
class ExportFinished(Event):
    """An export or embedding was written to ``path`` (``ok`` False: ``message`` says why not)."""

    path: str = ""
    ok: bool = True
    message: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class HeldOutRowScored(Event):
    """One held-out row of a :class:`ScoreHeldOut` request, answered greedily by the base model
    and (``tuned`` not None) the fine-tune, each scored against ``target`` (studio/core/runs/scoring.py)."""

    request_id: str = ""
    index: int = 0
    total: int = 0
    split: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    """The row's prompt fields (template field -> text)."""
    prompt: str = ""
    """The rendered prompt the models were given."""
    target: str = ""
    base: str = ""
    tuned: str | None = None
    base_exact: bool = False
    tuned_exact: bool | None = None
    base_similarity: float = 0.0
    tuned_similarity: float | None = None
    rejected: str | None = None
    """Preference runs: the pair's rejected answer (``target`` is the chosen one)."""
    base_margin: float | None = None
    """Preference runs: the base model's log p(chosen) - log p(rejected); above 0 it prefers chosen."""
    tuned_margin: float | None = None
    """Preference runs: the same for the fine-tune."""
    base_rewards: dict[str, float | None] | None = None
    """GRPO runs: each reward's score of the base model's answer (None: it did not apply), and its
    weighted total under ``total``."""
    tuned_rewards: dict[str, float | None] | None = None
    """GRPO runs: the same for the fine-tune's answer."""


@dataclass(frozen=True)
class HeldOutFinished(Event):
    """A :class:`ScoreHeldOut` request is done: totals, and ``path`` of the saved ``eval.json``
    (``ok`` False: ``message`` says why nothing was scored)."""

    request_id: str = ""
    ok: bool = True
    message: str = ""
    split: str = ""
    rows: int = 0
    path: str = ""
    base_exact_match: float = 0.0
    base_similarity: float = 0.0
    tuned_exact_match: float | None = None
    tuned_similarity: float | None = None
    seconds: float = 0.0
    base_preference_accuracy: float | None = None
    """Preference runs: the fraction of pairs the base model prefers the chosen answer of."""
    tuned_preference_accuracy: float | None = None
    """Preference runs: the same for the fine-tune."""
    base_rewards: dict[str, float | None] | None = None
    """GRPO runs: each reward's mean over the rows' base answers (and the weighted total's, ``total``)."""
    tuned_rewards: dict[str, float | None] | None = None
    """GRPO runs: the same for the fine-tune's answers."""


class FailureKind(StrEnum):
    """What went wrong (:class:`WorkerFailed`'s ``kind``): what the person has to change."""

    OOM = "oom"
    """Out of GPU memory."""
    DATA = "data"
    """The dataset (a file, a column, a row)."""
    CONFIG = "config"
    """The config, a saved run folder, or a command that does not fit the worker's state."""
    CRASH = "crash"
    """Anything else: a bug, with its traceback in worker.log."""
    DISK = "disk"
    """The disk is full."""
    REWARD = "reward"
    """A GRPO reward function (the user's Python) raised or returned values that are not numbers."""


class ReportedFailure(RuntimeError):
    """Raised (by the engine) once the WorkerFailed of ``kind`` has been emitted: whoever catches it
    must not report it again."""

    def __init__(self, kind: FailureKind | str, message: str):
        super().__init__(message)
        self.kind = FailureKind(kind)


@dataclass(frozen=True)
class WorkerFailed(Event):
    """Something went wrong. ``kind`` is a :class:`FailureKind` value; ``message`` says what to do. A
    failure of the run itself (it stopped, state ``failed``) is ``fatal``; one of a single request the
    worker goes on after names it in ``request``."""

    kind: str = "crash"
    message: str = ""
    detail: str = ""
    fatal: bool = True
    request: str = ""
    """The command that failed (``Generate``, ``Evaluate``, ``Pause``, ...) when only that request did
    and the worker goes on (``fatal`` False); empty for a failure of the run."""


@dataclass(frozen=True)
class WarningRaised(Event):
    """Something a person should know that stopped nothing: a fallback taken (no 4-bit on a CPU, the
    plain training path, torch AdamW), rows cut at the length limit, a halved micro-batch, a note.
    ``kind`` is the area, as a failure's (config, data, oom, crash, disk); ``message`` says what
    happened and what to do about it; ``detail`` holds what to report (a traceback), if anything."""

    kind: str = "config"
    message: str = ""
    detail: str = ""


# --------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class LoadModel(Command):
    """Load the base model and attach the adapter (from the run's config)."""


@dataclass(frozen=True)
class StartTraining(Command):
    """Start training (or resume from the latest checkpoint when ``resume`` is true)."""

    resume: bool = False


@dataclass(frozen=True)
class Pause(Command):
    """Pause training after the current optimizer step."""


@dataclass(frozen=True)
class Resume(Command):
    """Continue a paused run."""


@dataclass(frozen=True)
class Stop(Command):
    """Save a checkpoint and the adapter, then stop training."""


@dataclass(frozen=True)
class Generate(Command):
    """Generate an answer, streamed as TokenGenerated events; ``adapter`` False = base model.

    ``prompt`` is the person's text; the worker renders it with the run's template (it fills the
    template's first field). ``row``, when given, is a whole dataset row (template field -> text,
    e.g. instruction and input of a held-out row) rendered instead of ``prompt``.
    """

    request_id: str = ""
    prompt: str = ""
    adapter: bool = True
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    row: dict[str, str] | None = None


@dataclass(frozen=True)
class Evaluate(Command):
    """Run evaluation on the validation split now."""


@dataclass(frozen=True)
class ScoreHeldOut(Command):
    """Answer up to ``rows`` held-out rows (the test split, else the validation split) greedily
    with the base model and, when ``adapter``, the fine-tune; score them against their targets.

    Reported a row at a time (HeldOutRowScored, served between training steps and chat requests),
    then HeldOutFinished; the results are saved as ``RUN_DIR/eval.json`` and ``eval.csv``.
    """

    request_id: str = ""
    rows: int = 50
    adapter: bool = True
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Status(Command):
    """Ask for a StatusReported event."""


@dataclass(frozen=True)
class ExportRun(Command):
    """Export the run's model to ``path`` as ``format``: ``adapter`` (the PEFT folder, a model card and
    the prompt template), ``merged`` (safetensors in ``dtype``) or ``gguf`` (a GGUF file in ``quant``,
    a LoRA GGUF adapter and an Ollama Modelfile). Reported by ExportProgress and ExportFinished;
    served when training is not running."""

    path: str = ""
    format: str = "adapter"
    quant: str = "f16"
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Embed(Command):
    """Write one embedding per row of ``data`` to the Parquet file ``out``: the hidden state of
    ``layer`` (-1: the last) pooled by ``pool`` (mean or last token), from the fine-tuned model or,
    with ``base``, the base model. Reported by ExportProgress and ExportFinished (path = ``out``)."""

    data: str = ""
    out: str = ""
    layer: int = -1
    pool: str = "mean"
    base: bool = False
    batch_size: int = 16


@dataclass(frozen=True)
class Shutdown(Command):
    """Stop training (with a checkpoint) and exit the worker."""


# ------------------------------------------------------------------------------------ encoding


def to_json(message: Message) -> str:
    """One line of JSON for ``message`` (no trailing newline)."""
    return json.dumps(message.to_dict(), separators=(",", ":"), default=str)


def from_dict(data: dict[str, Any]) -> Message:
    """Rebuild a message from :meth:`Message.to_dict` output; unknown fields are ignored.

    Ignoring unknown fields lets an older UI read a newer worker's log. A non-fatal ``WorkerFailed``
    that names no request is a warning written before warnings had their own event (runs made by an
    older Studio): it is read as the :class:`WarningRaised` it was.
    """
    name = data.get("type")
    if name == "WorkerFailed" and data.get("fatal") is False and not data.get("request"):
        name = "WarningRaised"
    cls = _REGISTRY.get(str(name))
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def from_json(line: str) -> Message:
    """Parse one JSON line into its event or command."""
    return from_dict(json.loads(line))


def with_seq(event: Event, seq: int) -> Event:
    """A copy of ``event`` numbered ``seq``."""
    return dataclasses.replace(event, seq=seq)
