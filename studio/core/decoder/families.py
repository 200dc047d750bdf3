"""Every family Studio describes, one entry per model_type, and :func:`describe_decoder`.

An entry is its config class's defaults (transformers' models/<family>/configuration_<family>.py,
the same in 5.17 and 5.24; where the two read a key differently, :func:`reads_gelu_as_tanh` says
which is installed) and a small function saying how the family's layer differs from Llama's
(models/<family>/modeling_<family>.py), over the shared reading of core/decoder/values.py. Adding a
family is one entry and its tests (tests/core/test_decoder.py).

Plain Python: the UI imports this.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from studio.core.decoder.refusals import Refusal, refusal
from studio.core.decoder.spec import (
    PHI3_FUSED,
    POST_NORM,
    PRE_NORM,
    SANDWICH,
    DecoderSpec,
    LayerSpec,
    MoeSpec,
    NormSpec,
)
from studio.core.decoder.values import Values, layer_type_tables, rope_table, typed_layers, uniform_layers


def _base(v: Values, **fields: object) -> DecoderSpec:
    """A Llama layer read off ``v`` (modeling_llama.py), with ``fields`` where the family differs."""
    head_dim = v.head_dim()
    spec: dict[str, object] = dict(
        model_type=v.model_type, family=v.family, config_path=v.config_path, decoder_path=("model",),
        hidden=v.int("hidden_size"), intermediate=v.int("intermediate_size"), heads=v.int("num_attention_heads"),
        kv_heads=v.kv_heads(), head_dim=head_dim, vocab=v.int("vocab_size"),
        max_positions=v.int("max_position_embeddings"), tied=v.flag("tie_word_embeddings"),
        norm=NormSpec(0.0, "normed", v.float("rms_norm_eps")), norms=PRE_NORM, qk_norm="none", biases=(),
        activation=str(v.get("hidden_act")), fused=(), embed_scale=1.0, embed_scale_rounded=False,
        attention_scale=head_dim ** -0.5, attn_softcap=None, final_softcap=None, residual_scale=1.0,
        logits_divisor=1.0, layers=uniform_layers(v, rope_table(v, head_dim)))
    spec.update(fields)
    return DecoderSpec(**spec)  # type: ignore[arg-type]


def _window(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _llama(v: Values) -> DecoderSpec:
    return _base(v, biases=v.biases())


def _mistral(v: Values) -> DecoderSpec:
    # every layer attends within sliding_window (null: no window); Mistral ignores layer_types
    return _base(v, layers=uniform_layers(v, rope_table(v, v.head_dim()), _window(v.get("sliding_window"))))


def _qwen_layers(v: Values) -> tuple[LayerSpec, ...]:
    # __post_init__: the window only with use_sliding_window, on the layers from max_window_layers on
    window = _window(v.get("sliding_window")) if v.flag("use_sliding_window") else None
    first = v.int("max_window_layers")
    types = v.layer_types(lambda i: "sliding_attention" if window is not None and i >= first else "full_attention")
    rope = rope_table(v, v.head_dim())
    return typed_layers(types, window, lambda i, t: rope)


def _qwen2(v: Values) -> DecoderSpec:
    # q, k and v always carry a bias and o never does, whatever attention_bias says
    return _base(v, biases=("q_proj", "k_proj", "v_proj"), layers=_qwen_layers(v))


def _qwen3(v: Values) -> DecoderSpec:
    return _base(v, biases=v.biases(mlp=()), qk_norm="head", layers=_qwen_layers(v))


def _gemma_fields(v: Values) -> dict[str, object]:
    """Gemma 1-3 alike: ``x * (1 + w)`` in fp32 then the cast, embeddings times sqrt(hidden) rounded
    to the embedding's dtype, biases only from attention_bias, tied by default."""
    return dict(norm=NormSpec(1.0, "scaled", v.float("rms_norm_eps")), embed_scale=v.int("hidden_size") ** 0.5,
                embed_scale_rounded=True, biases=v.biases(mlp=()))


