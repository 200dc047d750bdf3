"""What a decoder needs beyond a Llama layer, by name: the vocabulary core/plan.py compares with
what the fast path runs (``FAST_DECODER_FEATURES``).

A Llama layer (the empty set): pre-norm RMSNorms that cast before the weight, a SiLU-gated MLP,
separate q/k/v/o/gate/up/down modules without biases, attention scaled by 1/sqrt(head_dim) over
every earlier token, the model's own RoPE (any rope_type its rotary module computes) on the whole
of each head, and the decoder at ``model`` of the causal LM.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from studio.core.decoder.spec import DecoderSpec

FEATURES: dict[str, str] = {
    "linear_bias": "linear projections with a bias",
    "qk_norm_head": "per-head q/k norms",
    "qk_norm_projection": "q/k norms over the whole projection",
    "norm_offset": "RMSNorms scaled by 1 + weight",
    "norm_cast_after_scale": "RMSNorms that scale in fp32 before the cast",
    "post_norms": "norms on the attention and MLP outputs",
    "no_pre_norms": "layers without a norm before attention and the MLP",
    "gelu_tanh": "GELU-tanh gated MLPs",
    "fused_projections": "fused qkv_proj and gate_up_proj modules",
    "embed_scale": "scaled embeddings",
    "attention_scale": "an attention scale other than 1/sqrt(head_dim)",
    "attn_softcap": "attention logit soft-capping",
    "final_softcap": "final logit soft-capping",
    "sliding_window": "sliding-window attention",
    "layer_rope": "a RoPE table per layer type",
    "partial_rotary": "partial rotary embeddings",
    "no_rope_layers": "layers without RoPE",
    "residual_scale": "scaled residual branches",
    "logits_scale": "scaled logits",
    "nested_decoder": "a text decoder inside a multimodal model",
    "mixture_of_experts": "mixture-of-experts MLPs",
    "router_jitter": "router jitter noise",
    "qkv_clip": "clipped q/k/v projections",
    "attention_sinks": "attention sinks",
    "router_bias": "router biases",
    "topk_softmax": "routers that take the top k before the softmax",
    "expert_bias": "expert biases",
    "clamped_swiglu": "clamped SwiGLU experts",
    "interleaved_gate_up": "interleaved expert gate/up outputs",
}
"""Every feature a DecoderSpec can need beyond Llama's, and how a person reads it. An activation
other than SiLU and GELU-tanh is ``activation:<name>``, which is not here: nothing runs it fast."""

DECODER_FEATURES = frozenset(FEATURES)
"""All of :data:`FEATURES`: what the fast path runs once it runs every described family."""


def features_of(spec: DecoderSpec) -> frozenset[str]:
    """The names (:data:`FEATURES`, or ``activation:<name>``) of what ``spec`` needs beyond a Llama layer."""
    found: set[str] = set()
    if spec.biases:
        found.add("linear_bias")
    if spec.qk_norm != "none":
        found.add(f"qk_norm_{spec.qk_norm}")
    if spec.norm.offset:
        found.add("norm_offset")
    if spec.norm.cast == "scaled":
        found.add("norm_cast_after_scale")
    if spec.norms.attn_out or spec.norms.mlp_out:
        found.add("post_norms")
    if not (spec.norms.attn_in and spec.norms.mlp_in):
        found.add("no_pre_norms")
    if spec.activation == "gelu_pytorch_tanh":
        found.add("gelu_tanh")
    elif spec.activation != "silu":
        found.add(f"activation:{spec.activation}")
    if spec.fused:
        found.add("fused_projections")
    if spec.embed_scale != 1.0:
        found.add("embed_scale")
    if not math.isclose(spec.attention_scale, spec.head_dim ** -0.5, rel_tol=1e-9):
        found.add("attention_scale")
    if spec.attn_softcap is not None:
        found.add("attn_softcap")
    if spec.final_softcap is not None:
        found.add("final_softcap")
    # a window as long as every position the model takes never hides a token (Phi-4-mini's 262144)
    if any(layer.window is not None and layer.window < spec.max_positions for layer in spec.layers):
        found.add("sliding_window")
    if any(layer.rope_key is not None for layer in spec.layers):
        found.add("layer_rope")
    if any(layer.rope is not None and layer.rope.rotary_dim < spec.head_dim for layer in spec.layers):
        found.add("partial_rotary")
    if any(layer.rope is None for layer in spec.layers):
        found.add("no_rope_layers")
    if spec.residual_scale != 1.0:
        found.add("residual_scale")
    if spec.logits_divisor != 1.0:
        found.add("logits_scale")
    if spec.decoder_path != ("model",):
        found.add("nested_decoder")
    if spec.moe is not None and spec.sparse_layers:
        found.add("mixture_of_experts")
    if spec.router_jitter:
        found.add("router_jitter")
    if spec.qkv_clip is not None:
        found.add("qkv_clip")
    if spec.sinks:
        found.add("attention_sinks")
    moe = spec.moe if spec.sparse_layers else None
    if moe is not None:
        found.update(name for name, present in (
            ("router_bias", moe.router_bias), ("topk_softmax", moe.routing == "topk_softmax"),
            ("expert_bias", moe.expert_bias), ("clamped_swiglu", moe.activation == "clamped_swiglu"),
            ("interleaved_gate_up", moe.interleaved)) if present)
    return frozenset(found)


def in_words(features: frozenset[str] | set[str], most: int | None = None) -> str:
    """The features as a person reads them, in :data:`FEATURES`' order, unknown ones last; past
    ``most`` of them, how many more."""
    known = [words for name, words in FEATURES.items() if name in features]
    others = sorted(f"{name.split(':', 1)[1]}-gated MLPs" if name.startswith("activation:") else name
                    for name in features if name not in FEATURES)
    words = known + others
    if most is not None and len(words) > most + 1:
        return ", ".join(words[:most]) + f" and {len(words) - most} more"
    return ", ".join(words)
