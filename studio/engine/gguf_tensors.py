"""The tensors a GGUF file holds, each read from a model folder's safetensors when it is written (one
tensor in memory at a time), under the text model's Hugging Face name that
:func:`studio.engine.gguf_export.gguf_name` maps to llama.cpp's.

Most are written as they are. A mixture of experts' projections are stacked over the experts, one
``[experts, out, in]`` tensor a projection and layer (llama.cpp's ``ffn_{gate,up,down}_exps``), from
the one tensor an expert that transformers saves or its fused 3-D ``gate_up_proj`` (gate rows, then
up rows). gpt-oss is laid out as llama.cpp's converter (``convert_hf_to_gguf.py``, ``GptOssModel``)
reads it:

- ``mlp.experts.gate_up_proj`` is ``[experts, in, 2 x width]`` with the gate and up columns
  alternating (even columns the gate); its bias ``gate_up_proj_bias`` alternates the same way, and
  ``down_proj`` is ``[experts, width, hidden]``. Each is split and turned to ``[experts, out, in]``.
- ``self_attn.sinks`` (one value a head) is llama.cpp's ``attn_sinks.weight``.
- Where the checkpoint ships an expert projection in MXFP4 (``<name>_blocks [experts, out, in / 32,
  16]`` and ``<name>_scales [experts, out, in / 32]``, gate and up rows alternating), the blocks are
  repacked into GGML's MXFP4 and written as they are: never dequantized, never rounded again. A
  merged folder's expert weight is repacked from its base's blocks where it is exactly what they
  hold (the adapter left that projection alone), which is checked value for value: the values
  llama.cpp decodes from the repacked bytes must equal the merged weight's.

GGML's MXFP4 block (``block_mxfp4``, ggml-common.h; gguf-py's ``quants.MXFP4``) is 17 bytes for 32
weights: the scale byte (E8M0, the same biased exponent as the checkpoint's ``_scales``) and 16 bytes
whose byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its high one. The
checkpoint packs weights ``2j`` and ``2j + 1`` into byte ``j``. The 4-bit codes (E2M1) are the same.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from studio.engine.gguf_families import Family, GgufExportError, expert_count

Progress = Callable[[str, float], None]
"""progress(stage, fraction 0..1)."""

_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")
"""One expert's projection as transformers saves a mixture of experts: ``...mlp.experts.3.gate_proj.weight``
(Qwen3-MoE, OLMoE), ``...block_sparse_moe.experts.3.w1.weight`` (Mixtral)."""

_GPT_OSS_EXPERTS = re.compile(r"^(?P<block>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                              r"(?P<part>_blocks|_scales|_bias)?$")
"""A gpt-oss experts tensor: a projection's weight, its MXFP4 blocks or scales, or its bias."""

SPLITS = {"gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
          "down_proj": (("down_proj", slice(None)),)}
"""gpt-oss: the GGUF projections in each checkpoint projection, and which of its outputs (columns of
the weight, rows of its blocks, entries of its bias) each takes."""


class Weights:
    """The safetensors files of a model folder, read one tensor at a time (never all at once)."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise GgufExportError(f"{model_dir}: no .safetensors weights to convert")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {name: h for h in self._handles for name in h.keys()}

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header."""
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        """The tensor in float32."""
        return self.where[name].get_tensor(name).float().numpy()

    def read_expert(self, name: str, expert: int) -> np.ndarray:
        """``name[expert]`` of a tensor stacked over the experts, in float32 (the rest is not read)."""
        return self.where[name].get_slice(name)[expert:expert + 1].float().numpy()[0]

    def raw_expert(self, name: str, expert: int) -> np.ndarray:
        """``name[expert]`` as stored (MXFP4 blocks and scales: uint8)."""
        return self.where[name].get_slice(name)[expert:expert + 1].numpy()[0]


