"""gpt-oss' expert weights in MXFP4, kept as the checkpoint ships them: 4.25 bits a weight.

The format (OCP Microscaling, MXFP4): blocks of 32 values share one power-of-two scale, a uint8
exponent biased by 127 (255 is NaN); each value is an FP4 E2M1 number (a sign, two exponent bits,
one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two a byte, the lower nibble
first. gpt-oss' checkpoints hold, for each sparse layer, ``mlp.experts.gate_up_proj_blocks
[experts, 2 x intermediate, hidden / 32, 16]`` with ``gate_up_proj_scales [experts, 2 x
intermediate, hidden / 32]``, and ``down_proj_blocks [experts, hidden, intermediate / 32, 16]`` with
its scales: each expert's weight as ``[out, in]`` rows, blocked along ``in`` (the transpose of
transformers' ``GptOssExperts`` parameters, ``[experts, in, out]``), as transformers' Mxfp4
quantizer reads them.

transformers runs them through the Hub's Triton kernels where it can fetch them, and otherwise
dequantizes them to bf16 at load (gpt-oss-20b's experts: 10.2 GB become 24 GB). Here they stay as
shipped, from the load on: :func:`converters_on_load` hands transformers' loader (inside Studio's
4-bit quantizer, engine/quantized_experts.py) a step that keeps each projection's blocks and scales
as they arrive, so no expert weight is ever held in bf16 (transformers casts each checkpoint tensor
to the compute dtype on its way to the device: one projection's blocks pass through at 2 bytes a
byte, 0.53 GB for gpt-oss-20b's gate/up, and are kept as bytes). :class:`Mxfp4Experts` holds one
projection's blocks and scales on the device, and :meth:`Mxfp4Experts.dequantize` writes every
expert's weight in the compute dtype: on CUDA in one Triton kernel (engine/fast/mxfp4_dequant.py),
else in plain torch (the CPU, or a kernel that fails here), a chunk of rows at a time so that its
temporaries stay a few tens of MB; the values are the same to the bit. The
fast path (engine/fast/moe.py) dequantizes one projection into its workspace right before the
grouped product that reads it; transformers' own forward (chat, ``studio eval``, the plain path)
gets the experts' parameters lent by engine/expert_weights.py's forward of the experts module, as
engine/quantized_experts.py's NF4 ones: without gradients a group of experts at a time
(:meth:`Mxfp4Experts.parameter_weight` dequantizes just their blocks), with gradients the whole
layer's (what autograd saves of them for a backward stays until that backward). PEFT's
``target_parameters`` adapters attach to the parameters, which keep their shape and dtype and hold
a placeholder that owns no memory.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from studio.core.decoder.spec import EXPERT_PARAMETERS
from studio.engine.expert_weights import holders, placeholder_parameter

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The FP4 E2M1 number each 4-bit code stands for (bit 3 the sign)."""

BLOCK = 32
"""Values sharing one scale."""

SCALE_BIAS = 127
"""A scale byte ``s`` multiplies its block by ``2 ** (s - 127)`` (but 255: NaN)."""

NAN_SCALE = 255
"""The scale byte that stands for NaN (OCP MX's E8M0): every value of its block is NaN."""

CHUNK_VALUES = 1 << 24
"""Values dequantized per step: the step's temporaries (a code index per byte, the values) are
about 4 bytes a value, 64 MiB (6 for fp16, whose values are multiplied in fp32)."""

SUFFIXES = ("_blocks", "_scales")
"""What the checkpoint appends to an expert parameter's name for its MXFP4 tensors."""

_ATTRIBUTE = "studio_mxfp4_experts"
"""The experts module's attribute holding its :class:`Mxfp4Experts` by parameter name."""


@functools.lru_cache(maxsize=8)
def _pair_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[256, 2]``: the two values of each byte, its lower nibble's first (one copy a device and dtype)."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=1).to(device=device, dtype=dtype)


