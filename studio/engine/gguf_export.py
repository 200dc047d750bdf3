"""Write a merged model folder as one GGUF file, and a run's LoRA adapter as a llama.cpp GGUF adapter.

The writer is the ``gguf`` package's ``GGUFWriter``; tensor names come from the package's own map
(``gguf.get_tensor_name_map``), so nothing here keeps a table of llama.cpp names. What the package
does not know is how a Hugging Face checkpoint lays out its weights, and two facts matter:

- llama.cpp rotates query and key vectors in pairs of adjacent channels, Hugging Face's Llama in two
  halves; so the rows of ``q_proj`` and ``k_proj`` are reordered per head (``_permute_heads``), and a
  GGUF reader (llama.cpp, transformers' GGUF loader) undoes it.
- a model with tied input and output embeddings has no ``output.weight`` in GGUF; readers reuse
  ``token_embd.weight``.

Covered: Llama-architecture models (``model_type`` llama or mistral, such as SmolLM2, Llama 3,
Mistral) with a byte-level BPE tokenizer (GPT-2 style ``tokenizer.json``). Anything else raises
:class:`GgufExportError` with what to do instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Progress = Callable[[str, float], None]
"""progress(stage, fraction 0..1)."""

QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
"""``--quant`` values: GGML types the gguf package can write from Python."""

_ARCHITECTURES = ("llama", "mistral")
"""Hugging Face ``model_type`` values written as GGUF's ``llama`` architecture (llama.cpp does the same)."""


class GgufExportError(RuntimeError):
    """The model or adapter cannot be written as GGUF; the message says why and what to do."""


def _gguf() -> Any:
    import gguf

    return gguf


def _qtype(quant: str) -> Any:
    g = _gguf()
    if quant not in QUANTS:
        raise GgufExportError(f"--quant {quant} is not one of {', '.join(QUANTS)}")
    return getattr(g.GGMLQuantizationType, quant.upper())


def _file_type(quant: str) -> int:
    ft = _gguf().LlamaFileType
    return int(ft.ALL_F32 if quant == "f32" else getattr(ft, "MOSTLY_" + quant.upper()))


