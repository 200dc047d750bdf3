"""The model families Studio writes as GGUF, as data: which llama.cpp architecture each is, and what
its metadata and tensors must say for llama.cpp to compute what transformers computes.

What llama.cpp reads, and what it assumes without reading, decides every entry (facts from its
``convert_hf_to_gguf.py`` and ``llama-model.cpp``):

- **Rotary layout.** llama.cpp's ``llama`` architecture rotates adjacent channel pairs, Hugging Face
  Llama rotates halves: q/k rows are reordered per head (``permute_qk``). Qwen, Gemma and Phi-3 use
  llama.cpp's NeoX rotation, which is Hugging Face's: nothing to reorder.
- **Gemma norms** scale by ``1 + w`` in Hugging Face; llama.cpp multiplies by the stored weight, so
  ``w + 1`` is stored (``norm_shift``). The embedding scale (``sqrt(hidden)``) llama.cpp applies itself.
- **Head size.** ``attention.key_length`` / ``value_length`` are written where a config sets
  ``head_dim`` (Qwen3, Gemma, Mistral Nemo); llama.cpp otherwise takes ``hidden / heads``.
- **Phi-3** keeps its fused ``qkv_proj`` and ``gate_up_proj`` (llama.cpp splits them itself), and its
  rotary width (``rope.dimension_count``) is ``partial_rotary_factor * hidden / heads``.
- **Gemma 2 and 3**: llama.cpp fixes what the config could vary: sliding-window layers alternate
  (Gemma 2) or five of every six slide (Gemma 3), the sliding layers of Gemma 3 rotate with base
  10000, and the attention scale is ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 27B sizes).
  A config that differs is refused rather than written into a file llama.cpp would misread.
- **Mixtures of experts** (Qwen3-MoE, Mixtral, OLMoE, gpt-oss): the expert counts are written
  (``expert_count``, ``expert_used_count``, Qwen3-MoE's and gpt-oss' ``expert_feed_forward_length``)
  and each layer's experts stacked into one tensor a projection (``ffn_gate_exps`` / ``ffn_up_exps`` /
  ``ffn_down_exps``, ``[experts, out, in]``), the router as ``ffn_gate_inp``. llama.cpp weighs the
  chosen experts as each architecture fixes it, not as a config key says: Qwen3-MoE and Mixtral
  (llama.cpp's ``llama`` architecture with experts) renormalise the top-k probabilities, OLMoE does
  not (``renormalize``), gpt-oss takes a softmax over the chosen experts' logits (the same
  weights renormalised). llama.cpp's Qwen3-MoE has experts in every layer; its OLMoE norms keys over
  the hidden size (no grouped-query attention) and needs an output head of its own. A config that
  differs is refused. Qwen2-MoE, DeepSeek and other mixtures are refused in one line.
- **gpt-oss** (llama.cpp's ``gpt-oss``, its ``openai-moe`` loader): attention biases and per-head
  sinks (``attn_sinks``), the norm before the experts as ``post_attention_norm``, biases on the
  router and on every expert. llama.cpp fixes what the config could vary: even layers slide, odd
  layers are global (``sliding_window`` is read), the clamped SwiGLU's alpha 1.702 and limit 7.0, and
  an output head of its own. Its experts' layout and MXFP4 blocks are :mod:`studio.engine.gguf_tensors`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class GgufExportError(RuntimeError):
    """The model or adapter cannot be written as GGUF; the message says why and what to do."""


@dataclass(frozen=True)
class Family:
    """How one Hugging Face ``model_type`` is written as GGUF."""

    arch: str
    """The ``gguf.MODEL_ARCH`` member (``LLAMA``, ``QWEN2``, ...)."""
    permute_qk: bool = False
    """Reorder q/k rows from rotated halves to rotated pairs (llama.cpp's ``llama`` architecture)."""
    norm_shift: float = 0.0
    """Added to every RMSNorm weight (Gemma's ``1 + w``)."""
    softcapping: bool = False
    """Attention and final logit soft-capping keys (Gemma 2)."""
    sliding_pattern: int = 0
    """llama.cpp's fixed sliding-window pattern: every ``n``-th layer is global (0: no sliding window)."""
    big_layers: int = 0
    """The layer count of the size whose attention scale llama.cpp takes as ``1/sqrt(hidden/heads)``."""
    partial_rotary: bool = False
    """Rotary width from ``partial_rotary_factor * hidden / heads`` (Phi-3)."""
    rope_types: tuple[str, ...] = ("default",)
    """RoPE scaling types this family's GGUF can carry."""
    has_output: bool = True
    """Whether llama.cpp reads an ``output.weight`` at all (Gemma 2 always ties)."""
    output_required: bool = False
    """llama.cpp requires an ``output.weight`` even when the embeddings are tied (OLMoE): it is
    written as a copy of the token embeddings."""
    moe: bool = False
    """The MLP is a mixture of experts: expert counts in the metadata, expert weights stacked."""
    interleaved_experts: bool = False
    """gpt-oss' expert layout: one ``gate_up_proj [experts, in, 2 x width]`` with the gate and up
    columns alternating, a bias beside each projection, and MXFP4 blocks where the checkpoint ships
    them (written as GGML's MXFP4, not dequantized)."""
    renormalize: bool = False
    """How llama.cpp weighs a token's chosen experts in this architecture (a mixture of experts):
    their softmax probabilities renormalised to sum to one (transformers' ``norm_topk_prob: true``),
    or as they are."""


FAMILIES: dict[str, Family] = {
    "llama": Family("LLAMA", permute_qk=True, rope_types=("default", "linear", "llama3")),
    "mistral": Family("LLAMA", permute_qk=True, rope_types=("default", "linear")),
    "qwen2": Family("QWEN2", rope_types=("default", "yarn")),
    "qwen3": Family("QWEN3", rope_types=("default", "yarn")),
    "gemma2": Family("GEMMA2", norm_shift=1.0, softcapping=True, sliding_pattern=2, big_layers=46,
                     has_output=False),
    "gemma3_text": Family("GEMMA3", norm_shift=1.0, sliding_pattern=6, big_layers=62, rope_types=("default", "linear")),
    "phi3": Family("PHI3", partial_rotary=True, rope_types=("default", "longrope")),
    "qwen3_moe": Family("QWEN3MOE", rope_types=("default", "yarn"), moe=True, renormalize=True),
    # llama.cpp runs Mixtral as its llama architecture with experts
    "mixtral": Family("LLAMA", permute_qk=True, rope_types=("default", "linear"), moe=True, renormalize=True),
    "olmoe": Family("OLMOE", output_required=True, moe=True),
    # llama.cpp's period-2 sliding pattern (layer 0 slides) is gpt-oss' layer_types
    "gpt_oss": Family("GPT_OSS", sliding_pattern=2, rope_types=("default", "yarn"), output_required=True, moe=True,
                      renormalize=True, interleaved_experts=True),
}
FAMILIES["gemma3"] = FAMILIES["gemma3_text"]  # the multimodal wrapper: its text model is written

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MOE_FAMILIES = "Qwen3-MoE, Mixtral, OLMoE and gpt-oss"
"""The mixtures of experts the exporter writes, as a message names them."""


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: a multimodal wrapper's ``text_config`` (Gemma 3 4B+) under its own
    ``model_type``, anything else as it is."""
    inner = config.get("text_config")
    if isinstance(inner, dict):
        return {**inner, "model_type": config.get("model_type"),
                "tie_word_embeddings": config.get("tie_word_embeddings", inner.get("tie_word_embeddings", True))}
    return config


def family_of(config: dict[str, Any]) -> Family:
    """The :class:`Family` of a config.json; GgufExportError naming what is covered when none fits."""
    model_type = config.get("model_type", "?")
    family = FAMILIES.get(model_type)
    sparse = any(text_config(config).get(k) for k in _MOE_KEYS) or "moe" in str(model_type)
    if sparse and (family is None or not family.moe):
        raise GgufExportError(f"'{model_type}' is a mixture-of-experts model that Studio does not write as GGUF (it "
                              f"writes {MOE_FAMILIES}); export --format merged and convert that folder with "
                              "llama.cpp's convert_hf_to_gguf.py")
    if family is None:
        raise GgufExportError(
            f"GGUF export covers Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3, Phi-3/4 and the mixtures of experts "
            f"{MOE_FAMILIES} ({', '.join(sorted(FAMILIES))}); this model is '{model_type}'. Export it with "
            "--format merged and convert that folder with llama.cpp's convert_hf_to_gguf.py")
    return family


def expert_count(config: dict[str, Any]) -> int:
    """Experts in each sparse layer of a mixture of experts' (text) config."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def head_dim(config: dict[str, Any]) -> int:
    """Channels per attention head."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rope(config: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE parameters of ``layer_type``'s layers, from ``rope_parameters`` (transformers 5,
    per layer type for Gemma 3) or the older ``rope_theta`` / ``rope_scaling`` keys: a dict with
    ``rope_type`` and ``rope_theta`` at least."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = config.get("rope_scaling") or {}
    merged = {**scaling, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    theta = merged.get("rope_theta") or config.get("rope_theta") or 10000.0
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config and not params:
        theta = config["rope_local_base_freq"]
    return {**merged, "rope_type": "longrope" if kind == "su" else kind, "rope_theta": float(theta)}


def check(config: dict[str, Any]) -> Family:
    """The config's :class:`Family` after checking llama.cpp can represent it; every mismatch is
    named at once (GgufExportError)."""
    family = family_of(config)
    config = text_config(config)
    problems: list[str] = []
    main = rope(config)
    if main["rope_type"] not in family.rope_types:
        problems.append(f"its '{main['rope_type']}' RoPE scaling, which Studio writes for this family only as "
                        f"{' / '.join(family.rope_types)}")
    if config.get("use_sliding_window") and family.sliding_pattern == 0 and family.arch != "LLAMA":
        problems.append("use_sliding_window: true (llama.cpp has no sliding window for this family)")
    if family.sliding_pattern:
        problems += _sliding_problems(config, family)
    if family.arch.startswith("GEMMA"):
        problems += _gemma_problems(config, family)
    if family.moe:
        problems += _moe_problems(config, family)
    if family.arch == "GPT_OSS":
        problems += _gpt_oss_problems(config)
    if problems and family.arch == "GPT_OSS":
        # llama.cpp's converter would write the same file, and llama.cpp would run another model from it
        raise GgufExportError(f"gpt_oss: llama.cpp's gpt-oss cannot run this variant: {'; '.join(problems)}. "
                              "Export --format merged and serve that folder with transformers")
    if problems:
        raise GgufExportError(f"{config.get('model_type')}: llama.cpp cannot run this config as written: "
                              + "; ".join(problems) + ". Export --format merged and convert with llama.cpp's "
                              "convert_hf_to_gguf.py")
    return family


def _moe_problems(config: dict[str, Any], family: Family) -> list[str]:
    """Where a mixture of experts' config differs from what llama.cpp fixes for its architecture."""
    problems = []
    # transformers' norm_topk_prob defaults to false; Mixtral and gpt-oss have no such key and always
    # renormalise (gpt-oss: a softmax over the chosen experts' logits).
    renormalize = bool(config.get("norm_topk_prob", config.get("model_type") in ("mixtral", "gpt_oss")))
    if renormalize != family.renormalize:
        problems.append(f"norm_topk_prob: {str(renormalize).lower()} (llama.cpp's {family.arch.lower()} "
                        f"{'always' if family.renormalize else 'never'} renormalises the chosen experts' weights)")
    if family.arch == "QWEN3MOE" and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1):
        problems.append("dense MLP layers (mlp_only_layers / decoder_sparse_step; llama.cpp's qwen3moe has experts "
                        "in every layer)")
    if family.arch == "OLMOE":
        heads = config.get("num_attention_heads")
        if int(config.get("num_key_value_heads") or heads) != int(heads):
            problems.append(f"num_key_value_heads {config['num_key_value_heads']} (llama.cpp's olmoe norms keys "
                            f"over the hidden size: as many key/value heads as heads, {heads})")
        if config.get("clip_qkv"):
            problems.append(f"clip_qkv {config['clip_qkv']} (llama.cpp's olmoe does not clip)")
    return problems