def scale_values(exponents: torch.Tensor) -> torch.Tensor:
    """Each scale byte's power of two, ``2 ** (s - 127)``, as fp32 (255: NaN), built from its bits:
    exact on every device, where CUDA's ``exp2`` is an approximation within 2 ulp (on an H200 it gave
    2^-127 one subnormal step off). Byte ``s`` is the float's exponent field; 0 (2^-127, below fp32's
    normal range) is the subnormal whose top mantissa bit alone is set."""
    exponents = exponents.to(torch.int32)
    bits = torch.where(exponents == 0, 1 << 22, exponents << 23)
    return torch.where(exponents == NAN_SCALE, 0x7FC00000, bits).view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     out: torch.Tensor | None = None, kernel: bool = True,
                     window: tuple[int, int] | None = None) -> torch.Tensor:
    """The weights ``blocks [..., rows, in / 32, 16]`` and ``scales [..., rows, in / 32]`` stand
    for, as ``[..., rows, in]`` in ``dtype``; written into ``out`` when given: contiguous, or a 3-D
    ``[experts, rows, in]`` of any strides (a transposed view). ``window`` ``(first, count)``: only
    those rows (of each expert), ``[..., count, in]``. With ``kernel`` (the
    ``trainer.fast_path.kernels`` setting), by engine/fast/mxfp4_dequant.py's one Triton kernel where
    it runs (CUDA, or Triton's interpreter), else with torch operations: the same values to the bit."""
    *lead, rows, groups, half = blocks.shape
    if half * 2 != BLOCK or tuple(scales.shape) != (*lead, rows, groups):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
                         f"([..., rows, in / {BLOCK}, {BLOCK // 2}] and [..., rows, in / {BLOCK}])")
    full_blocks, full_scales = blocks, scales
    if window is not None:
        first, rows = window
        blocks, scales = blocks[..., first:first + rows, :, :], scales[..., first:first + rows, :]
        assert blocks.shape[-3] == rows, "a window inside every expert's rows"
    width = groups * BLOCK
    if out is None:
        out = torch.empty(*lead, rows, width, dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != (*lead, rows, width):  # the kernel would write past a smaller one
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} dequantize to {(*lead, rows, width)}, not into "
                         f"{tuple(out.shape)}")
    if kernel and _by_kernel(full_blocks, full_scales, out, window):
        return out
    # fp16 cannot hold every scale (2^-25 and below are 0, 2^16 and above infinite): its values are
    # multiplied in fp32 and rounded once, as the exact product; fp32 and bf16 hold every scale
    compute = torch.float32 if dtype == torch.float16 else dtype
    table = _pair_table(compute, blocks.device)
    if out.is_contiguous():  # every expert's rows as one run
        pieces = [(blocks.reshape(-1, groups, half), scales.reshape(-1, groups), out.view(-1, width))]
    else:
        assert out.dim() == 3 and len(lead) == 1, "a strided output is one [experts, rows, in] tensor"
        pieces = [(blocks[e], scales[e], out[e]) for e in range(out.shape[0])]
    step = max(1, CHUNK_VALUES // width)
    for codes, exponents, target in pieces:
        for start in range(0, codes.shape[0], step):
            end = min(codes.shape[0], start + step)
            values = table[codes[start:end].int()].view(end - start, groups, BLOCK)
            values.mul_(scale_values(exponents[start:end]).to(compute)[..., None])
            target[start:end].copy_(values.view(end - start, width))
    return out


def _by_kernel(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
               window: tuple[int, int] | None = None) -> bool:
    """Whether engine/fast/mxfp4_dequant.py's kernel wrote ``out`` (False where it does not run or
    cover these tensors, or failed here: the torch way then does)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or not (out.is_contiguous() or out.dim() == 3):
        return False
    from studio.engine.fast import mxfp4_dequant  # imports Triton only on its first use

    if out.dtype not in mxfp4_dequant.DTYPES or not mxfp4_dequant.available(blocks.device):
        return False
    done, _ = mxfp4_dequant.KERNELS.attempt(lambda: mxfp4_dequant.dequantize(blocks, scales, out, window))
    return done


class Mxfp4Experts:
    """One projection of every expert as the checkpoint ships it: ``blocks [experts, out, in / 32,
    16]`` and ``scales [experts, out, in / 32]``, dequantized to ``[experts, out, in]``."""

    transposed = False
    """The dequantized weights are ``[experts, out, in]`` whatever the parameter's layout
    (engine/fast/moe.py's ``ExpertWeights`` reads this)."""

    def __init__(self, param: nn.Parameter, blocks: torch.Tensor, scales: torch.Tensor):
        self.param = param
        """The model's parameter (``[experts, in, out]``, now a placeholder), lent weights for each forward."""
        self.blocks = blocks
        self.scales = scales
        self.placeholder = param.data
        """What the parameter holds between forwards: one value broadcast to its shape."""
        experts, rows, groups, _ = blocks.shape
        self.shape = (int(experts), int(rows), int(groups) * BLOCK)
        """``(experts, out, in)``."""

    @property
    def device(self) -> torch.device:
        """Where the blocks and scales are."""
        return self.blocks.device

    def nbytes(self) -> int:
        """Bytes the blocks and scales take (4.25 bits a weight)."""
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.scales))

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None, kernel: Any = None) -> torch.Tensor:
        """Every expert's weight ``[experts, out, in]`` in ``dtype``, written into ``out`` when
        given; ``kernel`` (the argument engine/quantized_experts.py's weights share): False for the
        torch way only (``trainer.fast_path.kernels`` off), else the Triton kernel where it runs."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype, out, kernel is not False)

    def window(self, dim: int, part: int, parts: int) -> tuple[int, int] | None:
        """Part ``part`` of ``parts`` equal parts of every expert's output rows (``dim`` is always
        the rows here: the dequantized layout is ``[experts, out, in]``), as :meth:`dequantize_window`
        takes it: ``(first row, rows)``; None where the rows do not split evenly."""
        rows = self.shape[1]
        if rows % parts:
            return None
        return part * rows // parts, rows // parts

    def dequantize_window(self, dtype: torch.dtype, out: torch.Tensor, window: tuple[int, int],
                          kernel: Any = None) -> torch.Tensor:
        """The rows of :meth:`window` ``window`` of every expert, ``[experts, rows, in]`` in ``dtype``,
        into ``out``; ``kernel`` as :meth:`dequantize` takes it."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype, out, kernel is not False, window)

    def parameter_weight(self, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The weights in the parameter's layout, ``[experts, in, out]`` contiguous, in ``dtype``:
        every expert's, or those of ``experts`` (indices on :attr:`device`) in that order, written
        through a transposed view."""
        blocks, scales = (self.blocks, self.scales) if experts is None else (self.blocks[experts], self.scales[experts])
        weight = torch.empty(blocks.shape[0], self.shape[2], self.shape[1], dtype=dtype, device=self.device)
        dequantize_mxfp4(blocks, scales, dtype, weight.transpose(1, 2))
        return weight


def mxfp4_experts(experts: nn.Module) -> dict[str, Mxfp4Experts]:
    """An experts module's MXFP4 projections by parameter name (empty where it holds none)."""
    return getattr(experts, _ATTRIBUTE, {})


def _keep(module: nn.Module, name: str, blocks: torch.Tensor, scales: torch.Tensor,
          param: nn.Parameter | None = None) -> nn.Parameter:
    """Record ``blocks`` and ``scales`` as ``module.<name>``'s weights and return the parameter that
    then holds the placeholder: ``param`` (the module's, its data freed) or, without it, a new
    frozen one of the module's parameter's shape and dtype (a load hands it to transformers)."""
    shape = getattr(module, name).shape
    e, rows, groups, _ = blocks.shape
    if (int(shape[0]), int(shape[2]), int(shape[1])) != (int(e), int(rows), int(groups) * BLOCK):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not hold a weight of the "
                         f"parameter's shape {tuple(shape)}")
    param = placeholder_parameter(param, shape, getattr(module, name).dtype, blocks.device)
    holders(module, _ATTRIBUTE)[name] = Mxfp4Experts(param, blocks, scales)
    return param


