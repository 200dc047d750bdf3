"""4-bit expert weights lent to transformers' own forward of their experts module.

engine/quantized_experts.py's NF4/FP4 experts and engine/mxfp4.py's MXFP4 ones hold each projection
of every expert in 4 bits (a :class:`Lendable` holder); the module's parameter keeps a placeholder
of the weight's shape and dtype that owns no memory, where PEFT and transformers find it. The first
holder of a module replaces the module's forward by one that lends the class's own forward 16-bit
weights, in one of two ways:

- **the whole layer**: every expert's weight of each 4-bit projection is dequantized into the
  parameters, the class's forward runs, and the placeholders go back. With gradients on (the plain
  training path: autograd keeps what it saved of the weights until the backward), where PEFT's
  expert adapter parametrizes a parameter (``lora.target_experts``: its delta is added to the whole
  parameter, which must hold every expert), and under a CUDA graph capture (GRPO's decode step: a
  group is chosen on the host, which a capture cannot wait for);
- **a group of experts at a time** otherwise: without gradients (generation, chat, evaluation), the
  class's forward runs once for each group of the experts the tokens were routed to, on the
  (token, slot) pairs routed to the group, as rows of one slot each, while the module holds only
  the group's experts (their 4-bit projections dequantized, every other per-expert parameter, such as
  gpt-oss' biases, indexed alike, ``num_experts`` the group's size, which transformers' eager,
  grouped_mm and batched_mm forwards read). A group is as many experts as fit
  core/memory/expert_groups.py's ``EXPERT_GROUP_BYTES`` in 16 bits; a decoding step dequantizes only
  the few experts its tokens use. Each pair is computed once, and the outputs are summed into each
  token's row in fp32 and rounded once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from studio.core.memory.expert_groups import experts_per_group

_KINDS = "studio_expert_weight_kinds"
"""The experts module's attribute listing the attributes that hold its 4-bit projections (one a format)."""


