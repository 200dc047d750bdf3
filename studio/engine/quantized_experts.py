"""A mixture of experts' 3-D expert weights stored in 4 bits (NF4 or FP4, bitsandbytes' formats).

bitsandbytes' 4-bit loading quantizes ``nn.Linear`` modules only: transformers 5.x's experts
(``mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden]`` and ``down_proj [experts,
hidden, intermediate]``, plain 3-D parameters) would stay in 16 bits, which is most of a sparse model
(Qwen3-30B-A3B: 58 GB of its 61, 16 GB once packed). Each projection is packed in 4 bits as one
:class:`PackedExperts`: the packed values and one bitsandbytes ``QuantState`` for the whole
projection (double-quantized scales as ``quantization.double_quant`` says), so one dequantization
gives every expert's weight.

:func:`experts_packed_on_load` packs them while transformers loads the checkpoint: its 4-bit
quantizer, extended for the load, takes each experts module's projections as the ones to quantize,
and the step that would set a projection in 16 bits packs it instead. A quantizing load builds one
parameter at a time, so the device holds the packed model so far plus one projection in 16 bits,
twice over while transformers stacks the checkpoint's per-expert tensors and concatenates gate with
up (Qwen3-30B-A3B: 1.6 GB for gate/up, where one layer's experts are 1.2 GB and the model's 58),
never the model's 16-bit experts; the memory transformers reserves ahead of the load counts them
packed too. :func:`quantize_experts` packs a model already in memory (one built from its config,
or experts a load left in 16 bits).

The design keeps every job on the model working and frees the 16-bit memory:

- The parameter stays where transformers and PEFT look for it, with its shape and dtype, but holds a
  placeholder (one value broadcast to the shape: no memory). PEFT's ``target_parameters`` adapters
  attach to it as to any expert weight, and the adapter saved loads with ``PeftModel`` on the
  16-bit model too.
- transformers' own forward (chat, ``studio eval``, generation, the plain training path) gets the
  weights lent by engine/expert_weights.py's forward of the experts module: without gradients a
  group of experts in 16 bits at a time (:meth:`PackedExperts.parameter_weight` dequantizes just
  the group's blocks); with gradients, or an expert adapter, the whole layer's, put back after the
  module's forward. Autograd keeps what it saved of them until the backward (the plain path's
  cost; the fast path saves nothing of them).
- The fast path (engine/fast/moe.py) reads :class:`PackedExperts` itself and dequantizes one
  projection at a time into its shared workspace, right before the grouped product.
- Merged export loads the base unquantized from its checkpoint (engine/merge.py), as for dense
  models: nothing here is read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from studio.core.decoder.spec import EXPERT_PARAMETERS
from studio.engine.expert_weights import holders, placeholder_parameter

BLOCKSIZE = 64
"""Values per 4-bit block (one scale each): bitsandbytes' default, that of the dense layers."""
NESTED_BLOCKSIZE = 256
"""Scales per block of their 8-bit double quantization (bitsandbytes' choice)."""
_ATTRIBUTE = "studio_packed_experts"
"""The experts module's attribute holding its :class:`PackedExperts` by parameter name."""


