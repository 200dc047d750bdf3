"""A 4-bit expert weight lent to transformers' own forward: the 16-bit weight put in the parameter for
one forward, the no-memory placeholder put back after it (engine/quantized_experts.py's NF4/FP4
experts and engine/mxfp4.py's MXFP4 ones, whose holders both keep ``param`` and ``placeholder``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize


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