def _bidirectional(v: Values) -> Refusal | None:
    if v.flag("use_bidirectional_attention"):
        return Refusal(v.model_type, "use_bidirectional_attention is set: an embedding model, not a causal LM")
    return None


def reads_gelu_as_tanh() -> bool:
    """Whether the installed transformers' GemmaConfig reads the first releases' ``hidden_act:
    "gelu"`` as the tanh approximation, as it does from 5.18 on; 5.17 (the GPU box's) runs exact
    GELU for it. Read from the package's metadata, without importing it; without transformers (a
    machine that only sizes models), the newer reading."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return True
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is None or (int(found[1]), int(found[2])) >= (5, 18)


def _gemma(v: Values) -> DecoderSpec | Refusal:
    act = str(v.get("hidden_act"))
    if act == "gelu" and reads_gelu_as_tanh():
        act = "gelu_pytorch_tanh"
    return _bidirectional(v) or _base(v, activation=act, **_gemma_fields(v))


def _gemma2(v: Values) -> DecoderSpec | Refusal:
    rope = rope_table(v, v.head_dim())
    types = v.layer_types(lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    return _bidirectional(v) or _base(
        v, activation=str(v.get("hidden_activation")), norms=SANDWICH,
        attention_scale=v.float("query_pre_attn_scalar") ** -0.5,
        attn_softcap=v.optional_float("attn_logit_softcapping"),
        final_softcap=v.optional_float("final_logit_softcapping"),
        layers=typed_layers(types, _window(v.get("sliding_window")), lambda i, t: rope), **_gemma_fields(v))


def _gemma3_text(v: Values) -> DecoderSpec | Refusal:
    tables = layer_type_tables(v, v.head_dim(), "full_attention", "rope_local_base_freq")
    pattern = int(v.get("sliding_window_pattern"))  # type: ignore[call-overload]
    types = v.layer_types(lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    # Gemma3Attention keeps attn_logit_softcapping but passes no softcap to the attention: not applied
    return _bidirectional(v) or _base(
        v, activation=str(v.get("hidden_activation")), norms=SANDWICH, qk_norm="head",
        attention_scale=v.float("query_pre_attn_scalar") ** -0.5,
        final_softcap=v.optional_float("final_logit_softcapping"),
        layers=typed_layers(types, _window(v.get("sliding_window")), lambda i, t: tables[t], rope_key=True),
        **_gemma_fields(v))


def _gemma3(v: Values) -> DecoderSpec | Refusal:
    """A multimodal checkpoint: AutoModelForCausalLM loads Gemma3ForConditionalGeneration, whose
    text decoder sits at model.language_model, whose lm_head ties by the outer config, and whose
    forward applies no final soft-cap."""
    text = _gemma3_text(v)
    if isinstance(text, Refusal):
        return text
    outer_tied = v.config.get("tie_word_embeddings")
    return replace(text, decoder_path=("model", "language_model"), final_softcap=None,
                    tied=True if outer_tied is None else bool(outer_tied),
                    extra_params=vision_tower_params(v.config, text.hidden))


def _phi3(v: Values) -> DecoderSpec:
    # sliding_window on every layer when set; only partial_rotary_factor of each head rotates
    rope = rope_table(v, v.head_dim(), partial=True, renames={"su": "longrope", "yarn": "longrope"})
    return _base(v, fused=PHI3_FUSED, layers=uniform_layers(v, rope, _window(v.get("sliding_window"))))


def _olmo2(v: Values) -> DecoderSpec:
    # (w * x_normed_fp32).to(dtype); q_norm / k_norm over the whole projection, before the reshape
    return _base(v, norm=NormSpec(0.0, "scaled", v.float("rms_norm_eps")), norms=POST_NORM,
                 qk_norm="projection", biases=v.biases(mlp=()))


def _smollm3(v: Values) -> DecoderSpec:
    n, interval = v.int("num_hidden_layers"), v.int("no_rope_layer_interval")
    given = v.get("no_rope_layers")
    uses = list(given) if isinstance(given, list) else [int((i + 1) % interval != 0) for i in range(n)]
    sliding = v.flag("use_sliding_window") and v.get("sliding_window") is not None
    types = v.layer_types(lambda i: "sliding_attention" if sliding and not uses[i] else "full_attention")
    rope = rope_table(v, v.head_dim())
    return _base(v, biases=v.biases(), layers=typed_layers(types, _window(v.get("sliding_window")) if sliding else None,
                                                             lambda i, t: rope if uses[i] else None))


def _granite(v: Values) -> DecoderSpec:
    return _base(v, biases=v.biases(), embed_scale=v.float("embedding_multiplier"),
                 attention_scale=v.float("attention_multiplier"), residual_scale=v.float("residual_multiplier"),
                 logits_divisor=v.float("logits_scaling"))


def _moe(v: Values, experts_key: str, intermediate_key: str, renormalize: bool) -> MoeSpec:
    """The sparse MLP of an MoE family's config (its router: softmax over every expert, the top k,
    renormalised where ``renormalize``)."""
    return MoeSpec(experts=v.int(experts_key), top_k=v.int("num_experts_per_tok"), intermediate=v.int(intermediate_key),
                   renormalize=renormalize, aux_loss_coef=v.float("router_aux_loss_coef"),
                   aux_loss_on=v.flag("output_router_logits"))


def _sparse(layers: tuple[LayerSpec, ...], which) -> tuple[LayerSpec, ...]:
    return tuple(replace(layer, sparse=bool(which(i))) for i, layer in enumerate(layers))


def _experts_key(v: Values) -> str:
    # Qwen3MoeConfig maps num_experts onto num_local_experts (OLMoE the other way round): the Hub's
    # config.json spells num_experts, transformers 5.x's to_dict() Qwen3-MoE's num_local_experts
    return "num_local_experts" if "num_local_experts" in v.text else "num_experts"


def _qwen3_moe(v: Values) -> DecoderSpec:
    # every layer attends within sliding_window when use_sliding_window (no max_window_layers here);
    # layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step
    window = _window(v.get("sliding_window")) if v.flag("use_sliding_window") else None
    moe = _moe(v, _experts_key(v), "moe_intermediate_size", v.flag("norm_topk_prob"))
    dense = set(v.get("mlp_only_layers") or ())  # type: ignore[call-overload]
    step = v.int("decoder_sparse_step")
    layers = _sparse(uniform_layers(v, rope_table(v, v.head_dim()), window),
                     lambda i: moe.experts > 0 and i not in dense and (i + 1) % step == 0)
    return _base(v, biases=v.biases(mlp=()), qk_norm="head", layers=layers, moe=moe)


def _olmoe(v: Values) -> DecoderSpec:
    # OLMo's q/k norms over the whole projection on a pre-norm layer; every MLP sparse
    moe = _moe(v, _experts_key(v), "intermediate_size", v.flag("norm_topk_prob"))
    return _base(v, qk_norm="projection", biases=v.biases(mlp=()), moe=moe,
                 layers=_sparse(uniform_layers(v, rope_table(v, v.head_dim())), lambda i: True),
                 qkv_clip=v.optional_float("clip_qkv"))


def _mixtral(v: Values) -> DecoderSpec:
    # the top k of the router's logits, softmaxed among themselves: renormalised top-k probabilities
    moe = _moe(v, "num_local_experts", "intermediate_size", True)
    layers = uniform_layers(v, rope_table(v, v.head_dim()), _window(v.get("sliding_window")))
    return _base(v, layers=_sparse(layers, lambda i: True), moe=moe,
                 router_jitter=v.float("router_jitter_noise"))


def _gpt_oss(v: Values) -> DecoderSpec:
    # sliding and full attention alternating (sliding first), YaRN by default; q/k/v/o biases from
    # attention_bias; a sink per head; every MLP sparse: the router (mlp.router) with a bias takes the
    # top k of its logits then their softmax, and the experts (biased, gate/up interleaved) run the
    # clamped SwiGLU; RMSNorm as OLMo 2's, (w * x_fp32).to(dtype)
    head_dim = v.head_dim()
    types = v.layer_types(lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    rope = rope_table(v, head_dim)
    layers = typed_layers(types, _window(v.get("sliding_window")), lambda i, t: rope)
    moe = replace(_moe(v, "num_local_experts", "intermediate_size", True), router="router", routing="topk_softmax",
                  router_bias=True, expert_bias=True, activation="clamped_swiglu", interleaved=True,
                  swiglu_alpha=v.float("swiglu_alpha"), swiglu_limit=v.float("swiglu_limit"))
    return _base(v, norm=NormSpec(0.0, "scaled", v.float("rms_norm_eps")), biases=v.biases(mlp=()),
                 layers=_sparse(layers, lambda i: True), moe=moe, sinks=True)


def vision_tower_params(config: Mapping, text_hidden: int) -> int:
    """Parameters of Gemma 3's SigLIP vision tower and its projector into the text model (0 without
    a vision_config), with SiglipVisionConfig's defaults: per layer q/k/v/o and a two-matrix MLP with
    biases and two LayerNorms; patch and position embeddings; the final LayerNorm; the attention
    pooling head where ``vision_use_head``; the projector's matrix and RMSNorm."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    h = int(vision.get("hidden_size", 768))
    i = int(vision.get("intermediate_size", 3072))
    layers = int(vision.get("num_hidden_layers", 12))
    patch = int(vision.get("patch_size", 16))
    image = int(vision.get("image_size", 224))
    channels = int(vision.get("num_channels", 3))
    mlp = (h * i + i) + (i * h + h)
    layer = 4 * (h * h + h) + mlp + 2 * 2 * h
    embeddings = channels * patch * patch * h + h + (image // patch) ** 2 * h
    # probe, nn.MultiheadAttention (in and out projections with biases), LayerNorm, MLP
    head = h + 4 * (h * h + h) + 2 * h + mlp if vision.get("vision_use_head", True) else 0
    return layers * layer + embeddings + 2 * h + head + h * text_hidden + h


_ROPE = {"rope_theta": 10_000.0}
_COMMON = {"initializer_range": 0.02, "hidden_act": "silu", **_ROPE}
LLAMA = {**_COMMON, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
MISTRAL = {**_COMMON, "num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096}
QWEN2 = {**_COMMON, "num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
QWEN3 = {**QWEN2, "head_dim": 128, "attention_bias": False}
GEMMA = {**_COMMON, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
         "use_bidirectional_attention": None}
GEMMA2 = {**_COMMON, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
          "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
          "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None}
GEMMA3_TEXT = {**GEMMA2, "vocab_size": 262_208, "num_attention_heads": 8, "max_position_embeddings": 131_072,
               "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
               "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
PHI3 = {**_COMMON, "num_key_value_heads": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "sliding_window": None, "partial_rotary_factor": 1.0}
OLMO2 = {**_COMMON, "num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "attention_bias": False}
SMOLLM3 = {**_COMMON, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "use_sliding_window": False, "sliding_window": None, "no_rope_layers": None, "no_rope_layer_interval": 4,
           "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "rope_theta": 2_000_000.0}
_MOE = {"output_router_logits": False, "norm_topk_prob": False}
QWEN3_MOE = {**QWEN2, **_MOE, "attention_bias": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
             "num_experts_per_tok": 8, "num_experts": 128, "router_aux_loss_coef": 0.001, "mlp_only_layers": None,
             "num_key_value_heads": 4}
OLMOE = {**OLMO2, **_MOE, "max_position_embeddings": 4096, "clip_qkv": None, "num_experts_per_tok": 8,
         "num_experts": 64, "router_aux_loss_coef": 0.01}
MIXTRAL = {**MISTRAL, "output_router_logits": False, "sliding_window": None, "num_experts_per_tok": 2,
           "num_local_experts": 8, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}
GPT_OSS = {**_COMMON, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131_072,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True, "sliding_window": 128,
           "rope_theta": 150_000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "truncate": False,
                                                    "original_max_position_embeddings": 4096},
           "num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001,
           "output_router_logits": False, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
GRANITE = {**LLAMA, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
           "attention_multiplier": 1.0}


@dataclass(frozen=True)
class Family:
    """One model_type's entry: its config class's defaults and how its layer differs from Llama's."""

    label: str
    """What a person calls it."""

    defaults: Mapping[str, object]
    """The config class's defaults for the keys the description reads (not the sizes of
    values.REQUIRED_KEYS, which Studio does not guess, unless listed in ``implied``)."""

    describe: Callable[[Values], DecoderSpec | Refusal]
    """The family's layer, read off its Values."""

    text_config: bool = False
    """The decoder's keys are config.json's ``text_config`` (a multimodal checkpoint)."""

    implied: tuple[str, ...] = ()
    """Required sizes this family's checkpoints leave to the class's defaults (Gemma 3's text_config
    omits its heads and vocabulary)."""


_GEMMA3_IMPLIED = ("num_attention_heads", "vocab_size")

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", LLAMA, _llama),
    "mistral": Family("Mistral", MISTRAL, _mistral),
    "qwen2": Family("Qwen2", QWEN2, _qwen2),
    "qwen3": Family("Qwen3", QWEN3, _qwen3),
    "gemma": Family("Gemma", GEMMA, _gemma),
    "gemma2": Family("Gemma 2", GEMMA2, _gemma2),
    "gemma3_text": Family("Gemma 3", GEMMA3_TEXT, _gemma3_text, implied=_GEMMA3_IMPLIED),
    "gemma3": Family("Gemma 3", GEMMA3_TEXT, _gemma3, text_config=True, implied=_GEMMA3_IMPLIED),
    "phi3": Family("Phi-3", PHI3, _phi3),
    "olmo2": Family("OLMo 2", OLMO2, _olmo2),
    "smollm3": Family("SmolLM3", SMOLLM3, _smollm3),
    "granite": Family("Granite", GRANITE, _granite),
    "qwen3_moe": Family("Qwen3-MoE", QWEN3_MOE, _qwen3_moe),
    "olmoe": Family("OLMoE", OLMOE, _olmoe),
    "mixtral": Family("Mixtral", MIXTRAL, _mixtral),
    "gpt_oss": Family("gpt-oss", GPT_OSS, _gpt_oss),
}
"""model_type -> its entry (a config.json that names no model_type is sized as Llama's)."""

SUPPORTED = ", ".join(dict.fromkeys(f.label for f in FAMILIES.values())) + " decoders"
"""The families described, for messages."""


def describe_decoder(config: Mapping) -> DecoderSpec | Refusal:
    """The decoder a config.json (or a loaded model's ``config.to_dict()``) describes, or why
    Studio does not describe it: mixture-of-experts, state-space and encoder-decoder models, an
    unknown model_type, or a config without the sizes Studio will not guess."""
    nested = config.get("text_config")
    nested = nested if isinstance(nested, Mapping) else None
    named = str(config.get("model_type") or (nested or {}).get("model_type") or "")
    refused = refusal(config, nested or config, named or "llama", FAMILIES, SUPPORTED)
    if refused is not None:
        return refused
    family = FAMILIES[named or "llama"]
    text = (nested or {}) if family.text_config else config
    values = Values(config, text, family.defaults, named, family.label, ("text_config",) if family.text_config else ())
    missing = values.missing(family.implied)
    if missing:
        return Refusal(named, f"config.json has no {', '.join(missing)}; is this a causal LM? Studio "
                              f"describes {SUPPORTED}")
    return family.describe(values)
