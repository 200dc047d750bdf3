"""What llama.cpp makes of a GGUF file, rebuilt as a transformers model to compare with.

llama.cpp cannot be built or installed here (docs/export.md says why), so its reading of the metadata
is written out from its ``llama-model.cpp``: which keys it reads for each architecture, the default
it takes for a key that is missing, and what it fixes without reading any key (Gemma's sliding
pattern and attention scale, Gemma 3's local RoPE base, Phi-3's disabled sliding window). The result
is a transformers config, and the weights are loaded through transformers' own GGUF reader (its own
undoing of the q/k reordering and of Gemma's ``1 + w`` norms), so neither half is the exporter's
code read backwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def metadata(path: Path) -> tuple[dict[str, Any], set[str]]:
    """The GGUF's key/value pairs (arrays as lists) and its tensor names."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name for t in reader.tensors}


def llama_cpp_config(path: Path) -> Any:
    """A transformers config that computes what llama.cpp computes from this GGUF."""
    from transformers import AutoConfig

    meta, tensors = metadata(path)
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads, layers = key("embedding_length"), key("attention.head_count"), key("block_count")
    head_dim = key("attention.key_length", hidden // heads)
    rope_dims = key("rope.dimension_count", head_dim)
    scaling = {"rope_type": "default"}
    if key("rope.scaling.type", "linear") == "linear" and key("rope.scaling.factor", 0.0) not in (0.0, 1.0):
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    theta = key("rope.freq_base", 10000.0)
    common = dict(hidden_size=hidden, intermediate_size=key("feed_forward_length"), num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads),
                  head_dim=head_dim, rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
                  max_position_embeddings=key("context_length"), vocab_size=len(meta["tokenizer.ggml.tokens"]),
                  tie_word_embeddings="output.weight" not in tensors,
                  bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                  eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                  pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    rope = {**scaling, "rope_theta": theta}
    if arch == "llama":
        assert rope_dims == head_dim, "llama.cpp refuses a llama file whose rotary width is not the head size"
        return AutoConfig.for_model("llama", **common, rope_parameters=rope)
    if arch in ("qwen2", "qwen3"):
        return AutoConfig.for_model(arch, **common, rope_parameters=rope)
    if arch == "phi3":
        # llama.cpp runs Phi-3 without its sliding window, whatever the file says.
        return AutoConfig.for_model("phi3", **common, sliding_window=None,
                                    original_max_position_embeddings=key("rope.scaling.original_context_length"),
                                    rope_parameters={**rope, "partial_rotary_factor": rope_dims / (hidden // heads)})
    # Gemma: the attention scale is 1/sqrt(head size), except for the 27B layer counts.
    big = {"gemma2": 46, "gemma3": 62}[arch]
    scalar = hidden // heads if layers == big else head_dim
    if arch == "gemma2":
        types = ["sliding_attention" if i % 2 < 1 else "full_attention" for i in range(layers)]
        return AutoConfig.for_model("gemma2", **common, rope_parameters=rope, query_pre_attn_scalar=scalar,
                                    layer_types=types, sliding_window=key("attention.sliding_window", 4096),
                                    attn_logit_softcapping=key("attn_logit_softcapping", 50.0),
                                    final_logit_softcapping=key("final_logit_softcapping", 30.0))
    types = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(layers)]
    return AutoConfig.for_model("gemma3_text", **common, query_pre_attn_scalar=scalar, layer_types=types,
                                sliding_window=key("attention.sliding_window"),
                                final_logit_softcapping=key("final_logit_softcapping"),
                                rope_parameters={"full_attention": rope,
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}})


def load_as_llama_cpp(folder: Path, name: str) -> Any:
    """The float32 transformers model of the GGUF ``folder/name`` as llama.cpp configures it."""
    import torch
    from transformers import AutoModelForCausalLM

    config = llama_cpp_config(folder / name)
    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, config=config, dtype=torch.float32).eval()


def tokenizer_reader_is_faithful() -> bool:
    """Whether transformers' GGUF tokenizer follows the file's ``tokenizer.ggml.pre`` and rebuilds
    SentencePiece-style BPE from its scores (5.24 does). Older readers approximate: 5.17 splits
    every Qwen file with Qwen's expression and reads Gemma's vocabulary as Unigram, so a faithful
    file would not round-trip there."""
    import importlib

    try:
        mapping = importlib.import_module("transformers.integrations.gguf.gguf_tokenizer_mapping")
    except ImportError:
        return False
    return hasattr(mapping, "GGUF_PRE_TOKENIZER_SPLITS")