def check_architecture(config: dict[str, Any]) -> None:
    """Raise GgufExportError when ``config`` (a config.json) is not a model this exporter covers."""
    model_type = config.get("model_type", "?")
    if model_type not in _ARCHITECTURES:
        raise GgufExportError(
            f"GGUF export covers Llama-architecture models ({', '.join(_ARCHITECTURES)}); this model is "
            f"'{model_type}'. Export it with --format merged and convert that folder with llama.cpp's "
            "convert_hf_to_gguf.py")
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        raise GgufExportError(f"this model uses '{kind}' RoPE scaling, which the GGUF exporter does not write "
                              "yet; export --format merged and convert with llama.cpp's convert_hf_to_gguf.py")


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    return float(config.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _permute_heads(rows: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the output rows of a q/k projection from halves-per-head to interleaved pairs."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _name_map(config: dict[str, Any]) -> Any:
    g = _gguf()
    return g.get_tensor_name_map(g.MODEL_ARCH.LLAMA, int(config["num_hidden_layers"]))


def gguf_name(hf_name: str, names: Any) -> str:
    """The GGUF name of a Hugging Face tensor name (``model.layers.0.self_attn.q_proj.weight`` ->
    ``blk.0.attn_q.weight``); GgufExportError for a tensor llama.cpp has no place for."""
    found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise GgufExportError(f"tensor {hf_name} has no GGUF name in the llama architecture; "
                              "this model is not a plain Llama (export --format merged instead)")
    return found


def _orient(hf_name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Apply the q/k row permutation that llama.cpp's rotary embedding expects."""
    if hf_name.endswith("q_proj.weight"):
        return _permute_heads(data, int(config["num_attention_heads"]))
    if hf_name.endswith("k_proj.weight"):
        return _permute_heads(data, int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    return data


def _storage(shape: tuple[int, ...], quant: str) -> Any:
    """The GGML type a tensor of ``shape`` is stored as: 1-D tensors stay float32 (as llama.cpp keeps
    norms), and a matrix whose rows do not split into the quant's blocks falls back to f16."""
    g = _gguf()
    if len(shape) < 2 or quant == "f32":
        return g.GGMLQuantizationType.F32
    qtype = _qtype(quant)
    if shape[-1] % g.GGML_QUANT_SIZES[qtype][0]:
        return g.GGMLQuantizationType.F16
    return qtype


def _nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    block, size = _gguf().GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _convert(data: np.ndarray, qtype: Any) -> np.ndarray:
    """``data`` (float32) as the bytes of ``qtype``."""
    g = _gguf()
    if qtype == g.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == g.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return g.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


class _Weights:
    """The safetensors files of a model folder, read one tensor at a time (never all at once)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise GgufExportError(f"{model_dir}: no .safetensors weights to convert")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {name: h for h in self._handles for name in h.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self.where[name].get_tensor(name).float().numpy()


def _vocab(model_dir: Path, n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens by id and their GGUF types, from tokenizer.json (byte-level BPE only)."""
    g = _gguf()
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise GgufExportError(f"{model_dir}: no tokenizer.json; GGUF export needs a fast tokenizer")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    pre = json.dumps(data.get("pre_tokenizer") or {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or "ByteLevel" not in pre:
        raise GgufExportError("GGUF export covers byte-level BPE tokenizers (GPT-2 style, as SmolLM2 and "
                              "Llama 3 use); this tokenizer is not one. Export --format merged and convert "
                              "with llama.cpp's convert_hf_to_gguf.py")
    by_id: dict[int, tuple[str, int]] = {i: (t, int(g.TokenType.NORMAL)) for t, i in model["vocab"].items()}
    for added in data.get("added_tokens") or []:
        kind = g.TokenType.CONTROL if added.get("special") else g.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], int(kind))
    size = max(n_vocab, max(by_id) + 1)
    tokens, types = [], []
    for i in range(size):
        token, kind = by_id.get(i, (f"[PAD{i}]", int(g.TokenType.UNUSED)))
        tokens.append(token)
        types.append(kind)
    return tokens, types


def _adds_prefix_space(node: Any) -> bool:
    """Whether tokenizer.json's pre-tokenizer (possibly a Sequence) puts a space before the text."""
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel" and node.get("add_prefix_space"):
            return True
        return any(_adds_prefix_space(v) for v in node.values())
    if isinstance(node, list):
        return any(_adds_prefix_space(v) for v in node)
    return False


def tokenizer_pre(gguf_file: str | Path) -> str | None:
    """``tokenizer.ggml.pre`` of an existing GGUF of the same base model (llama.cpp names its
    pre-tokenizer by hashing the tokenizer's output, a table only its converter keeps)."""
    reader = _gguf().GGUFReader(str(gguf_file))
    field = reader.fields.get("tokenizer.ggml.pre")
    return str(field.contents()) if field is not None else None


def write_gguf(model_dir: str | Path, out: str | Path, quant: str = "f16",
               progress: Progress | None = None, name: str | None = None, pre: str | None = None) -> Path:
    """Convert the Hugging Face model folder ``model_dir`` (safetensors + tokenizer) to one GGUF file.

    ``pre`` is llama.cpp's pre-tokenizer name (see :func:`tokenizer_pre`); without it llama.cpp uses
    its default pre-tokenizer and warns.
    """
    g = _gguf()
    say = progress or (lambda _stage, _fraction: None)
    model_dir, out = Path(model_dir), Path(out)
    _qtype(quant)  # an unknown --quant fails before any work
    config = json.loads((model_dir / "config.json").read_text())
    check_architecture(config)
    tokens, types = _vocab(model_dir, int(config["vocab_size"]))
    weights = _Weights(model_dir)
    names = _name_map(config)
    tied = bool(config.get("tie_word_embeddings")) or "lm_head.weight" not in weights.where
    ordered = [n for n in weights.where if not (tied and n == "lm_head.weight")]

    writer = g.GGUFWriter(str(out), g.MODEL_ARCH_NAMES[g.MODEL_ARCH.LLAMA])
    writer.add_type(g.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_rope_dimension_count(_head_dim(config))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(_file_type(quant))
    writer.add_quantization_version(g.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    writer.add_add_space_prefix(_adds_prefix_space(tokenizer_json.get("pre_tokenizer")))
    special = g.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    if "bos" not in special.add_special_token:
        # Not in tokenizer_config.json: say what the tokenizer does, so readers add BOS exactly as training did.
        from studio.core.tokens import load_tokenizer_info

        special.add_special_token["bos"] = load_tokenizer_info(model_dir).add_bos
    special.add_to_gguf(writer, quiet=True)
    # Tensor infos first, then the data one tensor at a time: memory holds one tensor, not the model.
    storage = {}
    for hf_name in ordered:
        shape = weights.shape(hf_name)
        storage[hf_name] = _storage(shape, quant)
        writer.add_tensor_info(gguf_name(hf_name, names), shape, np.dtype(np.float32),
                               _nbytes(shape, storage[hf_name]), raw_dtype=storage[hf_name])
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, hf_name in enumerate(ordered):
        data = _orient(hf_name, weights.read(hf_name), config)
        writer.write_tensor_data(_convert(data, storage[hf_name]))
        say(f"converting to {quant}", 0.02 + 0.98 * (i + 1) / len(ordered))
    writer.close()
    return out


def write_lora_gguf(adapter_dir: str | Path, base_config: dict[str, Any], out: str | Path,
                    progress: Progress | None = None) -> Path:
    """Write the PEFT adapter in ``adapter_dir`` as a llama.cpp LoRA adapter (``--lora FILE``; in
    Ollama, ``ADAPTER FILE`` over the base model's GGUF). ``base_config`` is the base's config.json."""
    from safetensors import safe_open

    g = _gguf()
    say = progress or (lambda _stage, _fraction: None)
    adapter_dir, out = Path(adapter_dir), Path(out)
    check_architecture(base_config)
    peft = json.loads((adapter_dir / "adapter_config.json").read_text())
    if peft.get("use_dora") or peft.get("use_rslora") or peft.get("modules_to_save"):
        raise GgufExportError("the LoRA GGUF adapter covers plain LoRA; this adapter uses DoRA, rsLoRA or "
                              "trained whole modules: use the merged GGUF (--format gguf writes both)")
    names = _name_map(base_config)
    writer = g.GGUFWriter(str(out), g.MODEL_ARCH_NAMES[g.MODEL_ARCH.LLAMA])
    writer.add_type(g.GGUFType.ADAPTER)
    writer.add_string(g.Keys.Adapter.TYPE, "lora")
    writer.add_float32(g.Keys.Adapter.LORA_ALPHA, float(peft.get("lora_alpha", peft.get("r", 8))))
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        keys = sorted(k for k in handle.keys() if ".lora_A." in k)
        for i, key in enumerate(keys):
            # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> model.layers.0...q_proj.weight
            module = key.removeprefix("base_model.model.").replace(".lora_A.weight", "").replace(".lora_A", "")
            target = gguf_name(module + ".weight", names)
            lora_a = handle.get_tensor(key).float().numpy()
            lora_b = handle.get_tensor(key.replace(".lora_A.", ".lora_B.")).float().numpy()
            # W' = W + s * B @ A: reordering the rows of W is reordering the rows of B.
            lora_b = _orient(module + ".weight", lora_b, base_config)
            writer.add_tensor(target + ".lora_a", lora_a.astype(np.float32))
            writer.add_tensor(target + ".lora_b", lora_b.astype(np.float32))
            say("converting the adapter", (i + 1) / max(1, len(keys)))
    if not keys:
        raise GgufExportError(f"{adapter_dir}: the adapter has no LoRA weights")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return out