def _sliding_problems(config: dict[str, Any], family: Family) -> list[str]:
    """Where a config's sliding-window layers differ from llama.cpp's fixed pattern for the family."""
    period = family.sliding_pattern
    expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                for i in range(int(config["num_hidden_layers"]))]
    nth = f"{period}{'nd' if period == 2 else 'th'}"
    problems = []
    if config.get("layer_types") and list(config["layer_types"]) != expected:
        problems.append(f"layer_types differ from llama.cpp's fixed pattern (every {nth} layer global, the others "
                        "sliding)")
    if not config.get("sliding_window"):
        problems.append(f"no sliding_window (llama.cpp's layers slide but every {nth})")
    return problems


def _gpt_oss_problems(config: dict[str, Any]) -> list[str]:
    """Where a gpt-oss config differs from what llama.cpp's gpt-oss fixes."""
    problems = []
    # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702 and limit 7.0 are constants there
    for key, fixed in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if float(config.get(key, fixed)) != fixed:
            problems.append(f"{key} {config[key]} (llama.cpp's is {fixed})")
    if config.get("attention_bias") is False:
        problems.append("attention_bias: false (llama.cpp's gpt-oss loads q/k/v/o biases)")
    return problems


def _gemma_problems(config: dict[str, Any], family: Family) -> list[str]:
    """Where a Gemma config differs from what llama.cpp assumes for its architecture."""
    problems = []
    layers = int(config["num_hidden_layers"])
    scale = config["hidden_size"] // config["num_attention_heads"] if layers == family.big_layers else head_dim(config)
    if float(config.get("query_pre_attn_scalar") or scale) != float(scale):
        problems.append(f"query_pre_attn_scalar {config['query_pre_attn_scalar']} (llama.cpp uses {scale} "
                        f"for {layers} layers)")
    if family.arch == "GEMMA3":
        local = rope(config, "sliding_attention")
        if local["rope_type"] != "default" or local["rope_theta"] != 10000.0:
            problems.append("sliding layers' RoPE other than base 10000 unscaled")
        if config.get("attn_logit_softcapping"):
            problems.append("attn_logit_softcapping (llama.cpp's Gemma 3 has none)")
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh", None):
        problems.append(f"activation {activation} (llama.cpp's Gemma uses tanh-approximated GELU)")
    return problems


