"""A mixture of experts' 4-bit experts in transformers' own forward without gradients: a group of
experts in 16 bits at a time.

Generation, chat and the plain path's evaluation run transformers' forward of each sparse layer.
With the experts held in 4 bits (NF4/FP4 packed by engine/quantized_experts.py, or gpt-oss' MXFP4
kept by engine/mxfp4.py), that forward runs without gradients over the experts its tokens were
routed to, a group at a time: the group's weights (both projections) dequantized to the compute
dtype, then freed before the next group's (engine/expert_weights.py). A group is as many experts as
fit :data:`EXPERT_GROUP_BYTES`, so the answer never holds a whole layer's experts in 16 bits, which a
card that trains the model may not have beside the training state (gpt-oss-20b: 1.6 GB a layer).
PEFT's expert adapter (``lora.target_experts``) is the exception: it adds its delta to the whole
parameter, so that forward holds the whole layer.

Plain Python: it must never import torch.
"""

from __future__ import annotations

from studio.core.memory.fast import dequantizes
from studio.core.memory.params import compute_bytes
from studio.core.memory.plan import Plan
from studio.core.model.info import ModelInfo

EXPERT_GROUP_BYTES = 256 * 2**20
"""The 16-bit expert weights a group may hold (both projections). Small beside a 16 GB card's
training state (a dense 7B layer's widest weight, dequantized for its product, is 0.1 GB), yet large
enough that a prompt's pass over every expert runs few groups: gpt-oss-20b's 32 experts of 50 MB
each go 5 at a time (7 groups), Qwen3-30B-A3B's 128 of 9.4 MB 28 at a time (5 groups); each group
is one more forward of the experts module, whose launches a decoding step pays per group hit."""


def captured_expert_bytes(info: ModelInfo, plan: Plan) -> int:
    """Bytes of 16-bit expert weights a CUDA graph of transformers' forward keeps in its pool: a
    capture cannot run the groups (they read which experts were hit on the host), so the captured
    forward lends each sparse layer's whole experts, both projections, and PEFT's adapted copy with
    ``lora.target_experts`` (GRPO's decode step, engine/sampler.py). 0 where :func:`lent_expert_bytes`
    is."""
    if not info.sparse_layers or not dequantizes(plan.weights):
        return 0
    layer = info.experts * _expert_bytes(info, plan)
    return 2 * layer if plan.lora_experts and plan.lora_r else layer


def _expert_bytes(info: ModelInfo, plan: Plan) -> int:
    """One expert's gate, up and down weights in the compute dtype."""
    return 3 * info.hidden * info.expert_intermediate * compute_bytes(plan)


def experts_per_group(expert_bytes: int) -> int:
    """Experts in a group when one expert's 16-bit weights (both projections) take ``expert_bytes``:
    as many as fit :data:`EXPERT_GROUP_BYTES`, at least one."""
    return max(1, EXPERT_GROUP_BYTES // max(1, expert_bytes))


def lent_expert_bytes(info: ModelInfo, plan: Plan) -> int:
    """Bytes of 16-bit expert weights that transformers' forward without gradients holds at once for
    ``plan`` on ``info``, in the compute dtype: a full group's (every expert's where a layer has
    fewer); with ``lora.target_experts`` the whole layer's twice over instead, as PEFT's expert adapter
    adds its delta to each whole parameter and keeps the sum for the forward (its
    ``_LoraFactorsProxy``). 0 for a dense model or experts not held in 4 bits (bitsandbytes' 8-bit
    loading and a 16-bit load leave them as they are). The copies of a group's biases (gpt-oss: a
    few kB) are left out."""
    if plan.lora_experts and plan.lora_r:
        return captured_expert_bytes(info, plan)  # the whole layer and its adapted copy, grouped or not
    if not info.sparse_layers or not dequantizes(plan.weights):
        return 0
    expert = _expert_bytes(info, plan)
    return min(info.experts, experts_per_group(expert)) * expert
