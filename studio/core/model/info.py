"""The shape of a causal LM, read from its config.json without loading any weights.

The VRAM estimator needs only a handful of numbers (hidden size, layers, heads, vocabulary, the
norms and biases a layer holds...), read off the decoder's description (core/decoder/). They come
from a local folder, from the Hugging Face cache, or, offline with an empty cache, from the
config.json files Studio bundles (sample_data/model_configs/) and a small table of well-known shapes.

Families described: Llama, Mistral, Qwen2, Qwen3, Gemma 1-3 (Gemma 3's text_config nesting and its
SigLIP vision tower), Phi-3 (fused qkv_proj and gate_up_proj), OLMo 2, SmolLM3, Granite, and the
mixtures of experts Qwen3-MoE, OLMoE, Mixtral and gpt-oss. Anything else (other mixtures of experts,
state-space layers, encoder-decoders, an unknown model_type) raises
ModelInfoError naming what is missing or not described: the estimator would otherwise draw a number
for layers it does not know.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from studio.core.decoder import DecoderSpec, Refusal, describe_decoder
from studio.core.decoder.spec import ATTENTION_PROJECTIONS, PHI3_FUSED, MoeSpec, linear_shapes, lora_modules
from studio.core.model.ref import local_problem
from studio.core.paths import sample_data_dir
from studio.core.plan import decoder_blocker, sparse_mlp

ATTENTION_MODULES = (*ATTENTION_PROJECTIONS, "qkv_proj")
"""A layer's attention projections, fused or not: a sparse layer's only linear modules."""


class ModelInfoError(ValueError):
    """The model's shape could not be found; the message says where Studio looked."""


