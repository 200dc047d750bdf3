"""Write a merged model folder as one GGUF file, and a run's LoRA adapter as a llama.cpp GGUF adapter.

The writer is the ``gguf`` package's ``GGUFWriter``; tensor names come from the package's own map
(``gguf.get_tensor_name_map`` for the family's architecture), so nothing here keeps a table of
llama.cpp names. What each family's metadata and tensors must say is
:mod:`studio.engine.gguf_families`; the tokenizer is :mod:`studio.engine.gguf_vocab`. Beyond those:

- a model with tied input and output embeddings has no ``output.weight`` in GGUF; readers reuse
  ``token_embd.weight`` (OLMoE, whose llama.cpp loader needs one, gets a copy);
- a multimodal wrapper (Gemma 3 4B+) is written as its text model; the vision tower is left out;
- a mixture of experts' projections are stacked over the experts, one ``[experts, out, in]`` tensor
  a projection and layer; gpt-oss' experts are split from its interleaved layout, and written in
  MXFP4 as they ship where they do (:mod:`studio.engine.gguf_tensors`); one projection of one layer
  is in memory at a time;
- norms, biases and a mixture's router stay float32 whatever ``--quant`` says, as llama.cpp's
  converter keeps them.

Covered: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3, Phi-3/Phi-4, and the mixtures of experts
Qwen3-MoE, Mixtral, OLMoE and gpt-oss (see :data:`~studio.engine.gguf_families.FAMILIES`). Anything
else raises :class:`GgufExportError` with what to do instead. The LoRA GGUF covers plain LoRA on
linear layers: an adapter on a mixture's expert weights (``lora.target_experts``) has no llama.cpp form.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from studio.engine.gguf_families import (
    Family,
    GgufExportError,
    check,
    rope_tensors,
    text_config,
    write_hparams,
)
from studio.engine.gguf_tensors import Tensor, Weights, model_tensors
from studio.engine.gguf_vocab import read_vocab

__all__ = ["QUANTS", "GgufExportError", "check_architecture", "check_quant", "gguf_name", "lora_gguf_refusal",
           "write_gguf", "write_lora_gguf"]

Progress = Callable[[str, float], None]
"""progress(stage, fraction 0..1)."""

QUANTS = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "mxfp4")
"""``--quant`` values: GGML types the gguf package can write from Python. ``mxfp4`` is for a mixture
of experts, as llama.cpp's ``llama-quantize ... MXFP4_MOE``: the experts in MXFP4, every other
matrix in q8_0."""

CHUNK_VALUES = 1 << 22
"""Values quantized per step: gguf's MXFP4 quantizer holds 64 bytes a value while it rounds."""

_VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.", "model.vision_model.")
"""Tensors of a multimodal wrapper's vision side, which the text model's GGUF leaves out."""


def _gguf() -> Any:
    import gguf

    return gguf


def _qtype(quant: str) -> Any:
    g = _gguf()
    if quant not in QUANTS:
        raise GgufExportError(f"--quant {quant} is not one of {', '.join(QUANTS)}")
    return getattr(g.GGMLQuantizationType, quant.upper())


def check_quant(quant: str, family: Family) -> None:
    """GgufExportError in one line when ``quant`` is not a ``--quant`` value or does not fit the model."""
    _qtype(quant)
    if quant == "mxfp4" and not family.moe:
        raise GgufExportError("--quant mxfp4 stores a mixture of experts' expert weights in MXFP4 (the rest in q8_0) "
                              "and this model has no experts; choose q8_0, q4_0 or another --quant")


def _file_type(quant: str, mxfp4_experts: bool) -> int:
    """``general.file_type``: the quant's, or MXFP4_MOE where the experts are MXFP4 and the rest is
    unquantized (as llama.cpp's converter says of gpt-oss written from its MXFP4 checkpoint)."""
    ft = _gguf().LlamaFileType
    if quant == "mxfp4" or (mxfp4_experts and quant in ("f32", "f16", "bf16")):
        return int(ft.MOSTLY_MXFP4_MOE)
    return int(ft.ALL_F32 if quant == "f32" else getattr(ft, "MOSTLY_" + quant.upper()))


def check_architecture(config: dict[str, Any]) -> Family:
    """The :class:`~studio.engine.gguf_families.Family` of ``config`` (a config.json); GgufExportError
    when it is not a model this exporter covers or llama.cpp could not run it as configured."""
    return check(config)


def _permute_heads(rows: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the output rows of a q/k projection from halves-per-head to interleaved pairs."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _name_map(config: dict[str, Any], family: Family) -> Any:
    g = _gguf()
    return g.get_tensor_name_map(getattr(g.MODEL_ARCH, family.arch), int(config["num_hidden_layers"]))


def _text_name(hf_name: str) -> str | None:
    """The text model's name of a checkpoint tensor (a multimodal wrapper's prefix dropped), or
    None for a vision-side tensor."""
    if hf_name.startswith(_VISION_PREFIXES):
        return None
    for prefix, plain in (("model.language_model.", "model."), ("language_model.model.", "model."),
                          ("language_model.lm_head.", "lm_head.")):
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix):]
    return hf_name


