"""The automatic plan: ``trainer.micro_batch_size: auto`` and ``gradient_checkpointing: auto``.

On a CUDA card a run picks, at its start, the fastest (micro-batch, checkpointing) pair whose
estimated peak fits the card less a stated headroom, and keeps the effective batch exactly through
gradient accumulation. ``studio estimate`` and the VRAM pane show the same plan before a run.

How it decides:

* **Candidates.** Micro-batch sizes that divide the effective batch (so micro-batch x accumulation
  is the effective batch exactly), times checkpointing on and off. On the fast path every layer is
  checkpointed whatever the config says (core/plan.py), so there only the micro-batch varies. A key
  the config sets explicitly is not varied.
* **Memory.** Each candidate's estimated total (core/memory/ ``estimate``: the peak reserved plus
  the CUDA context, on the path the engine will take) must be at most the card less
  :func:`headroom_for`. The estimate is the peak over every phase of a run (training step,
  evaluation, generation for chat, checkpoint save: core/memory/phases.py), so a plan whose chat
  answer (its KV cache) would not fit is rejected too.
* **Speed.** :func:`relative_speed`, a documented proxy, not a measurement: a fixed cost per
  micro-batch's forward and backward pass (kernel launches, the host's work, unpacking quantized
  weights) amortised over its tokens (a GRPO scored pass in chunks pays it once a chunk), and one
  more forward (4/3 of the compute) with checkpointing. The fastest candidate that fits wins.

Without a CUDA card ``auto`` means what the defaults were before it existed (config.py's
``CPU_MICRO_BATCH_SIZE`` and ``CPU_GRADIENT_CHECKPOINTING``): nothing is planned.

Plain Python: the UI and ``studio estimate`` import this; it must never import torch.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from studio.core.config import AUTO, RunConfig
from studio.core.memory.gpus import GB, GIB
from studio.core.model.info import ModelInfo

if TYPE_CHECKING:
    from studio.core.memory.result import Estimate

HEADROOM_FRACTION = 0.10
"""Part of the card the plan leaves free. The fast path's estimate of peak reserved memory is within
4.4% of Studio's own Trainer on the H100 rows run one at a time, and reserved memory moved by
0.4-0.5 GiB when the card was shared (docs/memory.md), so a tenth of the card covers a typical
error; a worse one is what the out-of-memory halving is for (its event says by how much the
estimate was wrong)."""

HEADROOM_MIN_BYTES = 1 * GIB
"""At least this much is left free: on small cards a tenth is less than what other processes and a
desktop commonly hold on the same GPU."""

SATURATION_TOKENS = 2560
"""The speed proxy's fixed cost of one micro-batch, in tokens' worth of work. Fitted to issue 18's
H100 measurement (Llama-2-7B NF4 r16, 512-token rows): 8.9k tokens/s at 4096 tokens a micro-batch,
12.6k at 16384, i.e. a fixed cost worth about 2,600 tokens. It ranks micro-batches (bigger is
faster, with diminishing returns once the GPU is busy) and weighs a bigger micro-batch with
checkpointing against a smaller one without; smaller models saturate later, larger ones sooner."""

RECOMPUTE_COST = 4 / 3
"""Checkpointing's compute relative to none: forward (1) + backward (2) + the recomputed forward (1)."""

PLAN_FILE = "auto_plan.json"
"""The values a run resolved ``auto`` to, in its run directory: a resumed run trains with them."""


class AutoPlanError(ValueError):
    """No candidate fits the card; the message names the keys to change."""

    def __init__(self, message: str, rejected: tuple[Candidate, ...] = ()):
        super().__init__(message)
        self.rejected = rejected


@dataclass(frozen=True)
class Candidate:
    """One (micro-batch, checkpointing) pair the planner weighed."""

    micro_batch: int
    """Sequences (or preference pairs) per forward pass."""

    accumulation: int
    """Micro-batches per optimizer step: the effective batch divided by ``micro_batch``."""

    checkpointing: bool
    """Gradient checkpointing (always on for the fast path, whatever this says)."""

    total: int
    """Estimated bytes on the card: peak reserved plus the CUDA context."""

    speed: float
    """:func:`relative_speed`: tokens/s relative to a saturated step without recompute (1.0)."""

    reason: str = ""
    """Why it was not chosen ('' for the chosen one)."""

    def label(self) -> str:
        """``micro-batch 8 x 2, checkpointing``."""
        return (f"micro-batch {self.micro_batch} x {self.accumulation}, "
                + ("checkpointing" if self.checkpointing else "no checkpointing"))

    def to_json_dict(self) -> dict:
        return {"micro_batch_size": self.micro_batch, "gradient_accumulation_steps": self.accumulation,
                "gradient_checkpointing": self.checkpointing, "total": self.total,
                "speed": round(self.speed, 4), "reason": self.reason}


