"""The memory estimate: where a run's GPU memory goes, by category and by phase, before it loads; the
automatic plan built on it; the cards of this machine.

Modules, each importing only those above it:

- ``gpus``: GPU cards Studio knows by size, and detection of this machine's through NVML;
- ``allocator``: the CUDA context, cuBLAS workspaces and the caching allocator's pages;
- ``plan``: :class:`Plan`, a training setup as the estimator sees it, and ``plan_for`` a run config;
- ``params``: bytes of what lives through the run (weights, adapters, gradients, optimizer state);
- ``result``: :class:`Estimate` and :class:`PhasePeak`, what an estimate says;
- ``plain``: the training step on the plain path (transformers + PEFT + bitsandbytes);
- ``attention``: the fast path's attention: which computes soft-caps and sinks, what it keeps;
- ``fast``: the training step on the fast path (studio/engine/fast/);
- ``expert_groups``: 4-bit experts in transformers' forward without gradients, a group at a time;
- ``phases``: evaluation, generation and checkpoint save around the step;
- ``estimate``: :func:`estimate` of a run config on the path the engine takes (core/plan.py);
- ``walkthrough``: the VRAM pane's story, from a full fp32 fine-tune to paged QLoRA;
- ``lengths``: the training data's token lengths, for sizing unpacked steps (reads a tokenizer);
- ``autoplan``: ``micro_batch_size`` / ``gradient_checkpointing: auto`` -> the fastest plan that fits
  the card less headroom (``studio estimate``, the VRAM pane, engine/planning.py);
- ``multigpu``: how many GPUs a run trains on, and which (``distributed.gpus`` against this machine).

Plain Python: nothing here imports torch.
"""

from studio.core.memory.allocator import CUDA_CONTEXT_BYTES
from studio.core.memory.estimate import estimate, estimate_plan, path_choice
from studio.core.memory.plan import ALL_LINEAR, Plan, plan_for
from studio.core.memory.result import CATEGORIES, OPTIONAL_CATEGORIES, PHASES, Estimate, PhasePeak
from studio.core.memory.walkthrough import WalkStep, walkthrough

__all__ = ["ALL_LINEAR", "CATEGORIES", "CUDA_CONTEXT_BYTES", "OPTIONAL_CATEGORIES", "PHASES", "Estimate", "PhasePeak",
           "Plan", "WalkStep", "estimate", "estimate_plan", "path_choice", "plan_for", "walkthrough"]
