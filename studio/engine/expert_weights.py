"""A 4-bit expert weight lent to transformers' own forward: the parameter holds a no-memory
placeholder, the 16-bit weight is put in it for one forward and the placeholder put back after it
(engine/quantized_experts.py's NF4/FP4 experts and engine/mxfp4.py's MXFP4 ones, whose holders both
keep ``param`` and ``placeholder``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize


def placeholder_parameter(param: nn.Parameter | None, shape: torch.Size, dtype: torch.dtype,
                          device: torch.device) -> nn.Parameter:
    """``param`` (or a new frozen parameter) holding one value broadcast to ``shape``: PEFT and
    transformers see the weight's shape and dtype, and no 16-bit storage is kept."""
    placeholder = torch.zeros((), dtype=dtype, device=device).expand(shape)
    if param is None:
        return nn.Parameter(placeholder, requires_grad=False)  # the base is frozen; a gradient would be full size
    param.data = placeholder
    return param


def holders(module: nn.Module, attribute: str, swap_in: Callable[..., None],
            swap_out: Callable[..., None]) -> dict[str, Any]:
    """The 4-bit holders of ``module`` by parameter name, kept in ``attribute``; the first call makes
    the dict and registers the hooks that lend the weights to each forward."""
    store = getattr(module, attribute, None)
    if not store:
        store = {}
        setattr(module, attribute, store)
        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out)
    return store


def put_weight(module: nn.Module, name: str, stored: Any, weight: torch.Tensor) -> None:
    """Give expert parameter ``name`` of ``module`` its 16-bit ``weight`` for one forward of
    transformers' own (``stored``: the 4-bit holder, quantized_experts.py's ``PackedExperts`` or mxfp4.py's,
    with the parameter and its placeholder)."""
    if parametrize.is_parametrized(module, name):  # PEFT's expert adapter: original + delta, a new tensor
        stored.param.data = weight
    else:
        # a parameter of its own for this forward: what autograd saves of it (gpt-oss' experts
        # multiply by the parameter itself) keeps the weight once the placeholder is back
        module._parameters[name] = nn.Parameter(weight, requires_grad=False)


def put_placeholder(module: nn.Module, name: str, stored: Any) -> None:
    """Undo :func:`put_weight` after the forward: the parameter holds its no-memory placeholder again."""
    if parametrize.is_parametrized(module, name):
        stored.param.data = stored.placeholder
    else:
        module._parameters[name] = stored.param
