"""A mixture of experts' 3-D expert weights stored in 4 bits (NF4 or FP4, bitsandbytes' formats).

bitsandbytes' 4-bit loading quantizes ``nn.Linear`` modules only: transformers 5.x's experts
(``mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden]`` and ``down_proj [experts,
hidden, intermediate]``, plain 3-D parameters) stay in 16 bits, which is most of a sparse model
(Qwen3-30B-A3B: 58 GB of its 61). :func:`quantize_experts` packs each of them in 4 bits after the
load, expert by expert (the temporaries are one expert's), as one :class:`PackedExperts`: the
packed values and one bitsandbytes ``QuantState`` for the whole projection (double-quantized scales
as ``quantization.double_quant`` says), so one dequantization gives every expert's weight.

The design keeps every job on the model working and frees the 16-bit memory:

- The parameter stays where transformers and PEFT look for it, with its shape and dtype, but holds a
  placeholder (one value broadcast to the shape: no memory). PEFT's ``target_parameters`` adapters
  attach to it as to any expert weight, and the adapter saved loads with ``PeftModel`` on the
  16-bit model too.
- transformers' own forward (chat, ``studio eval``, generation, the plain training path) runs with a
  hook on the experts module that dequantizes its two projections into the parameters before the
  module's forward and puts the placeholder back after it: one layer's experts in 16 bits at a time.
  Autograd keeps what it saved of them until the backward (the plain path's cost; the fast path
  saves nothing of them).
- The fast path (engine/fast/moe.py) reads :class:`PackedExperts` itself and dequantizes one
  projection at a time into its shared workspace, right before the grouped product.
- Merged export loads the base unquantized from its checkpoint (engine/merge.py), as for dense
  models: nothing here is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from studio.core.decoder.spec import EXPERT_PARAMETERS

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
        """The model's parameter (now the placeholder), whose data the forward hook swaps."""
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


def _swap_in(module: nn.Module, _args: Any) -> None:
    for name, packed in packed_experts(module).items():
        weight = packed.dequantize(packed.placeholder.dtype)
        if parametrize.is_parametrized(module, name):  # PEFT's expert adapter: original + delta, a new tensor
            packed.param.data = weight
        else:
            # a parameter of its own for this forward: what autograd saves of it (gpt-oss' experts
            # multiply by the parameter itself) keeps the weight once the placeholder is back
            module._parameters[name] = nn.Parameter(weight, requires_grad=False)


def _swap_out(module: nn.Module, _args: Any, _output: Any) -> None:
    for name, packed in packed_experts(module).items():
        if parametrize.is_parametrized(module, name):
            packed.param.data = packed.placeholder
        else:
            module._parameters[name] = packed.param


def quantize_experts(model: nn.Module, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Store every experts module's 3-D weights of ``model`` in 4 bits (``quant_type`` nf4 or fp4,
    the scales double-quantized when ``double_quant``), freeing their 16-bit tensors; transformers'
    forward keeps working through a dequantizing hook (the module docstring). Returns the number of
    experts modules quantized (0 for a dense model)."""
    done = 0
    for module in model.modules():
        if not _is_experts(module) or packed_experts(module):
            continue
        store = {}
        for name in EXPERT_PARAMETERS:
            param = getattr(module, name)
            with torch.no_grad():
                packed, state = _quantize(param.data, quant_type, double_quant)
            # One value broadcast to the shape: PEFT and transformers see the parameter's shape and
            # dtype, and the 16-bit storage is freed.
            param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
            store[name] = PackedExperts(param, packed, state)
        setattr(module, _ATTRIBUTE, store)
        module.register_forward_pre_hook(_swap_in)
        module.register_forward_hook(_swap_out)
        done += 1
    return done
