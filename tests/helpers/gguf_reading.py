"""What llama.cpp makes of a GGUF file, rebuilt as a transformers model to compare with.

CI has no llama.cpp (it builds from source; tests/engine/test_export_llamacpp.py runs it where
llama-cpp-python is installed), so its reading of the metadata is written out from its
``llama-model.cpp``: which keys it reads for each architecture, the default it takes for a key that is
missing, and what it fixes without reading any key (Gemma's sliding
pattern and attention scale, Gemma 3's local RoPE base, Phi-3's disabled sliding window). The result
is a transformers config, and the weights are loaded through transformers' own GGUF reader (its own
undoing of the q/k reordering and of Gemma's ``1 + w`` norms), so neither half is the exporter's
code read backwards. transformers has no reader for llama.cpp's Mixtral (its ``llama`` architecture
with experts), OLMoE or gpt-oss files (5.24's gpt-oss reader looks for tensor names llama.cpp does
not write), nor for Qwen3-MoE before it had one: :func:`read_weights` reads those, from llama.cpp's
tensor names written out here (not the ``gguf`` package's map the exporter uses), and is checked
against transformers' reader on a Qwen3-MoE file.
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
    experts = dict(num_experts_per_tok=key("expert_used_count"))
    if arch == "gpt-oss":
        return _gpt_oss_config(key, common, theta, experts)
    if arch == "llama" and key("expert_count"):
        # llama.cpp's llama architecture with experts: Mixtral, the top-k probabilities renormalised
        assert rope_dims == head_dim, "llama.cpp refuses a llama file whose rotary width is not the head size"
        return AutoConfig.for_model("mixtral", **common, rope_parameters=rope, num_local_experts=key("expert_count"),
                                    sliding_window=None, **experts)
    if arch == "llama":
        assert rope_dims == head_dim, "llama.cpp refuses a llama file whose rotary width is not the head size"
        return AutoConfig.for_model("llama", **common, rope_parameters=rope)
    if arch in ("qwen2", "qwen3"):
        return AutoConfig.for_model(arch, **common, rope_parameters=rope)
    if arch == "qwen3moe":
        # Experts in every layer, their top-k probabilities renormalised; without the key, llama.cpp
        # takes the experts' width as feed_forward_length / expert_used_count.
        width = key("expert_feed_forward_length") or key("feed_forward_length") // key("expert_used_count")
        return AutoConfig.for_model("qwen3_moe", **common, rope_parameters=rope, num_experts=key("expert_count"),
                                    moe_intermediate_size=width, norm_topk_prob=True, mlp_only_layers=[],
                                    decoder_sparse_step=1, **experts)
    if arch == "olmoe":
        # q and k normed over the whole projection, the top-k probabilities as they are, nothing clipped;
        # llama.cpp's loader requires output.weight, so the head is never the embeddings
        assert "output.weight" in tensors, "llama.cpp refuses an olmoe file without output.weight"
        return AutoConfig.for_model("olmoe", **common, rope_parameters=rope, num_experts=key("expert_count"),
                                    norm_topk_prob=False, clip_qkv=None, **experts)
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


def _gpt_oss_config(key: Any, common: dict[str, Any], theta: float, experts: dict[str, Any]) -> Any:
    """llama.cpp's gpt-oss (its openai-moe loader and graph): the experts' width from
    expert_feed_forward_length alone; layer i slides where i % period < period - 1 (period
    attention.sliding_window_pattern, 2 without it); YaRN with llama.cpp's defaults for missing betas
    (32 and 1) and its correction range rounded outwards (floor / ceil: transformers' truncate); the
    clamped SwiGLU's constants 1.702 and 7.0; biases on the attention; an output head of its own."""
    from transformers import AutoConfig

    period = key("attention.sliding_window_pattern", 2)
    types = ["sliding_attention" if i % period < period - 1 else "full_attention"
             for i in range(common["num_hidden_layers"])]
    rope = {"rope_type": "default", "rope_theta": theta}
    if key("rope.scaling.type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": key("rope.scaling.factor"),
                "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0),
                "truncate": True}
    return AutoConfig.for_model("gpt_oss", **{**common, "intermediate_size": key("expert_feed_forward_length"),
                                              "tie_word_embeddings": False},
                                num_local_experts=key("expert_count"), sliding_window=key("attention.sliding_window"),
                                layer_types=types, rope_parameters=rope, swiglu_alpha=1.702, swiglu_limit=7.0,
                                attention_bias=True, **experts)


_GPT_OSS_BLOCK = {"attn_norm.weight": "input_layernorm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
                  "ffn_gate_inp.bias": "mlp.router.bias", "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
                  **{f"attn_{gguf}.{kind}": f"self_attn.{hf}_proj.{kind}" for gguf, hf in
                     (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")}}
"""llama.cpp's gpt-oss tensors in block ``i`` (``blk.i.<name>``) -> transformers' in layer ``i``, as
they are; the experts' gate, up and down weights and the gate and up biases are rebuilt into
transformers' layout in :func:`read_weights`."""

_BLOCK = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
          "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
          "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
          "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
          "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj"}
"""llama.cpp's name of a mixture of experts' tensor in block ``i`` (``blk.i.<name>.weight``) -> its
transformers name in layer ``i``; ``ffn_gate_exps`` and ``ffn_up_exps`` together are ``gate_up_proj``."""
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
MOE_TYPES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def values(tensor: Any) -> Any:
    """A GGUF tensor's values as float32, in numpy's order (``[experts, out, in]`` for experts)."""
    import gguf
    import numpy as np

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape.tolist())])


