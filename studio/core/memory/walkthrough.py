"""The walkthrough: how each memory-saving step of QLoRA changes the estimate, from a full fp32
fine-tune to paged 8-bit AdamW on NF4 with checkpointing (the VRAM pane's story).

Plain Python: the UI imports this; it must never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from studio.core.config import RunConfig
from studio.core.memory.estimate import estimate_plan
from studio.core.memory.plan import plan_for
from studio.core.memory.result import Estimate
from studio.core.model.info import ModelInfo


@dataclass(frozen=True)
class WalkStep:
    """One step of the walkthrough: a setup, its estimate and why it saves memory."""

    title: str
    """What the step changes, in a few words."""

    why: str
    """Why it saves memory."""

    estimate: Estimate
    """The estimate of the setup with this step and every one before it."""


def walkthrough(config: RunConfig, info: ModelInfo, gpu_bytes: int | None = None) -> list[WalkStep]:
    """The seed's story for this model: full fp32 -> bf16 -> 8-bit -> LoRA -> NF4 QLoRA ->
    + gradient checkpointing -> + paged 8-bit optimizer, each step changing one thing."""
    base = plan_for(config, info=info)
    # a full fine-tune's config (lora: null) has no adapter of its own: its LoRA steps show the default one
    lora = dict(lora_r=base.lora_r or 16, lora_targets=base.lora_targets or info.lora_targets("all-linear"),
                lora_dropout=base.lora_dropout)
    full = replace(base, lora_r=None, checkpointing=False, optimizer="adamw", compute="fp32",
                   weights="fp32")
    steps = [
        ("Full fine-tune, fp32", full,
         "every weight trains: 4 B weight + 4 B gradient + 8 B Adam m and v per parameter"),
        ("Full fine-tune, bf16", replace(full, weights="bf16", compute="bf16"),
         "bf16 halves weights, gradients, Adam state and activations"),
        ("8-bit weights", replace(full, weights="int8", compute="bf16"),
         "LLM.int8 halves the weights again; int8 weights cannot take updates, so an adapter is next"),
        ("LoRA on 8-bit", replace(full, weights="int8", compute="bf16", **lora),
         "only the adapter trains: gradients and Adam state shrink to it (the fp32 residual stream "
         "of k-bit training costs activations)"),
        ("NF4 QLoRA", replace(full, weights="nf4", double_quant=True, compute="bf16", **lora),
         "4-bit NF4 packs two weights a byte, plus small quantization constants"),
        ("+ gradient checkpointing", replace(full, weights="nf4", compute="bf16", checkpointing=True,
                                             **lora),
         "keep only each layer's input and recompute the rest in backward: ~30% more compute"),
        ("+ paged 8-bit AdamW", replace(full, weights="nf4", compute="bf16", checkpointing=True,
                                        optimizer="paged_adamw_8bit", **lora),
         "8-bit m and v; paging moves them to host RAM instead of failing on a spike"),
    ]
    return [WalkStep(title, why, estimate_plan(info, plan, gpu_bytes)) for title, plan, why in steps]
