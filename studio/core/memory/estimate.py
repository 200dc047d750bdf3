"""Predict where the GPU memory of a fine-tuning run goes, by category and phase, before loading anything.

:func:`estimate` asks core/plan.py which path the engine will take (the function the engine calls
itself) and models that one: the plain path's step in core/memory/plain.py, the fast path's in
core/memory/fast.py; the other phases of a run (evaluation, generation, checkpoint save) come from
core/memory/phases.py, and the peak is the largest. It reports in the categories the gauge draws
and ``engine/memory.py`` measures: weights, lora, gradients, optimizer, activations, overhead.
Checked against measurements of Studio's Trainer on the GPU: tests/data/vram_measured.json
(bench/vram_measure.py), docs/memory.md.

Plain Python: the UI and ``studio estimate`` import this; it must never import torch.
"""

from __future__ import annotations

from dataclasses import replace

from studio.core.config import RunConfig
from studio.core.memory.allocator import CUDA_CONTEXT_BYTES
from studio.core.memory.fast import fast_step
from studio.core.memory.phases import peak_phase, phase_peaks
from studio.core.memory.plain import plain_step
from studio.core.memory.plan import Plan, plan_for
from studio.core.memory.result import MODEL_LOAD, Estimate
from studio.core.model.info import ModelInfo
from studio.core.plan import PathChoice, PathFacts, choose_path


def estimate_plan(info: ModelInfo, plan: Plan, gpu_bytes: int | None = None) -> Estimate:
    """Predict the memory of ``plan`` on model ``info`` (see :func:`estimate`), on the plan's path:
    the peak over every phase of a run, the categories of the moment that sets it."""
    result = fast_step(info, plan) if plan.path == "fast" else plain_step(info, plan)
    phases = phase_peaks(info, plan, result)
    top = peak_phase(phases)
    result.phases, result.peak_phase, result.step_categories = phases, top, dict(result.categories)
    result.peak_allocated = max(p.allocated for p in phases.values())
    if top != "training step":  # the categories of the moment that sets the peak: no gradients then
        c, peak = result.categories, phases[top]
        on_device_optimizer = 0 if plan.optimizer.startswith("paged") else c["optimizer"]
        c["gradients"] = peak.gradients
        c["activations"] = (peak.allocated - c["weights"] - c["experts"] - c["lora"] - on_device_optimizer
                            - c["gradients"])
        if top == MODEL_LOAD:  # before the adapter and the optimizer exist: the experts in transit
            c["lora"] = c["optimizer"] = c["activations"] = 0
            c["experts"] = peak.allocated - c["weights"]
        c["overhead"] = peak.reserved - peak.allocated + CUDA_CONTEXT_BYTES
        result.peak_reserved = peak.reserved
        result.total = sum(c.values())
        result.notes.insert(0, f"the {top} sets the peak: {peak.held}")
    if gpu_bytes is not None:
        result.capacity, result.fits = gpu_bytes, result.total <= gpu_bytes
        result.max_micro_batch = _max_micro_batch(info, plan, gpu_bytes)
    return result


def grpo_scored_rows(info: ModelInfo, plan: Plan) -> int:
    """Completions a GRPO micro-batch's scored pass takes in one forward and backward
    (:attr:`Plan.grpo_scored_rows`), chosen by memory: the micro-batch's every row, halved for as
    long as the scored pass (the training step) is the phase of the run with the largest allocated
    peak. Its activations shrink with its rows; the sampling's KV cache of every row does not, and
    once the sampling (or another phase) holds as much, fewer rows a pass would lower the run's peak
    by no more than the allocator's rounding while adding passes, each of which unpacks every
    quantized weight again. 0 for a run that is not GRPO."""
    if not plan.grpo_completion:
        return 0
    rows = plan.rows
    while rows > 1:
        phases = estimate_plan(info, replace(plan, grpo_scored_rows=rows)).phases
        others = max(p.allocated for name, p in phases.items() if name != "training step")
        if phases["training step"].allocated <= others:
            break
        rows = -(-rows // 2)
    return rows


def _total(info: ModelInfo, plan: Plan) -> int:
    return estimate_plan(info, plan).total


def _max_micro_batch(info: ModelInfo, plan: Plan, capacity: int, limit: int = 4096) -> int:
    """Largest micro-batch whose total fits (memory grows with it, so bisect)."""
    if _total(info, replace(plan, micro_batch=1)) > capacity:
        return 0
    low, high = 1, 2
    while high <= limit and _total(info, replace(plan, micro_batch=high)) <= capacity:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if _total(info, replace(plan, micro_batch=mid)) <= capacity:
            low = mid
        else:
            high = mid
    return low


def path_choice(config: RunConfig, model_info: ModelInfo) -> PathChoice:
    """The training path Studio's engine will take for ``config`` on this model on a GPU, decided
    by the function the engine calls (core/plan.py's choose_path)."""
    plan = plan_for(config, info=model_info)
    # with the model's sparse MLP, the experts' adapters (lora.target_experts) are targets too, and a
    # load-balancing loss keeps the layer inputs on the card, as the engine decides
    facts = PathFacts.from_config(config, cuda=True, weights=plan.weights, model_blocker=model_info.fast_path_blocker,
                                  targets=plan.lora_targets, moe=model_info.moe)
    choice = choose_path(facts)
    if choice.path == "plain":
        choice = replace(choice, checkpointing=plan.checkpointing)
    return choice


def estimate(config: RunConfig, model_info: ModelInfo, gpu_bytes: int | None = None,
             micro_batch: int | None = None, lengths: tuple[int, ...] = ()) -> Estimate:
    """Predict the GPU memory of training ``config`` on the model ``model_info`` describes, on the
    path the engine will take (:func:`path_choice`).

    ``gpu_bytes`` is the card's capacity (for fits / max_micro_batch); ``micro_batch`` overrides the
    config's; ``lengths`` the training examples' token lengths when known (:func:`plan_for`).
    Raises ValueError naming ``lora.target_modules`` if a target is not in the model.
    """
    choice = path_choice(config, model_info)
    plan = replace(plan_for(config, micro_batch, lengths=lengths, info=model_info), path=choice.path,
                   cuda_graphs=choice.cuda_graphs)
    plan = replace(plan, grpo_scored_rows=grpo_scored_rows(model_info, plan))
    result = replace(estimate_plan(model_info, plan, gpu_bytes), choice=choice)
    if choice.path == "fast":
        # what the engine's eager steps do beyond the memory model's note, and why they are eager
        first = next((i for i, n in enumerate(result.notes) if n.endswith("eager steps")), None)
        if first is not None:
            result.notes[first] += ((" with the layer inputs in host memory" if choice.host_offload else "")
                                    + (f": {choice.eager}" if choice.eager else ""))
    if plan.passes > 1:
        result.notes.insert(0, f"GRPO's scored pass takes the micro-batch's {plan.rows} completions "
                            f"{plan.pass_rows} at a time ({plan.passes} forward and backward passes): "
                            "another phase holds as much, so fewer a pass would lower the peak by little")
    if plan.lora_r is None:  # the config's own full fine-tune (the walkthrough's steps tell their own story)
        result.notes.insert(0, f"full fine-tuning: every weight has a gradient in {plan.weights} and AdamW state ("
                            + ("m and v in the weights' dtype, torch AdamW" if plan.optimizer == "adamw" else
                               "fp32 m and v" if plan.optimizer == "paged_adamw" else "8-bit m and v")
                            + "); no fp32 master copy")
    return result