@dataclass(frozen=True)
class ModelInfo:
    """A decoder's dimensions and the parts of its layer that memory depends on."""

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
    estimator uses it for the size of LLM.int8's outlier activations (see core/memory/plain.py)."""

    fast_path_blocker: str = ""
    """Why Studio's GPU fast path does not cover this architecture ('' when it does):
    core/plan.py's model_blocker of the config.json."""

    model_type: str = "llama"
    """config.json's model_type (the text model's, for a model nested in text_config)."""

    fused: bool = False
    """Phi-3 style: q, k and v are one ``qkv_proj`` and gate and up one ``gate_up_proj``."""

    norms_per_layer: int = 2
    """RMSNorm weights in a decoder layer (Gemma 2 and 3 have four: pre/post attention and MLP)."""

    qk_norm: str = ""
    """Norms on q and k: ``head`` (Qwen3, Gemma 3: two head-wide weights a layer), ``projection``
    (OLMo 2: as wide as q_proj's and k_proj's outputs), or '' (none)."""

    bias_outputs: tuple[str, ...] = ()
    """Linear modules with a bias (Qwen2's q, k and v; ``attention_bias`` / ``mlp_bias`` configs)."""

    vision_params: int = 0
    """Parameters outside the decoder that load with it (Gemma 3's SigLIP vision tower and
    projector); frozen, counted with the embeddings."""

    sparse_layers: int = 0
    """Layers whose MLP is a mixture of experts (Qwen3-MoE, OLMoE, Mixtral); their linear modules
    are the attention's only."""

    experts: int = 0
    """Experts in each sparse layer."""

    expert_intermediate: int = 0
    """Width of one expert's gate and up outputs."""

    top_k: int = 0
    """Experts each token goes through in a sparse layer."""

    moe: MoeSpec | None = None
    """The sparse MLP's whole description (None: a dense model): the path decision reads its
    router's load-balancing loss (core/plan.py's ``moe_facts``)."""

    sinks: bool = False
    """Each attention head has a sink logit (gpt-oss): one parameter a head and layer."""

    softcapped: bool = False
    """Attention scores are soft-capped (Gemma 2's ``attn_logit_softcapping``): like sinks, no flash
    kernel takes them, and the fast path computes them in attention of its own."""

    activation: str = "silu"
    """The dense MLP's gated activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU: Gemma)."""

    expert_format: str = ""
    """How the checkpoint ships its expert weights when not in a float dtype: ``mxfp4`` (gpt-oss,
    ``quantization_config.quant_method``), kept so by a 4-bit load (engine/mxfp4.py); '' otherwise."""

    @property
    def head_width(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear module in one decoder layer, by the module
        names PEFT targets (Phi-3's fused modules are one matrix each: that is what is quantized)."""
        return linear_shapes(self.hidden, self.intermediate, self.heads * self.head_width,
                             self.kv_heads * self.head_width, PHI3_FUSED if self.fused else ())

    def lora_modules(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """Llama-style LoRA target names as this model's modules: on Phi-3, q/k/v_proj are
        ``qkv_proj`` and gate/up_proj ``gate_up_proj``; other names pass through."""
        return lora_modules(tuple(targets), PHI3_FUSED if self.fused else ())

    def lora_targets(self, targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """A config's ``lora.target_modules`` as this model's module names: ``all-linear`` is every
        linear module of a decoder layer (lm_head excluded, as PEFT reads it), and Llama names map
        onto Phi-3's fused modules (:meth:`lora_modules`). ``studio estimate`` and the VRAM pane
        both go through this."""
        if self.sparse_layers == self.layers and (targets == "all-linear" or list(targets) == ["all-linear"]):
            return ATTENTION_PROJECTIONS  # every MLP sparse: the attention's are the only linear modules
        return lora_modules(targets, PHI3_FUSED if self.fused else ())

    def qk_norm_params(self) -> int:
        """The q and k norms' weights of one layer (0 without them)."""
        if self.qk_norm == "head":
            return 2 * self.head_width
        if self.qk_norm == "projection":
            return (self.heads + self.kv_heads) * self.head_width
        return 0

    def layers_with(self, module: str) -> int:
        """Layers holding linear module ``module``: every layer for the attention's, the dense ones
        for the MLP's."""
        return self.layers if module in ATTENTION_MODULES else self.layers - self.sparse_layers

    def linear_params(self) -> int:
        """Parameters in all decoder layers' linear modules (what 4-bit / 8-bit quantize): every
        module of a dense layer, the attention's of a sparse one."""
        return sum(self.layers_with(name) * a * b for name, (a, b) in self.linear_shapes().items())

    def expert_weight_params(self) -> int:
        """Parameters of every sparse layer's expert weights (the 3-D tensors that bitsandbytes'
        loading leaves in the compute dtype), their biases left out."""
        return self.sparse_layers * self.experts * 3 * self.hidden * self.expert_intermediate

    def expert_params(self) -> int:
        """Parameters of every sparse layer's experts: their weights and, where they have them
        (gpt-oss), their biases."""
        biases = self.moe.expert_bias_params(self.hidden) if self.moe is not None else 0
        return self.expert_weight_params() + self.sparse_layers * biases

    def router_params(self) -> int:
        """Parameters of every sparse layer's router, its bias included (frozen, in the compute dtype)."""
        if self.moe is not None:
            return self.sparse_layers * self.moe.router_params(self.hidden)
        return self.sparse_layers * self.experts * self.hidden

    def embedding_params(self) -> int:
        """The input embedding matrix."""
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The output projection; 0 when tied to the embeddings."""
        return 0 if self.tied else self.vocab * self.hidden

    def norm_params(self) -> int:
        """The small 1-D parameters: RMSNorm weights (per layer and the final one), per-head q/k
        norms, linear biases and attention sinks where the model has them."""
        per_layer = self.norms_per_layer * self.hidden + self.qk_norm_params() + (self.heads if self.sinks else 0)
        shapes = self.linear_shapes()
        per_layer += sum(shapes[name][1] for name in self.bias_outputs if name in shapes)
        return self.layers * per_layer + self.hidden

    def total_params(self) -> int:
        """Every parameter of the model (a vision tower included)."""
        return (self.linear_params() + self.embedding_params() + self.head_params() + self.norm_params()
                + self.vision_params + self.expert_params() + self.router_params())


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
    feature Studio does not describe (core/decoder/)."""
    spec = describe_decoder(data)
    if isinstance(spec, Refusal):
        raise ModelInfoError(f"{name}: {spec}")
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    init_std = float(text.get("initializer_range") or data.get("initializer_range") or 0.02)
    info = from_spec(spec, name, init_std)
    quant = data.get("quantization_config")
    if info.sparse_layers and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        info = replace(info, expert_format="mxfp4")
    return info


def from_spec(spec: DecoderSpec, name: str, init_std: float = 0.02) -> ModelInfo:
    """The estimator's view of a described decoder (``init_std``: config.json's initializer_range)."""
    return ModelInfo(
        name=name, hidden=spec.hidden, intermediate=spec.intermediate, layers=spec.num_layers, heads=spec.heads,
        kv_heads=spec.kv_heads, vocab=spec.vocab, tied=spec.tied, max_positions=spec.max_positions,
        head_dim=spec.head_dim, init_std=init_std, fast_path_blocker=decoder_blocker(spec),
        model_type=spec.model_type, fused=bool(spec.fused), norms_per_layer=len(spec.norms.names()),
        qk_norm="" if spec.qk_norm == "none" else spec.qk_norm, bias_outputs=spec.biases,
        vision_params=spec.extra_params, sparse_layers=spec.sparse_layers if spec.moe else 0,
        experts=spec.moe.experts if spec.moe else 0, expert_intermediate=spec.moe.intermediate if spec.moe else 0,
        top_k=spec.moe.top_k if spec.moe else 0, moe=sparse_mlp(spec), sinks=spec.sinks,
        softcapped=spec.attn_softcap is not None, activation=spec.activation)


def _table_entry(name: str, model_type: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vocab: int, tied: bool, max_positions: int, **more: object) -> ModelInfo:
    """A shape of the table below, described from its config.json's keys like any other."""
    return from_config_dict(dict(model_type=model_type, hidden_size=hidden, intermediate_size=intermediate,
                                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                 vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=max_positions,
                                 **more), name)


# Offline fallback, copied from each model's config.json on the hub (sample_data/model_configs/
# holds whole files; these are the keys the estimate reads).
KNOWN_MODELS: dict[str, ModelInfo] = {info.name: info for info in (
    _table_entry("HuggingFaceTB/SmolLM2-135M", "llama", 576, 1536, 30, 9, 3, 49152, True, 8192),
    _table_entry("HuggingFaceTB/SmolLM2-360M", "llama", 960, 2560, 32, 15, 5, 49152, True, 8192),
    _table_entry("HuggingFaceTB/SmolLM2-1.7B", "llama", 2048, 8192, 24, 32, 32, 49152, True, 8192),
    _table_entry("meta-llama/Llama-2-7b-hf", "llama", 4096, 11008, 32, 32, 32, 32000, False, 4096),
    _table_entry("meta-llama/Llama-2-13b-hf", "llama", 5120, 13824, 40, 40, 40, 32000, False, 4096),
    _table_entry("mistralai/Mistral-7B-v0.1", "mistral", 4096, 14336, 32, 32, 8, 32000, False, 32768,
                 sliding_window=4096),
    _table_entry("meta-llama/Meta-Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128256, False, 8192),
)}


_VARIANTS = {"instruct", "it", "pt", "base", "chat"}
"""Name parts of a model's variants that share its shape (Llama-2-7b-chat-hf is Llama-2-7b-hf's)."""


def _shape_key(ref: str) -> str:
    """A hub id without its variant parts, in lower case: the key bundled configs are matched by."""
    owner, _, model = ref.lower().rstrip("/").rpartition("/")
    parts = [p for p in model.split("-") if p not in _VARIANTS]
    return f"{owner}/{'-'.join(parts)}"


def bundled_config(ref: str) -> Path | None:
    """Studio's bundled config.json for hub id ``ref`` or a variant of the same model (-Instruct,
    -it, -pt, -Base, -chat): sample_data/model_configs/<owner>/<name>/config.json."""
    if "/" not in ref:
        return None
    key = _shape_key(ref)
    for path in sorted((sample_data_dir() / "model_configs").glob("*/*/config.json")):
        if _shape_key(f"{path.parent.parent.name}/{path.parent.name}") == key:
            return path
    return None


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


def read_config(path: Path, name: str) -> ModelInfo:
    """The shape a config.json file describes; raises ModelInfoError naming the file when it is not
    a JSON object or the model is not described."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelInfoError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelInfoError(f"{path}: not a config.json (a JSON object was expected)")
    return from_config_dict(data, name)


def load_model_info(ref: str, revision: str | None = None) -> ModelInfo:
    """The shape of model ``ref``: a local folder, the HF cache, Studio's bundled config.json files,
    or the offline table, in that order."""
    problem = local_problem(ref)
    if problem:
        raise ModelInfoError(problem)
    folder = Path(ref).expanduser()
    path = folder / "config.json" if folder.is_dir() else _hub_cache_config(ref, revision)
    if path is not None:
        if not path.is_file():
            raise ModelInfoError(f"{folder}: no config.json in this folder; point model.base_model at a "
                                 "folder saved by save_pretrained, or at a hub id")
        return read_config(path, ref)
    bundled = bundled_config(ref)
    if bundled is not None:
        return read_config(bundled, ref)
    known = _known(ref)
    if known is not None:
        return known
    raise ModelInfoError(f"{ref}: not a local folder, not in the Hugging Face cache and not a model Studio "
                         "knows offline (sample_data/model_configs/); download it once (hf download "
                         f"{ref} config.json) or pass a folder with its config.json")