def write_hparams(writer: Any, config: dict[str, Any], family: Family, n_vocab: int) -> None:
    """The ``<arch>.*`` keys llama.cpp reads for ``family`` (``config`` is the text model's)."""
    import gguf

    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(n_vocab)
    # gpt-oss: as llama.cpp's converter writes it, whatever the head size (its config always has head_dim)
    if config.get("head_dim") and int(config["head_dim"]) != hidden // heads or \
            family.arch.startswith("GEMMA") or family.arch == "GPT_OSS":
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    if family.moe:
        writer.add_expert_count(expert_count(config))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("moe_intermediate_size"):  # Qwen3-MoE: the experts' width apart from intermediate_size
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
        elif family.arch == "GPT_OSS":  # llama.cpp's gpt-oss reads the experts' width from this key alone
            writer.add_expert_feed_forward_length(int(config["intermediate_size"]))
    main = rope(config)
    writer.add_rope_freq_base(main["rope_theta"])
    if family.partial_rotary:
        factor = float(main.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        writer.add_rope_dimension_count(int(factor * hidden) // heads)
    elif family.arch == "LLAMA":
        writer.add_rope_dimension_count(head_dim(config))
    if family.softcapping:
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    elif family.arch == "GEMMA3" and config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
    if family.sliding_pattern:
        writer.add_sliding_window(int(config["sliding_window"]))
    elif family.arch == "PHI3":
        # As llama.cpp's converter writes it: 0 where the config has none (llama.cpp runs Phi-3 without it).
        writer.add_sliding_window(int(config.get("sliding_window") or 0))
        writer.add_rope_scaling_orig_ctx_len(int(config.get("original_max_position_embeddings")
                                                 or config["max_position_embeddings"]))
    kind = main["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(main["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(main["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(main.get("original_max_position_embeddings")
                                                 or config["max_position_embeddings"]))
        # As llama.cpp's converter: where the config sets them (its defaults are transformers', 32 and 1)
        if "beta_fast" in main:
            writer.add_rope_scaling_yarn_beta_fast(float(main["beta_fast"]))
        if "beta_slow" in main:
            writer.add_rope_scaling_yarn_beta_slow(float(main["beta_slow"]))
    elif kind == "longrope":
        original = int(main.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
                       or config["max_position_embeddings"])
        scale = int(config["max_position_embeddings"]) / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)


def rope_tensors(config: dict[str, Any], family: Family) -> dict[str, Any]:
    """Extra GGUF tensors the RoPE scaling needs, by GGUF name: Llama 3's per-frequency factors
    (``rope_freqs.weight``) and Phi-3's long and short factors (``rope_factors_long/short.weight``)."""
    import numpy as np

    main = rope(config)
    if main["rope_type"] == "llama3":
        dim = head_dim(config)
        freqs = 1.0 / (main["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        factor = float(main.get("factor", 8.0))
        low, high = float(main.get("low_freq_factor", 1.0)), float(main.get("high_freq_factor", 4.0))
        old = float(main.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / freqs
        smooth = (old / wavelen - low) / (high - low)
        # llama.cpp divides each frequency by its factor: 1 for short waves, `factor` for long ones,
        # and in between the inverse of transformers' interpolation.
        factors = np.where(wavelen < old / high, 1.0,
                           np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        return {"rope_freqs.weight": factors.astype(np.float32)}
    if main["rope_type"] == "longrope" and family.partial_rotary:
        return {"rope_factors_long.weight": np.asarray(main["long_factor"], dtype=np.float32),
                "rope_factors_short.weight": np.asarray(main["short_factor"], dtype=np.float32)}
    return {}