class Lendable(Protocol):
    """A projection of every expert held in 4 bits (quantized_experts.py's ``PackedExperts``,
    mxfp4.py's ``Mxfp4Experts``)."""

    param: nn.Parameter
    """The module's parameter, holding :attr:`placeholder` between forwards."""
    placeholder: torch.Tensor
    """One value broadcast to the weight's shape, in its 16-bit dtype."""

    def parameter_weight(self, dtype: torch.dtype, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The weights of every expert, or of ``experts`` (indices on the holder's device) in that
        order, in ``dtype`` and in the parameter's layout (``[experts, ...]``, contiguous)."""
        ...


def placeholder_parameter(param: nn.Parameter | None, shape: torch.Size, dtype: torch.dtype,
                          device: torch.device) -> nn.Parameter:
    """``param`` (or a new frozen parameter) holding one value broadcast to ``shape``: PEFT and
    transformers see the weight's shape and dtype, and no 16-bit storage is kept."""
    placeholder = torch.zeros((), dtype=dtype, device=device).expand(shape)
    if param is None:
        return nn.Parameter(placeholder, requires_grad=False)  # the base is frozen; a gradient would be full size
    param.data = placeholder
    return param


def holders(module: nn.Module, attribute: str) -> dict[str, Any]:
    """The 4-bit holders of ``module`` by parameter name, kept in ``attribute``; the first call makes
    the dict, and the module's first holder of any format replaces its forward by the lending one
    (the module docstring)."""
    store = getattr(module, attribute, None)
    if store is None:
        store = {}
        setattr(module, attribute, store)
        kinds = module.__dict__.setdefault(_KINDS, [])
        if not kinds:
            module.forward = MethodType(_lending_forward, module)
        kinds.append(attribute)
    return store


def lent_weights(module: nn.Module) -> dict[str, Lendable]:
    """Every 4-bit projection of ``module`` by parameter name, of any format (empty for other modules)."""
    found: dict[str, Lendable] = {}
    for attribute in module.__dict__.get(_KINDS, ()):
        found.update(getattr(module, attribute))
    return found


def _lending_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The experts module's forward with its 4-bit projections lent: by groups of experts where
    that is possible, else the whole layer (the module docstring says when)."""
    forward = type(module).forward  # read per call: PEFT's parametrization swaps the module's class
    weights = lent_weights(module)
    if not weights:
        return forward(module, *args, **kwargs)
    routed = _routing(forward, module, args, kwargs)
    if routed is None or not _groups_apply(module, routed[0]):
        with _whole_layer(module, weights):
            return forward(module, *args, **kwargs)
    return _grouped(module, forward, weights, *routed)


@functools.cache
def _signature(forward: Any) -> inspect.Signature:
    """``forward``'s signature, read once per experts class (every layer's every forward asks)."""
    return inspect.signature(forward)


def _routing(forward: Any, module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...] | None:
    """The call's hidden states ``[tokens, hidden]``, expert indices ``[tokens, k]`` and routing weights
    ``[tokens, k]`` (transformers 5.x's experts forward takes them in this order; gpt-oss names them
    ``router_indices`` and ``routing_weights``); None where the call is not so."""
    try:
        bound = _signature(forward).bind(module, *args, **kwargs)
    except TypeError:
        return None
    values = list(bound.arguments.values())[1:]
    if len(values) != 3 or not all(torch.is_tensor(v) for v in values):
        return None
    hidden, index, weights = values
    if hidden.dim() != 2 or index.dim() != 2 or tuple(weights.shape) != tuple(index.shape):
        return None
    return hidden, index, weights


def _groups_apply(module: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether this forward may run a group of experts at a time (the module docstring)."""
    if torch.is_grad_enabled() or parametrize.is_parametrized(module) or not hasattr(module, "num_experts"):
        return False
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


@contextmanager
def _whole_layer(module: nn.Module, weights: dict[str, Lendable]) -> Iterator[None]:
    """Every expert's 16-bit weight in its parameter for one forward, the placeholders back after it."""
    try:
        for name, stored in weights.items():
            _put_weight(module, name, stored, stored.parameter_weight(stored.placeholder.dtype))
        yield
    finally:
        for name, stored in weights.items():
            _put_placeholder(module, name, stored)


def _put_weight(module: nn.Module, name: str, stored: Lendable, weight: torch.Tensor) -> None:
    if parametrize.is_parametrized(module, name):  # PEFT's expert adapter: original + delta, a new tensor
        stored.param.data = weight
    else:
        # a parameter of its own for this forward: what autograd saves of it (gpt-oss' experts
        # multiply by the parameter itself) keeps the weight once the placeholder is back
        module._parameters[name] = nn.Parameter(weight, requires_grad=False)


def _put_placeholder(module: nn.Module, name: str, stored: Lendable) -> None:
    if parametrize.is_parametrized(module, name):
        stored.param.data = stored.placeholder
    else:
        module._parameters[name] = stored.param


def _grouped(module: nn.Module, forward: Any, weights: dict[str, Lendable], hidden: torch.Tensor,
             index: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """The experts' output ``[tokens, hidden]``, the class's ``forward`` run on one group of the
    experts hit at a time (the module docstring)."""
    experts = int(module.num_experts)
    k = index.shape[1]
    flat = index.reshape(-1)
    # the pairs by expert, each expert's in token order (as the class's own forward takes them);
    # indices past the experts (transformers' sentinel for another rank's expert) sort last, unused
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(0, experts), minlength=experts + 1)[:experts].tolist()
    hit = [(e, n) for e, n in enumerate(counts) if n]
    dtype = next(iter(weights.values())).placeholder.dtype
    expert_bytes = sum(w.placeholder[0].numel() for w in weights.values()) * dtype.itemsize
    size = experts_per_group(expert_bytes)
    total = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    start = 0
    for first in range(0, len(hit), size):
        group = hit[first:first + size]
        rows = sum(n for _, n in group)
        pairs = order[start:start + rows]
        start += rows
        tokens = torch.div(pairs, k, rounding_mode="floor")
        local = torch.repeat_interleave(torch.arange(len(group), device=index.device),
                                        torch.tensor([n for _, n in group], device=index.device), output_size=rows)
        chosen = torch.tensor([e for e, _ in group], device=index.device)
        with _holding(module, weights, chosen, experts):
            out = forward(module, hidden[tokens], local.to(index.dtype)[:, None],
                          routing.reshape(-1)[pairs][:, None])
        total.index_add_(0, tokens, out.float())
    return total.to(hidden.dtype)


@contextmanager
def _holding(module: nn.Module, weights: dict[str, Lendable], chosen: torch.Tensor, experts: int) -> Iterator[None]:
    """``module`` as if it had only the experts ``chosen`` (out of ``experts``), for one forward."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if name in weights:
                stored = weights[name]
                weight = stored.parameter_weight(stored.placeholder.dtype, chosen.to(stored.placeholder.device))
            elif param is not None and param.dim() and param.shape[0] == experts:  # per-expert: gpt-oss' biases
                weight = param.detach()[chosen.to(param.device)]
            else:
                continue
            module._parameters[name] = nn.Parameter(weight, requires_grad=False)
        module.num_experts = len(chosen)
        yield
    finally:
        module.num_experts = experts
        module._parameters.update(saved)