def gguf_name(hf_name: str, names: Any) -> str:
    """The GGUF name of a Hugging Face tensor name (``model.layers.0.self_attn.q_proj.weight`` ->
    ``blk.0.attn_q.weight``); GgufExportError for a tensor llama.cpp has no place for."""
    found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise GgufExportError(f"tensor {hf_name} has no GGUF name in llama.cpp's architecture for this model; "
                              "export --format merged and convert with llama.cpp's convert_hf_to_gguf.py")
    return found


def _orient(hf_name: str, data: np.ndarray, config: dict[str, Any], family: Family) -> np.ndarray:
    """What llama.cpp expects where Hugging Face stores ``data``: q/k rows in rotated pairs (Llama),
    Gemma's norms as ``1 + w``."""
    if family.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute_heads(data, int(config["num_attention_heads"]))
    if family.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute_heads(data, int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    if family.norm_shift and hf_name.endswith("norm.weight"):
        return data + family.norm_shift
    return data


def _storage(tensor: Tensor, gguf_tensor: str, quant: str) -> Any:
    """The GGML type a tensor is stored as: MXFP4 where it ships so; float32 for 1-D tensors, biases
    and a mixture's router (``ffn_gate_inp``), as llama.cpp's converter keeps them; under ``mxfp4``,
    the stacked experts MXFP4 and the other matrices q8_0; a matrix whose rows do not split into the
    quant's blocks falls back to f16."""
    g = _gguf()
    types = g.GGMLQuantizationType
    if tensor.packed is not None:
        return types.MXFP4
    if len(tensor.shape) < 2 or quant == "f32" or not gguf_tensor.endswith(".weight") or \
            ".ffn_gate_inp." in gguf_tensor:
        return types.F32
    if quant == "mxfp4":
        qtype = types.MXFP4 if len(tensor.shape) == 3 else types.Q8_0
    else:
        qtype = _qtype(quant)
    if tensor.shape[-1] % g.GGML_QUANT_SIZES[qtype][0]:
        return types.F16
    return qtype


def _nbytes(shape: tuple[int, ...], qtype: Any) -> int:
    block, size = _gguf().GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _convert(tensor: Tensor, data: np.ndarray | None, qtype: Any) -> np.ndarray:
    """``tensor``'s bytes as ``qtype``: its MXFP4 as shipped, or ``data`` (float32) converted; a
    quantized type a chunk of rows at a time (blocks never cross a row)."""
    g = _gguf()
    if tensor.packed is not None:
        return tensor.packed()
    if qtype == g.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == g.GGMLQuantizationType.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
    step = max(1, CHUNK_VALUES // rows.shape[1])
    done = [g.quants.quantize(rows[i:i + step], qtype) for i in range(0, rows.shape[0], step)]
    return np.concatenate(done).reshape(*data.shape[:-1], -1)


def _add_tokenizer(writer: Any, model_dir: Path, n_vocab: int) -> int:
    """The tokenizer metadata; returns the vocabulary size written."""
    g = _gguf()
    vocab = read_vocab(model_dir, n_vocab)
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    special = g.SpecialVocab(model_dir, load_merges=vocab.needs_merges, n_vocab=len(vocab.tokens))
    if "bos" not in special.add_special_token:
        # Not in tokenizer_config.json: say what the tokenizer does, so readers add BOS exactly as training did.
        from studio.core.prompt.tokens import load_tokenizer_info

        special.add_special_token["bos"] = load_tokenizer_info(model_dir).add_bos
    special.add_to_gguf(writer, quiet=True)
    return len(vocab.tokens)


def write_gguf(model_dir: str | Path, out: str | Path, quant: str = "f16",
               progress: Progress | None = None, name: str | None = None, shipped: str | Path | None = None) -> Path:
    """Convert the Hugging Face model folder ``model_dir`` (safetensors + tokenizer) to one GGUF file.
    ``shipped``: the checkpoint ``model_dir`` was merged from (a run's base); where it ships gpt-oss'
    experts in MXFP4 and a merged expert weight is exactly what its blocks hold, the blocks are
    written as they are instead of the weight rounded again."""
    g = _gguf()
    say = progress or (lambda _stage, _fraction: None)
    model_dir, out = Path(model_dir), Path(out)
    _qtype(quant)  # an unknown --quant fails before any work
    full_config = json.loads((model_dir / "config.json").read_text())
    family = check_architecture(full_config)
    check_quant(quant, family)
    config = text_config(full_config)
    weights = Weights(model_dir)
    names = _name_map(config, family)
    text_names = {n: _text_name(n) for n in weights.where}
    text_names = {n: t for n, t in text_names.items() if t is not None}
    tied = bool(config.get("tie_word_embeddings")) or "lm_head.weight" not in text_names.values() \
        or not family.has_output
    embedding = next((n for n, t in text_names.items() if t == "model.embed_tokens.weight"), None)
    if embedding is None:
        raise GgufExportError(f"{model_dir}: no model.embed_tokens.weight among the weights; this is not a "
                              "decoder laid out as the covered families are")
    # a base without safetensors has no blocks to keep: its experts are then written in --quant
    base = Weights(Path(shipped)) if shipped is not None and family.interleaved_experts and \
        any(Path(shipped).glob("*.safetensors")) else None
    ordered = [t for t in model_tensors(weights, text_names, config, family, base, lambda s, f: say(s, 0.02 * f))
               if not (tied and t.name == "lm_head.weight")]
    if tied and family.output_required:
        ordered.append(Tensor("lm_head.weight", weights.shape(embedding), partial(weights.read, embedding)))
    targets = [gguf_name(t.name, names) for t in ordered]
    storage = [_storage(t, target, quant) for t, target in zip(ordered, targets, strict=True)]

    writer = g.GGUFWriter(str(out), g.MODEL_ARCH_NAMES[getattr(g.MODEL_ARCH, family.arch)])
    writer.add_type(g.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    n_vocab = _add_tokenizer(writer, model_dir, weights.shape(embedding)[0])
    write_hparams(writer, config, family, n_vocab)
    writer.add_file_type(_file_type(quant, any(t.packed is not None for t in ordered)))
    writer.add_quantization_version(g.GGML_QUANT_VERSION)
    extra = rope_tensors(config, family)
    # Tensor infos first, then the data one tensor at a time: memory holds one tensor, not the model.
    for tensor, target, qtype in zip(ordered, targets, storage, strict=True):
        writer.add_tensor_info(target, tensor.shape, np.dtype(np.float32), _nbytes(tensor.shape, qtype),
                               raw_dtype=qtype)
    for tensor_name, data in extra.items():
        writer.add_tensor_info(tensor_name, data.shape, np.dtype(np.float32), data.nbytes,
                               raw_dtype=g.GGMLQuantizationType.F32)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (tensor, qtype) in enumerate(zip(ordered, storage, strict=True)):
        data = None if tensor.packed is not None else _orient(tensor.name, tensor.read(), config, family)
        writer.write_tensor_data(_convert(tensor, data, qtype))
        say(f"converting to {quant}", 0.02 + 0.98 * (i + 1) / len(ordered))
    for data in extra.values():
        writer.write_tensor_data(data)
    writer.close()
    return out


def lora_gguf_refusal(peft_config: dict[str, Any]) -> str | None:
    """Why the adapter with this ``adapter_config.json`` has no llama.cpp LoRA GGUF (None when it has):
    llama.cpp adds ``alpha/r * B @ A`` to linear weights, which DoRA, rsLoRA, trained whole modules and
    adapters on a mixture's 3-D expert weights (PEFT's ``target_parameters``) are not."""
    if peft_config.get("target_parameters"):
        return ("llama.cpp's LoRA adapters cover linear layers, and this one also adapts the expert weights "
                "(lora.target_experts); the model GGUF has it merged")
    if peft_config.get("use_dora") or peft_config.get("use_rslora") or peft_config.get("modules_to_save"):
        return ("llama.cpp's LoRA adapters cover plain LoRA, and this one uses DoRA, rsLoRA or trained whole "
                "modules; the model GGUF has it merged")
    return None


def write_lora_gguf(adapter_dir: str | Path, base_config: dict[str, Any], out: str | Path,
                    progress: Progress | None = None) -> Path:
    """Write the PEFT adapter in ``adapter_dir`` as a llama.cpp LoRA adapter (``--lora FILE``; in
    Ollama, ``ADAPTER FILE`` over the base model's GGUF). ``base_config`` is the base's config.json."""
    from safetensors import safe_open

    g = _gguf()
    say = progress or (lambda _stage, _fraction: None)
    adapter_dir, out = Path(adapter_dir), Path(out)
    family = check_architecture(base_config)
    base_config = text_config(base_config)
    peft = json.loads((adapter_dir / "adapter_config.json").read_text())
    refusal = lora_gguf_refusal(peft)
    if refusal:
        raise GgufExportError(f"{adapter_dir}: {refusal}")
    names = _name_map(base_config, family)
    writer = g.GGUFWriter(str(out), g.MODEL_ARCH_NAMES[getattr(g.MODEL_ARCH, family.arch)])
    writer.add_type(g.GGUFType.ADAPTER)
    writer.add_string(g.Keys.Adapter.TYPE, "lora")
    writer.add_float32(g.Keys.Adapter.LORA_ALPHA, float(peft.get("lora_alpha", peft.get("r", 8))))
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        keys = sorted(k for k in handle.keys() if ".lora_A." in k)
        for i, key in enumerate(keys):
            # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> model.layers.0...q_proj.weight
            module = key.removeprefix("base_model.model.").replace(".lora_A.weight", "").replace(".lora_A", "")
            module = _text_name(module + ".weight")
            if module is None:  # a vision-side LoRA: not part of the text model's GGUF
                continue
            module = module.removesuffix(".weight")
            target = gguf_name(module + ".weight", names)
            lora_a = handle.get_tensor(key).float().numpy()
            lora_b = handle.get_tensor(key.replace(".lora_A.", ".lora_B.")).float().numpy()
            # W' = W + s * B @ A: reordering the rows of W is reordering the rows of B.
            lora_b = _orient(module + ".weight", lora_b, base_config, family)
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