@dataclass(frozen=True)
class AutoPlan:
    """The plan chosen for a card, and every alternative rejected with why."""

    chosen: Candidate
    rejected: tuple[Candidate, ...]
    capacity: int
    """The card's memory the plan was made for, in bytes."""

    headroom: int
    """Bytes left free (:func:`headroom_for`)."""

    effective_batch: int
    """Examples per optimizer step (each GPU's, on several)."""

    path: str
    """``fast`` or ``plain``: the training path the estimates are for."""

    varied: tuple[str, ...] = field(default=("micro_batch_size", "gradient_checkpointing"))
    """The trainer keys that were ``auto`` (the others were kept as configured)."""

    @property
    def budget(self) -> int:
        """What a candidate may need: the card less the headroom."""
        return self.capacity - self.headroom

    def apply(self, config: RunConfig) -> RunConfig:
        """A copy of ``config`` with the chosen values in place of ``auto``."""
        return with_values(config, self.chosen.micro_batch, self.chosen.checkpointing, self.effective_batch)

    def to_json_dict(self) -> dict:
        """``studio estimate --json``'s ``auto_plan``: chosen, rejected (each with its reason), the card."""
        return {"chosen": self.chosen.to_json_dict(), "rejected": [c.to_json_dict() for c in self.rejected],
                "capacity": self.capacity, "headroom": self.headroom, "budget": self.budget,
                "effective_batch_size": self.effective_batch, "path": self.path, "auto": list(self.varied)}

    def lines(self, limit: int = 6) -> list[str]:
        """The plan in a few lines (``studio estimate``, the VRAM pane): the choice, then the
        rejected alternatives that were faster (why they lost matters), then a count of the rest."""
        c = self.chosen
        out = [f"automatic plan: {c.label()} (effective batch {self.effective_batch}), "
               f"{c.total / GB:.1f} GB of {self.capacity / GB:.1f} GB less {self.headroom / GB:.1f} GB headroom"]
        faster = [r for r in self.rejected if r.speed > c.speed]
        for r in faster[:limit]:
            out.append(f"  rejected {r.label()}: {r.reason}")
        rest = len(self.rejected) - min(len(faster), limit)
        if rest:
            out.append(f"  and {rest} slower plan{'s' if rest != 1 else ''}")
        return out


def is_auto(config: RunConfig) -> bool:
    """Whether the config leaves the micro-batch or checkpointing to the plan."""
    return AUTO in (config.trainer.micro_batch_size, config.trainer.gradient_checkpointing)


