"""The shape of a causal LM, read from its config.json without loading any weights.

The VRAM estimator needs only a handful of numbers (hidden size, layers, heads, vocabulary...).
They come from a local folder, from the Hugging Face cache, or, offline with an empty cache, from a
small table of well-known models.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def head_width(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear module in one decoder layer."""
        h, i = self.hidden, self.intermediate
        q = self.heads * self.head_width
        kv = self.kv_heads * self.head_width
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

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
        """RMSNorm weights: two per layer and the final one."""
        return (2 * self.layers + 1) * self.hidden

    def total_params(self) -> int:
        """Every parameter of the model."""
        return self.linear_params() + self.embedding_params() + self.head_params() + self.norm_params()


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
                return ModelInfo(ref, *_fields(info)[1:])
    return None


def _fields(info: ModelInfo) -> tuple:
    return (info.name, info.hidden, info.intermediate, info.layers, info.heads, info.kv_heads, info.vocab,
            info.tied, info.max_positions, info.head_dim, info.init_std, info.fast_path_blocker)


def from_config_dict(data: dict, name: str) -> ModelInfo:
    """A ModelInfo from a parsed config.json; raises ModelInfoError naming the missing key."""
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        return ModelInfo(
            name=name,
            hidden=hidden,
            intermediate=int(text["intermediate_size"]),
            layers=int(text["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            vocab=int(text["vocab_size"]),
            tied=bool(data.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_positions=int(text.get("max_position_embeddings") or 2048),
            head_dim=int(text["head_dim"]) if text.get("head_dim") else None,
            init_std=float(text.get("initializer_range") or data.get("initializer_range") or 0.02),
            fast_path_blocker=model_blocker(data),
        )
    except KeyError as exc:
        raise ModelInfoError(f"{name}: config.json has no '{exc.args[0]}'; is this a causal LM?") from None


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
                         "knows offline; download it once (huggingface-cli download " + ref +
                         " config.json) or pass a folder with its config.json")
