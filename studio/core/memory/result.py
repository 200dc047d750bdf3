"""What an estimate says: bytes per category, the peaks of each phase of a run, and the card's verdict.

Plain Python: the UI and ``studio estimate`` read these; it must never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from studio.core.memory.plan import Plan
from studio.core.plan import PathChoice

CATEGORIES = ("weights", "experts", "lora", "gradients", "optimizer", "activations", "overhead")
"""Category keys, in drawing order; engine/memory.py measures the same ones. ``experts``: a mixture
of experts' expert weights (0 for a dense model), apart from the other frozen ``weights``."""

OPTIONAL_CATEGORIES = ("experts",)
"""Categories shown only where an estimate or a measurement has some (a dense model has no experts)."""

PHASES = ("training step", "evaluation", "generation", "checkpoint save")
"""The phases of a run, in the order a run meets them; the estimate's peak is the largest. A GRPO
run has one more, :data:`GRPO_SAMPLING`; a mixture of experts packed on load one before them all,
:data:`MODEL_LOAD`."""

GRPO_SAMPLING = "GRPO sampling"
"""A GRPO run's phase that samples the group's completions (core/memory/phases.py)."""

MODEL_LOAD = "model load"
"""The load of a mixture of experts whose experts are packed in 4 bits as they load: for a moment
one layer's expert weights are on the card in 16 bits (core/memory/phases.py)."""


@dataclass(frozen=True)
class PhasePeak:
    """One phase's predicted peaks, in bytes."""

    allocated: int
    """Predicted ``torch.cuda.max_memory_allocated()`` over the phase."""

    reserved: int
    """Predicted ``torch.cuda.max_memory_reserved()`` once the phase is over (never below the
    training step's: reserved memory is not given back during a run)."""

    held: str
    """What the phase holds beyond what persists, in words (``studio estimate`` shows it)."""

    host_kv: bool = False
    """Generation only: the answer's KV cache is kept on the host, a few layers on the card at a
    time, because on the card it would need more memory than the training step."""

    gradients: int = 0
    """Bytes of the adapters' gradients the phase holds (between two CUDA-graphed steps: the
    graphs' fixed gradient tensors, engine/fast/graphs.py's GradSink)."""

    def to_json_dict(self) -> dict:
        """``studio estimate --json``'s shape of one phase."""
        out = {"peak_allocated": self.allocated, "peak_reserved": self.reserved, "held": self.held}
        if self.host_kv:
            out["kv_cache"] = "host"
        return out


@dataclass
class Estimate:
    """Predicted memory of one training step, in bytes."""

    categories: dict[str, int]
    """Bytes per category (keys in :data:`CATEGORIES`); they sum to ``total``."""

    total: int
    """Everything that must fit on the card: peak reserved by torch plus the CUDA context."""

    capacity: int | None
    """The card's memory in bytes, or None when no card was given."""

    fits: bool | None
    """``total <= capacity``; None without a capacity."""

    max_micro_batch: int | None
    """The largest micro-batch whose total fits (0: not even 1), or None without a capacity."""

    peak_allocated: int
    """Predicted ``torch.cuda.max_memory_allocated()`` over a step."""

    peak_reserved: int
    """Predicted ``torch.cuda.max_memory_reserved()`` over a step."""

    plan: Plan
    """The setup this estimate is for."""

    notes: list[str] = field(default_factory=list)
    """Caveats a person should read (paged state, unknown model parts, ...)."""

    choice: PathChoice | None = None
    """The engine's path decision this estimate follows (core/plan.py), with its reason; None for
    estimates of a bare Plan (the walkthrough's steps, the benchmark's rows)."""

    phases: dict[str, PhasePeak] = field(default_factory=dict)
    """Each phase of a run (:data:`PHASES`: training step, evaluation, generation, checkpoint save)
    and its :class:`PhasePeak`; the peaks above are the largest of them."""

    peak_phase: str = "training step"
    """The phase that sets the peak reserved memory (and the categories, which are that moment's)."""

    step_categories: dict[str, int] = field(default_factory=dict)
    """The training step's categories (what engine/memory.py measures during a step); the same as
    ``categories`` when the step sets the peak."""

    @property
    def path(self) -> str:
        """``fast`` or ``plain``: the training path this estimate models."""
        return self.plan.path

    def to_json_dict(self) -> dict:
        """The ``studio estimate --json`` shape: categories, total, capacity, fits, max_micro_batch,
        the path (``fast`` or ``plain``) and the plan it assumed."""
        plan = {"weights": self.plan.weights, "compute": self.plan.compute, "lora_r": self.plan.lora_r,
                "lora_targets": list(self.plan.lora_targets), "lora_dropout": self.plan.lora_dropout,
                "micro_batch": self.plan.micro_batch, "seq_len": self.plan.seq_len,
                "checkpointing": self.plan.checkpointing or self.plan.path == "fast",
                "optimizer": self.plan.optimizer, "accumulation": self.plan.accumulation,
                "expandable_segments": self.plan.expandable_segments}
        if self.choice is not None:
            plan.update(self.choice.to_json_dict())
        else:
            plan["path"] = self.plan.path
        plan["token_lengths"] = ({"source": "data", "longest": self.plan.row_len,
                                  "micro_batch_tokens": self.plan.real_tokens, "examples": len(self.plan.lengths)}
                                 if self.plan.data_sized else {"source": "max_seq_length"})
        return {"categories": dict(self.categories), "total": self.total, "capacity": self.capacity,
                "fits": self.fits, "max_micro_batch": self.max_micro_batch, "path": self.plan.path, "plan": plan,
                "peak_phase": self.peak_phase,
                "phases": {name: peak.to_json_dict() for name, peak in self.phases.items()}}
