"""The shape of a causal LM, read from its config.json without loading any weights.

The VRAM estimator needs only a handful of numbers (hidden size, layers, heads, vocabulary...).
They come from a local folder, from the Hugging Face cache, or, offline with an empty cache, from a
small table of well-known models.

Families modelled: Llama, Mistral, Qwen2, Qwen3, Gemma (1, 2, 3; Gemma 3's text_config nesting and
its SigLIP vision tower), Phi-3 (fused qkv_proj and gate_up_proj). Anything else (mixture of experts,
state-space layers, encoder-decoders, an unknown model_type) raises ModelInfoError naming what is
missing or not modelled: the estimator would otherwise draw a number for layers it does not know.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from studio.core.model_families import FAMILIES, REQUIRED_KEYS, SUPPORTED_TEXT, unsupported, vision_tower_params
from studio.core.model_ref import local_problem
from studio.core.plan import model_blocker


class ModelInfoError(ValueError):
    """The model's shape could not be found; the message says where Studio looked."""


@dataclass(frozen=True)
class ModelInfo:
    """A Llama-architecture decoder's dimensions (the ones memory depends on)."""

    name: str
    """Where the numbers came from: a hub id or a folder."""

    hidden: int
    """hidden_size: width of the residual stream."""

    intermediate: int
    """intermediate_size: width of the MLP's gate and up projections."""

    layers: int
    """num_hidden_layers."""

    heads: int
    """num_attention_heads."""

    kv_heads: int
    """num_key_value_heads (fewer than heads with grouped-query attention)."""

    vocab: int
    """vocab_size: width of the logits."""

    tied: bool
    """tie_word_embeddings: lm_head shares the embedding matrix."""

    max_positions: int = 2048
    """max_position_embeddings: the longest sequence the model was trained for."""

    head_dim: int | None = None
    """Width of one attention head when the config sets it; else hidden / heads."""

    init_std: float = 0.02
    """initializer_range: std of the random normal weights a freshly initialised model draws. The
    estimator uses it for the size of LLM.int8's outlier activations (see core/vram.py)."""

    fast_path_blocker: str = ""
    """Why Studio's GPU fast path does not cover this architecture ('' when it does):
    core/plan.py's model_blocker of the config.json."""

    model_type: str = "llama"
    """config.json's model_type (the text model's, for a model nested in text_config)."""

    fused: bool = False
    """Phi-3 style: q, k and v are one ``qkv_proj`` and gate and up one ``gate_up_proj``."""

    norms_per_layer: int = 2
    """RMSNorm weights in a decoder layer (Gemma 2 and 3 have four: pre/post attention and MLP)."""

    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3, Gemma 3): two more head-wide weights a layer."""

    bias_outputs: tuple[str, ...] = ()
    """Linear modules with a bias (Qwen2's q, k and v; ``attention_bias`` / ``mlp_bias`` configs)."""

    vision_params: int = 0
    """Parameters outside the decoder that load with it (Gemma 3's SigLIP vision tower and
    projector); frozen, counted with the embeddings."""

    @property
    def head_width(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear module in one decoder layer, by the module
        names PEFT targets (Phi-3's fused modules are one matrix each: that is what is quantized)."""
        h, i = self.hidden, self.intermediate
        q = self.heads * self.head_width
        kv = self.kv_heads * self.head_width
        if self.fused:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i),
                    "down_proj": (i, h)}
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_modules(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """Llama-style LoRA target names as this model's modules: on Phi-3, q/k/v_proj are
        ``qkv_proj`` and gate/up_proj ``gate_up_proj``; other names pass through."""
        if not self.fused:
            return tuple(targets)
        names = (FUSED_INTO.get(t, t) for t in targets)
        return tuple(dict.fromkeys(names))

    def lora_targets(self, targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """A config's ``lora.target_modules`` as this model's module names: ``all-linear`` is every
        linear module of a decoder layer (lm_head excluded, as PEFT reads it), and Llama names map
        onto Phi-3's fused modules (:meth:`lora_modules`). ``studio estimate`` and the VRAM pane
        both go through this."""
        if isinstance(targets, str):
            targets = (targets,)
        if tuple(targets) == ("all-linear",):
            return tuple(self.linear_shapes())
        return self.lora_modules(tuple(targets))

    def linear_params(self) -> int:
        """Parameters in all decoder layers' linear modules (what 4-bit / 8-bit quantize)."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    def embedding_params(self) -> int:
        """The input embedding matrix."""
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The output projection; 0 when tied to the embeddings."""
        return 0 if self.tied else self.vocab * self.hidden

    def norm_params(self) -> int:
        """The small 1-D parameters: RMSNorm weights (per layer and the final one), per-head q/k
        norms, and linear biases where the model has them."""
        per_layer = self.norms_per_layer * self.hidden + (2 * self.head_width if self.qk_norm else 0)
        shapes = self.linear_shapes()
        per_layer += sum(shapes[name][1] for name in self.bias_outputs if name in shapes)
        return self.layers * per_layer + self.hidden

    def total_params(self) -> int:
        """Every parameter of the model (a vision tower included)."""
        return (self.linear_params() + self.embedding_params() + self.head_params() + self.norm_params()
                + self.vision_params)


FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""Phi-3's fused modules, by the Llama names they hold."""


# Offline fallback, copied from each model's config.json on the hub.
KNOWN_MODELS: dict[str, ModelInfo] = {
    "HuggingFaceTB/SmolLM2-135M": ModelInfo("HuggingFaceTB/SmolLM2-135M", 576, 1536, 30, 9, 3, 49152,
                                            True, 8192),
    "HuggingFaceTB/SmolLM2-360M": ModelInfo("HuggingFaceTB/SmolLM2-360M", 960, 2560, 32, 15, 5, 49152,
                                            True, 8192),
    "HuggingFaceTB/SmolLM2-1.7B": ModelInfo("HuggingFaceTB/SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152,
                                            True, 8192),
    "meta-llama/Llama-2-7b-hf": ModelInfo("meta-llama/Llama-2-7b-hf", 4096, 11008, 32, 32, 32, 32000,
                                          False, 4096),
    "meta-llama/Llama-2-13b-hf": ModelInfo("meta-llama/Llama-2-13b-hf", 5120, 13824, 40, 40, 40, 32000,
                                           False, 4096),
    "mistralai/Mistral-7B-v0.1": ModelInfo("mistralai/Mistral-7B-v0.1", 4096, 14336, 32, 32, 8, 32000,
                                           False, 32768),
    "meta-llama/Meta-Llama-3-8B": ModelInfo("meta-llama/Meta-Llama-3-8B", 4096, 14336, 32, 32, 8, 128256,
                                            False, 8192),
}


def _known(ref: str) -> ModelInfo | None:
    """A table entry for ``ref``: exact id, or the same model's -Instruct / -chat variant."""
    key = ref.lower().rstrip("/")
    for name, info in KNOWN_MODELS.items():
        base = name.lower()
        short = base.split("/")[-1]
        for variant in (base, short):
            if key == variant or key in (variant + "-instruct", variant.replace("-hf", "-chat-hf")):
                return replace(info, name=ref)
    return None


def from_config_dict(data: dict, name: str) -> ModelInfo:
    """A ModelInfo from a parsed config.json; raises ModelInfoError naming the missing keys or the
    feature Studio does not model (see core/model_families.py)."""
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    model_type = str(text.get("model_type") or data.get("model_type") or "llama")
    why = unsupported(data, text, model_type)
    if why:
        raise ModelInfoError(f"{name}: {why}")
    family = FAMILIES[model_type]
    values = {**family.defaults, **{k: v for k, v in text.items() if v is not None}}
    missing = [key for key in REQUIRED_KEYS if key not in values]
    if missing:
        raise ModelInfoError(f"{name}: config.json has no {', '.join(missing)}; is this a causal LM? "
                             f"Studio models {SUPPORTED_TEXT} decoders")
    heads = int(values["num_attention_heads"])
    tied = data.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    head_dim = values.get("head_dim")
    biases = family.bias_outputs
    if values.get("attention_bias"):
        biases += ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
    if values.get("mlp_bias"):
        biases += ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
    return ModelInfo(
        name=name,
        hidden=int(values["hidden_size"]),
        intermediate=int(values["intermediate_size"]),
        layers=int(values["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(values.get("num_key_value_heads") or heads),
        vocab=int(values["vocab_size"]),
        tied=family.tied if tied is None else bool(tied),
        max_positions=int(values.get("max_position_embeddings") or 2048),
        head_dim=int(head_dim) if head_dim else None,
        init_std=float(values.get("initializer_range") or data.get("initializer_range") or 0.02),
        fast_path_blocker=model_blocker(data),
        model_type=model_type,
        fused=family.fused,
        norms_per_layer=family.norms_per_layer,
        qk_norm=family.qk_norm or bool(text.get("use_qk_norm")),
        bias_outputs=tuple(dict.fromkeys(biases)),
        vision_params=vision_tower_params(data, int(values["hidden_size"])),
    )


def _hub_cache_config(ref: str, revision: str | None) -> Path | None:
    """config.json of ``ref`` in the Hugging Face cache, if it was downloaded before."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    root = Path(hub) if hub else Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    repo = root / ("models--" + ref.replace("/", "--"))
    if not repo.is_dir():
        return None
    snapshots = repo / "snapshots"
    ref_file = repo / "refs" / (revision or "main")
    if ref_file.is_file():
        candidate = snapshots / ref_file.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def load_model_info(ref: str, revision: str | None = None) -> ModelInfo:
    """The shape of model ``ref``: a local folder, the HF cache, or the offline table, in that order."""
    problem = local_problem(ref)
    if problem:
        raise ModelInfoError(problem)
    folder = Path(ref).expanduser()
    path = folder / "config.json" if folder.is_dir() else _hub_cache_config(ref, revision)
    if path is not None:
        if not path.is_file():
            raise ModelInfoError(f"{folder}: no config.json in this folder; point model.base_model at a "
                                 "folder saved by save_pretrained, or at a hub id")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelInfoError(f"{path}: cannot read it as JSON ({exc})") from None
        return from_config_dict(data, ref)
    known = _known(ref)
    if known is not None:
        return known
    raise ModelInfoError(f"{ref}: not a local folder, not in the Hugging Face cache and not a model Studio "
                         "knows offline; download it once (hf download " + ref + " config.json) or pass a folder "
                         "with its config.json")
