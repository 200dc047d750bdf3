"""``auto`` resolved at the start of a run: the card's memory now, core/memory/autoplan.py's choice.

On a CUDA card the plan is made against what is free on the card (plus this process's own CUDA
context, which the estimate counts and the driver already subtracted), announced as an
AutoPlanChosen event and written into the run directory, so that a resumed run trains with the
values its start chose whatever the card holds then. Without CUDA ``auto`` means the values the
defaults had before it (config.py): nothing is planned and nothing is said.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.memory import CUDA_CONTEXT_BYTES, autoplan
from studio.core.memory.lengths import data_lengths
from studio.core.model.info import ModelInfoError, load_model_info
from studio.core.runs import RunDir


class PlanRefused(ValueError):
    """Not even the smallest candidate fits the whole card; the message names the keys to change."""


def card_capacity(device: torch.device) -> int:
    """Bytes a run may plan for on ``device``: what is free now plus this process's CUDA context
    (the estimates of core/memory/ count it; ``mem_get_info`` creates it and reports it as used), at
    most the card's total."""
    free, total = torch.cuda.mem_get_info(device)
    return min(total, free + CUDA_CONTEXT_BYTES)


def resolve(config: RunConfig, run: RunDir, device: torch.device, emit: Callable[[ev.Event], object],
            leader: bool = True, rows: Sequence[dict] | None = None) -> tuple[RunConfig, autoplan.AutoPlan | None]:
    """``config`` with ``auto`` replaced by numbers, and the plan made (None when none was: no
    ``auto``, no CUDA, the run's recorded values, or a plan that could not be made). ``rows``: the
    training split, already loaded; without packing the plan is sized from their token lengths
    (core/memory/lengths.py). Raises :class:`PlanRefused` when nothing fits the card."""
    if not autoplan.is_auto(config):
        return config, None
    cuda = device.type == "cuda"
    kept = autoplan.recorded(run.path)
    if kept is not None:
        resolved = autoplan.with_values(config, kept["micro_batch_size"], kept["gradient_checkpointing"],
                                        kept["effective_batch_size"])
        if cuda:
            emit(_event(resolved, recorded=True))
        return resolved, None
    if not cuda:
        resolved = autoplan.cpu_values(config)
        _record(run, resolved, leader, device="cpu")
        return resolved, None
    capacity = card_capacity(device)
    try:
        info = load_model_info(config.model.base_model, config.model.revision)
        lengths = () if config.trainer.packing else data_lengths(config, rows)[0]
        planned = autoplan.plan_or_smallest(config, info, capacity, lengths=lengths)
    except (ModelInfoError, ValueError) as exc:
        resolved = autoplan.cpu_values(config)
        emit(_event(resolved, message=(f"could not plan ({exc}); using the defaults: set "
                                       "trainer.micro_batch_size and trainer.gradient_checkpointing to choose")))
        _record(run, resolved, leader, device=str(device), capacity=capacity)
        return resolved, None
    resolved, least = planned.config, planned.smallest
    if least is not None:  # nothing fits with headroom: the smallest plan, if the card holds it at all
        if least.total > capacity:
            raise PlanRefused(str(planned.refused))
        emit(_event(resolved, message=(f"nothing fits with {autoplan.HEADROOM_FRACTION:.0%} headroom; trying the "
                                       f"smallest plan, {least.total / 1e9:.1f} GB of {capacity / 1e9:.1f} GB")))
        _record(run, resolved, leader, device=str(device), capacity=capacity)
        return resolved, None
    plan = planned.plan
    assert plan is not None  # an auto config gets a plan, or the smallest when none fits
    c = plan.chosen
    emit(_event(resolved, path=plan.path, estimated_bytes=c.total, capacity_bytes=plan.capacity,
                headroom_bytes=plan.headroom,
                rejected=[f"{r.label()}: {r.reason}" for r in plan.rejected if r.speed > c.speed]))
    _record(run, resolved, leader, device=str(device), capacity=capacity, estimated=c.total, path=plan.path)
    return resolved, plan


def _event(resolved: RunConfig, **fields: object) -> ev.AutoPlanChosen:
    t = resolved.trainer
    return ev.AutoPlanChosen(micro_batch_size=t.micro_batch(), gradient_accumulation_steps=t.accumulation_steps(),
                             gradient_checkpointing=t.checkpointing(),
                             effective_batch_size=t.effective_batch(), **fields)


def _record(run: RunDir, resolved: RunConfig, leader: bool, **facts: object) -> None:
    if leader and run.path.is_dir():
        t = resolved.trainer
        autoplan.record(run.path, t.micro_batch(), t.checkpointing(), t.effective_batch(), **facts)