@dataclass(frozen=True)
class Tensor:
    """One tensor the GGUF file holds: the text model's Hugging Face name it is mapped from, its
    shape, and how to read it (float32); ``packed``, where set, gives its bytes in GGML's MXFP4,
    written as they are instead."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    packed: Callable[[], np.ndarray] | None = None


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Checkpoint MXFP4 ``blocks [..., rows, in / 32, 16]`` and ``scales [..., rows, in / 32]`` as
    GGML's MXFP4 bytes ``[..., rows, in / 32 * 17]``: the same codes and scales, reordered."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # weight order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], nibbles], axis=-1)
    return np.ascontiguousarray(packed.reshape(*packed.shape[:-2], packed.shape[-2] * 17), dtype=np.uint8)


def mxfp4_values(packed: np.ndarray) -> np.ndarray:
    """What llama.cpp decodes from GGML MXFP4 bytes ``[..., rows, in / 32 * 17]``: ``[..., rows, in]``
    in float32 (gpt-oss' MXFP4 weights are exact in float32)."""
    import gguf

    return gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4)


def _stacked(weights: Weights, name: str, by_expert: dict[int, str], experts: int) -> Tensor:
    """The tensors of one projection, one an expert, as one ``[experts, out, in]`` tensor."""
    if sorted(by_expert) != list(range(experts)):
        raise GgufExportError(f"{name}: the weights hold experts {sorted(by_expert)} of this projection but the "
                              f"config says {experts}; the merged folder is incomplete, export it again")
    first = weights.shape(by_expert[0])
    return Tensor(name, (experts, *first), lambda: np.stack([weights.read(by_expert[e]) for e in range(experts)]))


def _split_experts(weights: Weights, hf_name: str, columns: slice) -> np.ndarray:
    """``columns`` of gpt-oss' ``[experts, in, out]`` expert weight, as ``[experts, out, in]`` float32,
    read an expert at a time."""
    count, width_in, width_out = weights.shape(hf_name)
    out = np.empty((count, len(range(width_out)[columns]), width_in), dtype=np.float32)
    for e in range(count):
        out[e] = weights.read_expert(hf_name, e)[:, columns].T
    return out


def _mxfp4_part(source: Weights, blocks: str, scales: str, rows: slice, expert: int | None = None) -> np.ndarray:
    """GGML MXFP4 bytes of ``rows`` of a checkpoint's MXFP4 projection: one expert's ``[rows, in / 32
    * 17]``, or every expert's ``[experts, rows, in / 32 * 17]`` (repacked an expert at a time)."""
    if expert is None:
        count = source.shape(blocks)[0]
        first = _mxfp4_part(source, blocks, scales, rows, 0)
        out = np.empty((count, *first.shape), dtype=np.uint8)
        out[0] = first
        for e in range(1, count):
            out[e] = _mxfp4_part(source, blocks, scales, rows, e)
        return out
    return ggml_mxfp4(source.raw_expert(blocks, expert)[rows], source.raw_expert(scales, expert)[rows])


def _decoded(pack: Callable[[], np.ndarray]) -> np.ndarray:
    return mxfp4_values(pack())


def _is_shipped(weights: Weights, hf_name: str, columns: slice, pack: Callable[[int], np.ndarray]) -> bool:
    """Whether each expert's ``columns`` of the merged ``[experts, in, out]`` weight are exactly what
    llama.cpp decodes from the shipped blocks repacked (``pack(expert)``); stops at the first expert
    that differs (an adapter on the experts changes the first already)."""
    for e in range(weights.shape(hf_name)[0]):
        if not np.array_equal(mxfp4_values(pack(e)), weights.read_expert(hf_name, e)[:, columns].T):
            return False
    return True