class PackedExperts:
    """One projection of every expert in 4 bits: ``[experts, out, in]`` values packed two a byte,
    and the bitsandbytes ``QuantState`` (block scales, code, block size) that dequantizes them."""

    def __init__(self, param: nn.Parameter, packed: torch.Tensor, state: Any):
        self.param = param
        """The model's parameter (now the placeholder), lent weights for each forward."""
        self.packed = packed
        """bitsandbytes' uint8 storage ``[experts x out x in / 2, 1]``."""
        self.quant_state = state
        """bitsandbytes' ``QuantState`` of the whole projection (shape ``[experts, out, in]``)."""
        self.shape = tuple(int(n) for n in state.shape)
        self.placeholder = param.data
        """What the parameter holds between forwards: one value broadcast to the shape."""

    @property
    def quant_type(self) -> str:
        """``nf4`` or ``fp4``."""
        return str(self.quant_state.quant_type)

    def nbytes(self) -> int:
        """Bytes the packed values and their quantization state (scales, code tables) take."""
        tensors, state = [self.packed], self.quant_state
        while state is not None:
            tensors += [t for t in (state.absmax, state.code, state.offset) if torch.is_tensor(t)]
            state = state.state2
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None, kernel: Any = None) -> torch.Tensor:
        """Every expert's weight ``[experts, out, in]`` in ``dtype``, written into ``out`` when given
        (a contiguous tensor of that shape); ``kernel``: engine/fast/dequant.py's NF4 kernel for it."""
        from studio.engine.fast.frozen import dequantize_packed

        if out is None:
            out = torch.empty(self.shape, dtype=dtype, device=self.packed.device)
        dequantize_packed(self.packed, self.quant_state, out, kernel)
        return out

    def window(self, dim: int, part: int, parts: int) -> tuple[int, int, int] | None:
        """Part ``part`` of ``parts`` equal parts of dimension ``dim`` (1 or 2) of every expert's
        stored weight, as engine/fast/dequant.py's kernel takes a window of the stored values:
        ``(row_values, first_value, values)``; None where the parts do not fall on whole blocks."""
        experts, a, b = self.shape
        row_values = a * b if dim == 1 else b
        values = row_values // parts
        if row_values % parts or values % int(self.quant_state.blocksize):
            return None
        return row_values, part * values, values

    def dequantize_window(self, dtype: torch.dtype, out: torch.Tensor, window: tuple[int, int, int],
                          kernel: Any = None) -> torch.Tensor:
        """The values of :meth:`window` ``window`` of every row in ``dtype``, into ``out`` (contiguous,
        ``row_values / values`` times smaller than the weight), through ``kernel`` where given and
        working, else bitsandbytes on the window's bytes and scales (gathered first)."""
        from studio.engine.fast import dequant

        if kernel is not None:
            done, _ = dequant.KERNELS.attempt(lambda: kernel(self.packed, out, window))
            if done:
                return out
        row_values, first, values = window
        rows = self.packed.numel() * 2 // row_values
        return self._gathered(rows, row_values, slice(None), slice(first, first + values), out)

    def _gathered(self, rows: int, row_values: int, chosen_rows: Any, columns: slice,
                  out: torch.Tensor) -> torch.Tensor:
        """``out`` (its shape: the gathered values') from part of the stored values through
        bitsandbytes: seen as ``rows`` rows of ``row_values``, the rows ``chosen_rows`` (indices or a
        slice) and, of each, the values ``columns`` (whole blocks), their bytes and expanded block
        scales gathered first."""
        import bitsandbytes.functional as bnbf

        from studio.engine.fast.frozen import dequantize_packed, expanded_absmax

        state, blocksize = self.quant_state, int(self.quant_state.blocksize)
        packed = self.packed.view(rows, row_values // 2)[chosen_rows][
            :, columns.start // 2:columns.stop // 2].reshape(-1, 1)
        absmax = expanded_absmax(state).view(rows, row_values // blocksize)[chosen_rows][
            :, columns.start // blocksize:columns.stop // blocksize].reshape(-1)
        sub = bnbf.QuantState(absmax=absmax, shape=out.shape, dtype=state.dtype, blocksize=blocksize,
                              code=state.code, quant_type=state.quant_type)
        dequantize_packed(packed, sub, out)
        return out

    def parameter_weight(self, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The weights ``[experts, out, in]`` (the parameter's layout) in ``dtype``: every expert's, or
        those of ``experts`` (indices on the packed values' device) in that order. An expert's values
        fill whole blocks where ``out x in`` is a multiple of :data:`BLOCKSIZE` (:func:`_quantize`), so
        only its bytes and scales are read (double-quantized scales expanded first, a 16th of a byte a
        value); otherwise every expert is dequantized and the chosen ones taken."""
        if experts is None:
            return self.dequantize(dtype)
        total, rows, width = self.shape
        if (rows * width) % BLOCKSIZE:
            return self.dequantize(dtype)[experts]
        out = torch.empty(len(experts), rows, width, dtype=dtype, device=self.packed.device)
        return self._gathered(total, rows * width, experts, slice(0, rows * width), out)


def packed_experts(experts: nn.Module) -> dict[str, PackedExperts]:
    """An experts module's 4-bit projections by parameter name (empty where it holds 16-bit ones)."""
    return getattr(experts, _ATTRIBUTE, {})


def _is_experts(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3
               for n in EXPERT_PARAMETERS)


def _quantize(param: torch.Tensor, quant_type: str, double_quant: bool) -> tuple[torch.Tensor, Any]:
    """``param [experts, out, in]`` in 4 bits, one expert at a time, as one packed tensor and state.
    Each expert's values fill whole blocks (``out x in`` a multiple of :data:`BLOCKSIZE`), so the
    concatenation is bitsandbytes' quantization of the whole tensor without its temporaries."""
    import bitsandbytes.functional as bnbf

    experts = param.shape[0]
    per_expert = param[0].numel()
    if per_expert % BLOCKSIZE:  # blocks would straddle experts: quantize it whole
        chunks = [param.detach().reshape(1, -1)]
    else:
        chunks = [param[e].detach().reshape(1, -1) for e in range(experts)]
    packed, scales = [], []
    for chunk in chunks:
        values, absmax = torch.ops.bitsandbytes.quantize_4bit.default(chunk.contiguous(), BLOCKSIZE, quant_type,
                                                                      torch.uint8)
        packed.append(values.reshape(-1))
        scales.append(absmax.reshape(-1))
    packed_all = torch.cat(packed).reshape(-1, 1)
    absmax = torch.cat(scales)
    code = bnbf.get_4bit_type(quant_type, device=param.device)
    common = dict(shape=param.shape, dtype=param.dtype, blocksize=BLOCKSIZE, code=code, quant_type=quant_type)
    if not double_quant:
        return packed_all, bnbf.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    nested, state2 = bnbf.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
    return packed_all, bnbf.QuantState(absmax=nested, offset=offset, state2=state2, **common)


def _pack(module: nn.Module, name: str, values: torch.Tensor, quant_type: str, double_quant: bool,
          param: nn.Parameter | None = None) -> nn.Parameter:
    """Pack ``values`` (the 16-bit ``[experts, out, in]`` weights of ``module.<name>``) and record
    them on ``module``. ``param`` (the module's parameter, when it holds them) then holds the
    placeholder; without it a new frozen parameter does. Returns that parameter."""
    with torch.no_grad():
        packed, state = _quantize(values, quant_type, double_quant)
    param = placeholder_parameter(param, values.shape, values.dtype, values.device)
    holders(module, _ATTRIBUTE)[name] = PackedExperts(param, packed, state)
    return param


def quantize_experts(model: nn.Module, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Store every experts module's 3-D weights of ``model`` still in 16 bits in 4 bits
    (``quant_type`` nf4 or fp4, the scales double-quantized when ``double_quant``), freeing their
    16-bit tensors; transformers' forward keeps working on weights dequantized for it (the module
    docstring). Returns the number of experts modules it packed (0 for a dense model, or where the
    load packed them all)."""
    done = 0
    for module in model.modules():
        names = [n for n in EXPERT_PARAMETERS if n not in packed_experts(module)]
        if not _is_experts(module) or not names:
            continue
        for name in names:
            param = getattr(module, name)
            _pack(module, name, param.data, quant_type, double_quant, param)
        done += 1
    return done


@dataclass
class ExpertsLoad:
    """What :func:`experts_packed_on_load` did during one load."""

    failures: dict[str, str] = field(default_factory=dict)
    """Expert parameters whose packing (or keeping as MXFP4) failed (``model.layers.1.mlp.experts.gate_up_proj``), with
    the error. transformers logs such a failure and
    goes on, initializing the parameter at random: a load with failures must not be used."""


_LOADING = threading.Lock()
"""One load at a time swaps transformers' 4-bit quantizer (:func:`experts_packed_on_load`)."""


@contextmanager
def experts_packed_on_load() -> Iterator[ExpertsLoad]:
    """While open, a ``from_pretrained`` with a 4-bit ``BitsAndBytesConfig`` also packs every
    experts module's projections as the checkpoint's tensors arrive, in the config's quant type
    and double quantization (the module docstring), or keeps those the checkpoint ships as MXFP4
    blocks and scales so (gpt-oss: engine/mxfp4.py's ``converters_on_load``); yields the
    :class:`ExpertsLoad` it fills.

    transformers builds its quantizer from a table by the config's method; for the duration of the
    load the 4-bit entry is a subclass of bitsandbytes' quantizer, so the model, its config and its
    quantizer look as after any 4-bit load (``quant_method`` bitsandbytes, ``is_loaded_in_4bit``).
    Where the table or the hooks it uses (``param_needs_quantization``, ``get_quantize_ops``,
    transformers 5.x) are missing, nothing is packed on load and the record stays empty."""
    record = ExpertsLoad()
    try:
        from transformers.quantizers import auto
    except ImportError:
        yield record
        return
    with _LOADING:
        original = auto.AUTO_QUANTIZER_MAPPING.get("bitsandbytes_4bit")
        if original is None or not hasattr(original, "get_quantize_ops"):
            yield record
            return
        auto.AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"] = _packing_quantizer(original, record)
        try:
            yield record
        finally:
            auto.AUTO_QUANTIZER_MAPPING["bitsandbytes_4bit"] = original


def _expert_parameter(model: nn.Module, name: str) -> tuple[nn.Module, str] | None:
    """(experts module, parameter name) where ``name`` is a projection of an experts module."""
    module_name, _, attr = name.rpartition(".")
    if attr not in EXPERT_PARAMETERS:
        return None
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return (module, attr) if _is_experts(module) else None


def _packing_quantizer(base: type, record: ExpertsLoad) -> type:
    """``base`` (transformers' bitsandbytes 4-bit quantizer) extended to pack expert projections."""
    from transformers.core_model_loading import ConversionOps

    from studio.engine.mxfp4 import converters_on_load, mxfp4_experts

    class PackExperts(ConversionOps):
        """bitsandbytes' quantize step for linear weights; packing for expert projections."""

        def __init__(self, quantizer: Any, linear_op: ConversionOps):
            self.quantizer = quantizer
            self.linear_op = linear_op

        def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None, **kwargs: Any) -> dict[str, Any]:
            config = self.quantizer.quantization_config
            experts = {k: v for k, v in input_dict.items() if _expert_parameter(model, k)}
            rest = {k: v for k, v in input_dict.items() if k not in experts}
            out = self.linear_op.convert(rest, model=model, **kwargs) if rest else {}
            for name, values in experts.items():
                module, attr = _expert_parameter(model, name)
                values = values[0] if isinstance(values, list) else values
                if attr in mxfp4_experts(module):  # kept as the checkpoint ships it: the placeholder
                    out[name] = values
                    continue
                try:
                    out[name] = _pack(module, attr, values, config.bnb_4bit_quant_type,
                                      config.bnb_4bit_use_double_quant)
                except Exception as exc:
                    record.failures[name] = f"{type(exc).__name__}: {exc}"
                    raise
            return out

    class PackingBnb4Bit(base):
        """bitsandbytes' 4-bit quantizer that also packs expert projections as they load."""

        def param_needs_quantization(self, model: Any, param_name: str, **kwargs: Any) -> bool:
            return (super().param_needs_quantization(model, param_name, **kwargs)
                    or _expert_parameter(model, param_name) is not None)

        def get_quantize_ops(self) -> ConversionOps:
            return PackExperts(self, super().get_quantize_ops())

        def get_weight_conversions(self) -> list[Any]:
            # a checkpoint shipping its experts in MXFP4 (gpt-oss) has them kept so as they load
            return list(super().get_weight_conversions()) + converters_on_load(record.failures)

    return PackingBnb4Bit