def headroom_for(capacity: int) -> int:
    """Bytes a plan leaves free on a card of ``capacity`` bytes."""
    return max(int(capacity * HEADROOM_FRACTION), min(HEADROOM_MIN_BYTES, capacity // 2))


def relative_speed(tokens: int, checkpointing: bool, passes: int = 1) -> float:
    """The speed proxy: tokens/s of a micro-batch of ``tokens`` tokens relative to a saturated step
    without recompute, ``tokens / (tokens + passes x SATURATION_TOKENS)``, divided by
    ``RECOMPUTE_COST`` with checkpointing. ``passes``: forward and backward passes the micro-batch
    takes (a GRPO scored pass in chunks: core/memory/estimate.py's ``grpo_scored_rows``), each with
    its fixed cost."""
    speed = tokens / (tokens + passes * SATURATION_TOKENS)
    return speed / RECOMPUTE_COST if checkpointing else speed


def effective_batch(config: RunConfig) -> int:
    """The effective batch the plan keeps: ``effective_batch_size`` when set; else (accumulation set
    directly) accumulation x the micro-batch the config gives, or its CPU value for ``auto``."""
    t = config.trainer
    if t.effective_batch_size and not t.gradient_accumulation_steps:
        return int(t.effective_batch_size)
    return t.effective_batch()


def with_values(config: RunConfig, micro_batch: int, checkpointing: bool, effective: int) -> RunConfig:
    """A copy of ``config`` training ``micro_batch`` x (``effective`` / it) with ``checkpointing``."""
    out = copy.deepcopy(config)
    t = out.trainer
    t.micro_batch_size, t.gradient_checkpointing = int(micro_batch), bool(checkpointing)
    if config.trainer.micro_batch_size == AUTO:  # an explicit micro-batch keeps its accumulation as set
        t.effective_batch_size, t.gradient_accumulation_steps = int(effective), None
    return out


def cpu_values(config: RunConfig) -> RunConfig:
    """``auto`` resolved without a CUDA card: the values the defaults had before ``auto``."""
    t = config.trainer
    return with_values(config, t.micro_batch(), t.checkpointing(), effective_batch(config))


@dataclass(frozen=True)
class Planned:
    """``auto`` resolved for a card as a run would train: the config, and how it was chosen."""

    config: RunConfig
    """The config with numbers in place of ``auto`` (as given when it sets both keys)."""

    plan: AutoPlan | None = None
    """The plan chosen; None when the config sets both keys or when nothing fits."""

    refused: AutoPlanError | None = None
    """Why nothing fits with headroom; ``config`` then trains :attr:`smallest`."""

    @property
    def smallest(self) -> Candidate | None:
        """The candidate that needs the least memory, when nothing fits with headroom."""
        return min(self.refused.rejected, key=lambda c: c.total) if self.refused is not None else None

    def lines(self) -> list[str]:
        """What ``studio estimate`` and the VRAM pane print: the plan's lines, or why none fits."""
        if self.plan is not None:
            return self.plan.lines()
        return [f"automatic plan: {self.refused}"] if self.refused is not None else []


def plan_or_smallest(config: RunConfig, info: ModelInfo, capacity: int, lengths: tuple[int, ...] = ()) -> Planned:
    """``config`` as a run trains it on a card of ``capacity`` bytes: ``auto`` planned by :func:`plan`,
    or, when nothing fits with headroom, the candidate that needs the least memory. What ``studio
    estimate``, the VRAM pane and the run itself (engine/planning.py) all go by."""
    if not is_auto(config):
        return Planned(config)
    try:
        chosen = plan(config, info, capacity, lengths=lengths)
    except AutoPlanError as refused:
        least = min(refused.rejected, key=lambda c: c.total)
        return Planned(with_values(config, least.micro_batch, least.checkpointing, effective_batch(config)),
                       refused=refused)
    return Planned(chosen.apply(config), plan=chosen)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(config: RunConfig, info: ModelInfo, capacity: int, headroom: int | None = None,
         lengths: tuple[int, ...] = ()) -> AutoPlan:
    """The fastest candidate whose estimate fits ``capacity`` less the headroom, with every
    rejected one and why. ``lengths``: the training examples' token lengths when the data was read
    (core/memory/lengths.py; unpacked runs are sized from them). Raises :class:`AutoPlanError`
    (naming the keys to change) when none fits, and ValueError (as core/memory/ ``estimate`` does) for a
    LoRA target the model lacks."""
    from studio.core.memory.estimate import estimate  # the estimator imports config; keep this module light to import

    headroom = headroom_for(capacity) if headroom is None else headroom
    budget = capacity - headroom
    t = config.trainer
    target = effective_batch(config)
    base = cpu_values(config)
    path = estimate(base, info).path
    micros = _divisors(target) if t.micro_batch_size == AUTO else [int(t.micro_batch_size)]
    if t.gradient_checkpointing != AUTO:
        ckpts = [bool(t.gradient_checkpointing)]
    else:
        ckpts = [True] if path == "fast" else [True, False]
    sequences = 2 if t.method in ("dpo", "orpo") else config.grpo.num_generations if t.method == "grpo" else 1
    candidates = []
    weighed_by: dict[tuple[int, bool], Estimate] = {}
    for micro in micros:
        for ckpt in ckpts:
            option = with_values(config, micro, ckpt, target)
            weighed = estimate(option, info, lengths=lengths)
            weighed_by[(micro, ckpt)] = weighed
            speed = relative_speed(micro * sequences * config.data.max_seq_length, ckpt or path == "fast",
                                   weighed.plan.passes)
            total = weighed.total
            candidates.append(Candidate(micro, option.trainer.accumulation_steps(), ckpt, total, speed))
    candidates.sort(key=lambda c: (-c.speed, c.total))

    def too_big(c: Candidate) -> str:
        return (f"needs {c.total / GB:.1f} GB, card has {capacity / GB:.1f} GB less "
                f"{headroom / GB:.1f} GB headroom")

    chosen = next((c for c in candidates if c.total <= budget), None)
    varied = tuple(k for k in ("micro_batch_size", "gradient_checkpointing") if getattr(t, k) == AUTO)
    if chosen is None:
        rejected = tuple(Candidate(c.micro_batch, c.accumulation, c.checkpointing, c.total, c.speed, too_big(c))
                         for c in candidates)
        least = min(candidates, key=lambda c: c.total)
        # only the advice that would change something: a fixed key auto could lower, a setting not yet taken
        fixed = [f"trainer.{k}" for k in ("micro_batch_size", "gradient_checkpointing")
                 if k not in varied and getattr(t, k) not in (1, True)]
        advice = _advice(config, weighed_by[(least.micro_batch, least.checkpointing)], least.total - budget)
        raise AutoPlanError(
            f"no plan fits {capacity / GB:.1f} GB less {headroom / GB:.1f} GB headroom: the smallest, "
            f"{least.label()}, needs {least.total / GB:.1f} GB; {', '.join(advice + ['a smaller model'])}"
            + (f", or set {' and '.join(fixed)} to auto" if fixed else ""), rejected)
    rejected = []
    for c in candidates:
        if c is chosen:
            continue
        if c.total > budget:
            why = too_big(c)
        else:
            why = f"fits ({c.total / GB:.1f} GB) but slower (speed {c.speed:.2f} vs {chosen.speed:.2f})"
        rejected.append(Candidate(c.micro_batch, c.accumulation, c.checkpointing, c.total, c.speed, why))
    return AutoPlan(chosen, tuple(rejected), capacity, headroom, target, path, varied)


def _advice(config: RunConfig, least: Estimate, gap: int) -> list[str]:
    """The changes that could win back a real part of the ``gap`` bytes the smallest plan is over
    budget by (at least a tenth of it), the likeliest first, each with the memory it acts on: the
    most it could free. A change that acts on less is left out (0.03 GB of adapters against a 1.2 GB
    gap is no advice)."""
    cats = least.categories
    acts = cats.get("activations", 0)
    options: list[tuple[float, str]] = [
        (acts, f"lower data.max_seq_length (now {config.data.max_seq_length}; activations {acts / GB:.1f} GB)")]
    bits = config.quantization.bits
    if bits != 4:
        frozen = cats.get("weights", 0) + cats.get("experts", 0)
        options.append((frozen * (1 - 4 / (bits or 16)), f"use quantization.bits: 4 (weights {frozen / GB:.1f} GB)"))
    if config.lora is not None:
        trained = cats.get("lora", 0) + cats.get("gradients", 0) + cats.get("optimizer", 0)
        options.append((trained, f"a smaller lora.r (adapters, gradients and optimizer state {trained / GB:.2f} GB)"))
    if not config.trainer.optimizer.startswith("paged"):
        state = cats.get("optimizer", 0)
        options.append((0.75 * state, f"trainer.optimizer: paged_adamw_8bit (optimizer state {state / GB:.2f} GB)"))
    options.sort(key=lambda o: -o[0])
    return [text for frees, text in options if frees >= gap / 10]


# ------------------------------------------------------------------------------ the run's record


def record(run_path: str | Path, micro_batch: int, checkpointing: bool, effective: int, **facts: object) -> None:
    """Write the resolved values into the run directory (private, whole or not at all)."""
    path = Path(run_path) / PLAN_FILE
    tmp = path.with_name(path.name + ".tmp")
    data = {"micro_batch_size": micro_batch, "gradient_checkpointing": checkpointing,
            "effective_batch_size": effective, **facts}
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def recorded(run_path: str | Path) -> dict | None:
    """The values a run resolved ``auto`` to (:func:`record`), or None when it has none yet."""
    path = Path(run_path) / PLAN_FILE
    try:
        data = json.loads(path.read_text())
        return {"micro_batch_size": int(data["micro_batch_size"]),
                "gradient_checkpointing": bool(data["gradient_checkpointing"]),
                "effective_batch_size": int(data["effective_batch_size"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