def _gpt_oss_experts(block: str, names: dict[str, str], weights: Weights, shipped: Weights | None) -> list[Tensor]:
    """One gpt-oss layer's expert tensors: gate, up and down, weights and biases (``names``: what the
    checkpoint holds of ``block``, its text name -> its name in the folder)."""
    tensors = []
    for proj, parts in SPLITS.items():
        weight, blocks, scales = (names.get(f"{block}.{proj}{part}") for part in ("", "_blocks", "_scales"))
        source = weights
        if not blocks and weight and shipped is not None and f"{weight}_blocks" in shipped.where:
            source, blocks, scales = shipped, f"{weight}_blocks", f"{weight}_scales"
        if not weight and not (blocks and scales):
            raise GgufExportError(f"{block}: the weights hold neither {proj} nor both {proj}_blocks and _scales; "
                                  "the folder is not a whole gpt-oss checkpoint, export it again")
        for target, rows in parts:
            packed = None
            if blocks and scales:
                pack = partial(_mxfp4_part, source, blocks, scales, rows)
                # the model's own blocks are written as they are; a merged weight only where it equals them
                if weight is None or _is_shipped(weights, weight, rows, pack):
                    packed = pack
            if packed is not None:
                count, out_rows, groups, _ = source.shape(blocks)
                shape = (count, len(range(out_rows)[rows]), groups * 32)
                read = partial(_decoded, packed)
            else:
                count, width_in, width_out = weights.shape(weight)
                shape = (count, len(range(width_out)[rows]), width_in)
                read = partial(_split_experts, weights, weight, rows)
            tensors.append(Tensor(f"{block}.{target}.weight", shape, read, packed))
            bias = names.get(f"{block}.{proj}_bias")
            if bias:
                count, width = weights.shape(bias)
                tensors.append(Tensor(f"{block}.{target}.bias", (count, len(range(width)[rows])),
                                      lambda n=bias, r=rows: np.ascontiguousarray(weights.read(n)[:, r])))
    return tensors


def model_tensors(weights: Weights, text_names: dict[str, str], config: dict[str, Any], family: Family,
                  shipped: Weights | None = None, progress: Progress | None = None) -> list[Tensor]:
    """The file's tensors in the checkpoint's order (``text_names``: each tensor's name in the folder ->
    the text model's name): each as it is, except a mixture of experts' projections, stacked over the
    experts, and gpt-oss' experts split (and repacked where they ship in MXFP4; ``shipped``: the
    checkpoint a merged folder was made from, whose blocks are written where the merge left them)."""
    say = progress or (lambda _stage, _fraction: None)
    experts = expert_count(config) if family.moe else 0
    stacks: dict[str, dict[int, str]] = {}
    order: list[Tensor | str] = []
    layers: dict[str, dict[str, str]] = {}
    for hf_name, text in text_names.items():
        one = _EXPERT.match(text) if experts else None
        openai = _GPT_OSS_EXPERTS.match(text) if family.interleaved_experts else None
        if openai:
            if openai["block"] not in layers:
                layers[openai["block"]] = {}
                order.append(openai["block"])
            layers[openai["block"]][text] = hf_name
        elif one:
            name = f"{one['block']}.{one['proj']}.weight"
            if name not in stacks:
                stacks[name] = {}
                order.append(name)
            stacks[name][int(one["expert"])] = hf_name
        elif experts and text.endswith(".experts.gate_up_proj"):
            # transformers' fused layout [experts, 2 x intermediate, hidden]: the gate's rows, then the up's
            count, rows, columns = weights.shape(hf_name)
            block = text.removesuffix(".gate_up_proj")
            for half, proj in enumerate(("gate_proj", "up_proj")):
                part = slice(half * rows // 2, (half + 1) * rows // 2)
                order.append(Tensor(f"{block}.{proj}.weight", (count, rows // 2, columns),
                                    lambda n=hf_name, p=part: weights.read(n)[:, p]))
        elif experts and text.endswith(".experts.down_proj"):
            order.append(Tensor(text + ".weight", weights.shape(hf_name), partial(weights.read, hf_name)))
        elif text.endswith(".self_attn.sinks"):  # gpt-oss: one value a head, llama.cpp's attn_sinks.weight
            order.append(Tensor(text + ".weight", weights.shape(hf_name), partial(weights.read, hf_name)))
        else:
            order.append(Tensor(text, weights.shape(hf_name), partial(weights.read, hf_name)))
    found: list[Tensor] = []
    for i, item in enumerate(order):
        if isinstance(item, Tensor):
            found.append(item)
        elif item in layers:
            found += _gpt_oss_experts(item, layers[item], weights, shipped)
            say("checking the experts against the shipped MXFP4", (i + 1) / len(order))
        else:
            found.append(_stacked(weights, item, stacks[item], experts))
    return found