def _pairs_to_halves(rows: Any, heads: int) -> Any:
    """llama.cpp's ``llama`` architecture rotates adjacent channels: its q/k rows, back in
    transformers' rotate-half order."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_weights(path: Path, config: Any) -> dict[str, Any]:
    """The transformers state dict (torch tensors) of a mixture of experts' GGUF file, for ``config``
    (:func:`llama_cpp_config` of it); every tensor of the file used, or an AssertionError."""
    import gguf
    import numpy as np
    import torch

    arch = metadata(path)[0]["general.architecture"]
    tensors = {t.name: values(t) for t in gguf.GGUFReader(path).tensors}
    state: dict[str, Any] = {}
    for name, hf in _GLOBAL.items():
        if name in tensors:
            state[hf] = tensors.pop(name)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers if arch == "gpt-oss" else 0):
        layer = f"model.layers.{i}."
        for name, hf in _GPT_OSS_BLOCK.items():
            state[layer + hf] = tensors.pop(f"blk.{i}.{name}")
        # transformers' gpt-oss: gate_up_proj [experts, in, 2 x width], the gate's columns even, the up's odd
        for kind, hf in (("weight", "gate_up_proj"), ("bias", "gate_up_proj_bias")):
            gate, up = (tensors.pop(f"blk.{i}.ffn_{p}_exps.{kind}") for p in ("gate", "up"))
            fused = np.empty((gate.shape[0], gate.shape[1] * 2, *gate.shape[2:]), dtype=np.float32)
            fused[:, 0::2], fused[:, 1::2] = gate, up  # [experts, 2 x width(, in)], gate and up alternating
            state[layer + "mlp.experts." + hf] = fused.transpose(0, 2, 1) if kind == "weight" else fused
        state[layer + "mlp.experts.down_proj"] = tensors.pop(f"blk.{i}.ffn_down_exps.weight").transpose(0, 2, 1)
    for i in range(config.num_hidden_layers if arch != "gpt-oss" else 0):
        layer = f"model.layers.{i}."
        for name, hf in _BLOCK.items():
            if f"blk.{i}.{name}.weight" in tensors:
                state[layer + hf] = tensors.pop(f"blk.{i}.{name}.weight")
        gate, up = tensors.pop(f"blk.{i}.ffn_gate_exps.weight"), tensors.pop(f"blk.{i}.ffn_up_exps.weight")
        state[layer + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        if arch == "llama":
            for proj, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads)):
                state[layer + f"self_attn.{proj}.weight"] = _pairs_to_halves(state[layer + f"self_attn.{proj}.weight"],
                                                                             heads)
    assert not tensors, f"tensors llama.cpp would not read for {arch}: {sorted(tensors)}"
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}  # copies: writable


def transformers_reads(model_type: str) -> bool:
    """Whether transformers' GGUF loader reads this family's files (every dense one here; of the
    mixtures of experts, Qwen3-MoE where its loader stacks experts, as 5.24's does)."""
    import importlib

    if model_type not in MOE_TYPES:
        return True
    processors = importlib.import_module("transformers.modeling_gguf_pytorch_utils").TENSOR_PROCESSORS
    return model_type == "qwen3_moe" and "qwen3moe" in processors


def load_as_llama_cpp(folder: Path, name: str, reader: str = "auto") -> Any:
    """The float32 transformers model of the GGUF ``folder/name`` as llama.cpp configures it, its
    weights read by transformers' GGUF loader, or by :func:`read_weights` where that has none
    (``reader``: auto, transformers or ours)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = llama_cpp_config(folder / name)
    if reader == "ours" or (reader == "auto" and not transformers_reads(config.model_type)):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(read_weights(folder / name, config), strict=True)
        return model.eval()
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

