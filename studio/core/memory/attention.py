"""The fast path's attention, as the memory estimate sees it (studio/engine/fast/attention.py): which
attention computes soft-capped scores and sinks (Studio's fused Triton kernels, or plain torch),
the plain-torch one's blocks of scores, and the fused one's output kept for the recomputation.

Flash attention (every other layer's) keeps nothing beyond the layer's outputs that
core/memory/fast.py counts. Plain Python: it must never import torch.
"""

from __future__ import annotations

from studio.core.memory.params import compute_bytes
from studio.core.memory.plan import Plan
from studio.core.model.info import ModelInfo

EAGER_SCORES = 1 << 24
"""Attention scores the plain-torch attention (engine/fast/attention.py's EagerAttention: soft-capped
scores, attention sinks) computes at once, a block of queries against their keys: its fp32 working
set is a few tensors of this many values (:func:`eager_attention_bytes`)."""

EAGER_TENSORS = 5
"""fp32 tensors of a block's scores alive at once in EagerAttention's backward: the scores, their
softmax (with a sink, the softmax of the scores and the sink's column besides), the weights'
gradient and the scores' gradient (before its cast)."""

FUSED_ATTENTION_WIDTH = 256
"""The widest heads engine/fast/fused_attention.py's kernels take."""


def fused_attention(info: ModelInfo, plan: Plan) -> bool:
    """Whether the fast path computes soft-capped scores and attention sinks with Studio's fused
    Triton attention (engine/fast/fused_attention.py, built where engine/fast/build.py says) rather
    than in plain torch (EagerAttention): its kernels on (``trainer.fast_path.kernels``), a
    half-precision compute dtype and heads at most :data:`FUSED_ATTENTION_WIDTH` wide. On a CUDA
    card, the estimate's subject, torch's build brings Triton, so the engine decides the same way;
    a kernel that fails to build on the card (the engine then warns and computes in plain torch) is
    not foreseen."""
    return plan.kernels and plan.compute in ("bf16", "fp16") and info.head_width <= FUSED_ATTENTION_WIDTH


def eager_attention_bytes(info: ModelInfo, plan: Plan) -> int:
    """The working set of a model whose attention the fast path computes in plain torch because of
    its sinks (gpt-oss; engine/fast/attention.py's EagerAttention): :data:`EAGER_TENSORS` fp32
    tensors of one block's scores, the query heads sharing a key/value head against an example's
    keys, at most :data:`EAGER_SCORES` values. 0 where the fused attention runs instead
    (:func:`fused_attention`: its output kept for the recomputation is
    :func:`kept_attention_per_token`'s; ``dout . out``, a query and head in the backward, is as
    small as the log-sum-exp, inside the layer's fitted working set), and 0 without sinks (Gemma 2's
    soft-capped attention, where it runs the same eager code: its measured rows hold that in the
    fitted working set)."""
    if not info.sinks or fused_attention(info, plan):
        return 0
    rep = info.heads // info.kv_heads
    longest = min(plan.seq_len, plan.real_tokens)
    return EAGER_TENSORS * 4 * min(EAGER_SCORES, rep * longest * longest)


def kept_attention_per_token(info: ModelInfo, plan: Plan) -> int:
    """Bytes per token of a layer's attention output (compute dtype) and log-sum-exp (fp32, one a
    head) that its recomputation takes back from host memory instead of running the attention's
    forward again (engine/fast/offload.py): where Studio's fused attention runs (soft-capped scores
    or sinks: :func:`fused_attention`), whose forward alone hands them out; 0 elsewhere."""
    if not (info.softcapped or info.sinks) or not fused_attention(info, plan):
        return 0
    return info.heads * (info.head_width * compute_bytes(plan) + 4)