def attach(experts: nn.Module, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Keep ``experts``' projections as MXFP4 (``tensors``: parameter name -> its blocks and scales,
    on the module's device), freeing their dequantized data; transformers' forward keeps working on
    weights dequantized for it (engine/expert_weights.py)."""
    for name, (blocks, scales) in tensors.items():
        _keep(experts, name, blocks, scales, getattr(experts, name))


def converters_on_load(failures: dict[str, str]) -> list[Any]:
    """transformers' weight converters (5.x loading) that take each experts projection's
    ``<name>_blocks`` and ``<name>_scales`` from the checkpoint and keep them as shipped on the
    device the load puts the parameter on (:func:`attach`'s state), handing transformers the
    parameter with its placeholder: the projection is never dequantized, so a load holds no bf16
    expert weight. A failure is recorded in ``failures`` (parameter name -> the error) and raised:
    transformers logs a failed conversion and would initialize the weight at random."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    class KeepShipped(ConversionOps):
        """The checkpoint's blocks and scales of one projection, kept: its parameter's placeholder out."""

        def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None,
                    full_layer_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
            module_name, _, name = str(full_layer_name).rpartition(".")
            try:
                pair = []
                for suffix in SUFFIXES:
                    tensor = input_dict[f"{name}{suffix}"]
                    tensor = tensor[0] if isinstance(tensor, list) else tensor
                    # transformers casts each checkpoint tensor to the parameter's dtype on its way
                    # to the device; codes and exponents (bytes, 0 to 255) are exact in any float
                    pair.append(tensor.to(torch.uint8))
                return {full_layer_name: _keep(model.get_submodule(module_name), name, pair[0], pair[1])}
            except Exception as exc:
                failures[str(full_layer_name)] = f"{type(exc).__name__}: {exc}"
                raise

    return [WeightConverter([f"{name}{suffix}" for suffix in SUFFIXES], name, [KeepShipped()])
            for name in EXPERT_PARAMETERS]


def shipped_config(path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The config of the checkpoint at ``path`` without its quantization section when that says its
    experts ship in MXFP4 (``quantization_config.quant_method: mxfp4``: gpt-oss), so that a 4-bit
    load quantizes the rest with bitsandbytes and :func:`load_experts` keeps the experts as shipped
    (transformers would dequantize them all to bf16 without the Hub's kernels); None for any other
    checkpoint."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)) != "mxfp4":
        return None
    del config.quantization_config
    return config


def _files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the checkpoint in ``folder`` and the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in mapping.items()}
    from safetensors import safe_open

    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_experts(model: nn.Module, folder: str | Path, device: torch.device | None = None) -> int:
    """Attach the MXFP4 blocks and scales of the checkpoint in ``folder`` to every experts module of
    ``model`` that a load left without them (``<module>.gate_up_proj_blocks`` and the rest, by the
    module's name in the model), on ``device`` (default: where the module's parameters are), freeing
    the parameters transformers initialized. Returns the number of experts modules attached (0 when
    :func:`converters_on_load` kept them all during the load). ValueError naming the file and tensor
    a module lacks."""
    from safetensors import safe_open

    folder = Path(folder)
    files = _files(folder)
    done = 0
    for name, module in model.named_modules():
        if not all(isinstance(getattr(module, p, None), nn.Parameter) and getattr(module, p).dim() == 3
                   for p in EXPERT_PARAMETERS) or mxfp4_experts(module):
            continue
        tensors = {}
        for param in EXPERT_PARAMETERS:
            keys = [f"{name}.{param}{suffix}" for suffix in SUFFIXES]
            missing = [k for k in keys if k not in files]
            if missing:
                raise ValueError(f"{folder}: the checkpoint has no {', '.join(missing)} (its config says "
                                 "quant_method mxfp4); re-download the model or load it with quantization.bits: null")
            target = device or getattr(module, param).device
            pair = []
            for key in keys:
                with safe_open(str(files[key]), framework="pt", device="cpu") as f:
                    pair.append(f.get_tensor(key).to(target))
            tensors[param] = (pair[0], pair[1])
        attach(module, tensors)
        done += 1
    return done
