"""The decoder families Studio's memory model covers, and why a config.json outside them is refused.

Each family differs from Llama only in things the parameter count and the estimator see: tied
embeddings by default (Gemma), explicit head widths (Gemma, Qwen3), extra norms (Gemma 2 and 3),
per-head q/k norms (Qwen3, Gemma 3), q/k/v biases (Qwen2), fused projections (Phi-3). Values a
config.json may leave out take the default of the transformers config class for its model_type,
as transformers itself would (Gemma 3 checkpoints' text_config omits its heads and vocabulary).

A model Studio cannot model gets a reason naming what is missing or not modelled: never a number
computed as if it were a Llama.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""A Llama-style decoder layer's attention projections, by the module names PEFT targets."""

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""Its gated MLP's projections."""

PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
"""All seven linear modules of the layer: what PEFT's ``all-linear`` means for a Llama-style model
(lm_head excluded), and what the fast path fuses LoRA products for."""


@dataclass(frozen=True)
class Family:
    """How one model_type's decoder differs from Llama's, for counting parameters."""

    label: str
    """What a person calls it."""

    tied: bool = False
    """tie_word_embeddings when config.json does not say (the config class's default)."""

    fused: bool = False
    """q/k/v and gate/up are single modules (Phi-3)."""

    norms_per_layer: int = 2
    """RMSNorm weights a decoder layer holds."""

    qk_norm: bool = False
    """Per-head q and k RMSNorms."""

    bias_outputs: tuple[str, ...] = ()
    """Linear modules that always have a bias."""

    defaults: Mapping[str, object] = field(default_factory=dict)
    """config.json keys the transformers config class fills in when they are absent."""


_GEMMA3 = Family("Gemma 3", tied=True, norms_per_layer=4, qk_norm=True,
                 defaults={"vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4,
                           "head_dim": 256, "max_position_embeddings": 131_072})

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2", bias_outputs=("q_proj", "k_proj", "v_proj")),
    "qwen3": Family("Qwen3", qk_norm=True, defaults={"head_dim": 128}),
    "gemma": Family("Gemma", tied=True, defaults={"head_dim": 256}),
    "gemma2": Family("Gemma 2", tied=True, norms_per_layer=4, defaults={"head_dim": 256}),
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "phi3": Family("Phi-3", fused=True),
}
"""model_type -> family (a config.json without a model_type is read as Llama's)."""

SUPPORTED_TEXT = "Llama-, Mistral-, Qwen2/3-, Gemma 1-3- and Phi-3-style"

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""What the memory model cannot do without."""

ENCODER_DECODER = {"t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "marian", "whisper", "led",
                   "blenderbot", "prophetnet", "switch_transformers", "encoder-decoder", "seamless_m4t"}
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "recurrent_gemma",
               "bamba", "falcon_h1", "nemotron_h", "lfm2", "xlstm", "qwen3_next", "granitemoehybrid"}
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
STATE_KEYS = ("ssm_cfg", "state_size", "mamba_d_state", "ssm_state_size", "linear_num_value_heads")


def unsupported(config: Mapping, text: Mapping, model_type: str) -> str:
    """Why Studio cannot model this config.json ('' when it can): the feature it lacks, by name."""
    if config.get("is_encoder_decoder") or model_type in ENCODER_DECODER:
        return (f"an encoder-decoder model (model_type {model_type!r}); Studio models decoder-only causal "
                f"LMs ({SUPPORTED_TEXT})")
    state = next((k for k in STATE_KEYS if text.get(k)), None)
    if model_type in STATE_SPACE or state:
        what = f"{state}: {text[state]}" if state else f"model_type {model_type!r}"
        return f"state-space / recurrent layers ({what}) are not in Studio's memory model"
    experts = next((k for k in EXPERT_KEYS if text.get(k)), None)
    if experts or "moe" in model_type or model_type in ("mixtral", "dbrx", "deepseek_v2", "deepseek_v3"):
        what = f"{experts}: {text[experts]}" if experts else f"model_type {model_type!r}"
        return f"mixture-of-experts layers ({what}) are not in Studio's memory model"
    if model_type not in FAMILIES:
        return (f"model_type {model_type!r} is not one Studio can model (its layers may not be Llama's); "
                f"it models {SUPPORTED_TEXT} decoders")
    return ""


def vision_tower_params(config: Mapping, text_hidden: int) -> int:
    """Parameters of Gemma 3's SigLIP vision tower and its projector into the text model (0 without a
    vision_config): per layer q/k/v/o and a two-matrix MLP with biases and two LayerNorms; patch and
    position embeddings; the final LayerNorm; the projector and its RMSNorm."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    h = int(vision.get("hidden_size", 1152))
    i = int(vision.get("intermediate_size", 4304))
    layers = int(vision.get("num_hidden_layers", 27))
    patch = int(vision.get("patch_size", 14))
    image = int(vision.get("image_size", 896))
    channels = int(vision.get("num_channels", 3))
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    embeddings = channels * patch * patch * h + h + (image // patch) ** 2 * h
    return layers * layer + embeddings + 2 * h + h * text_hidden + h
