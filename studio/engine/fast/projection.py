"""One fused projection of a decoder layer: the linears that read the same input (q/k/v, o,
gate/up, down), each with or without a PEFT LoRA adapter, run as one of products.py's products."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from studio.engine.fast import update
from studio.engine.fast.frozen import FrozenWeights, Workspace
from studio.engine.fast.products import (
    AdapterDropout,
    DeferredLoraProduct,
    KeptQKV,
    LoraProduct,
    SeparateLoraProduct,
)


def has_adapter(module: nn.Module, adapter: str) -> bool:
    """Whether ``module`` is a PEFT LoRA layer carrying ``adapter``."""
    return hasattr(module, "lora_A") and adapter in module.lora_A


class Projection:
    """Linears reading the same input (with or without a LoRA adapter each), as one product.

    ``kernels`` (the ``trainer.fast_path.kernels`` setting): 4-bit weights go through dequant.py's
    kernel, and where update.py's kernels run here (CUDA with Triton, half precision) the kernel
    that reads the product's output adds the update (:attr:`in_kernel`)."""

    def __init__(self, modules: Sequence[nn.Module], adapter: str, dtype: torch.dtype, workspace: Workspace,
                 kernels: bool = True, split: Sequence[int] | None = None):
        self.modules = list(modules)
        bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in modules]
        # split: the output widths of a module holding several projections (Phi-3's qkv_proj), which
        # :meth:`separately` returns apart; the frozen biases, where there are any, go with the weights.
        self.weights = FrozenWeights(bases, dtype, workspace, kernel=kernels, split=split)
        self.dtype = dtype
        adapted = [m for m in modules if has_adapter(m, adapter)]
        self.present = [has_adapter(m, adapter) for m in modules]
        self.a = [m.lora_A[adapter].weight for m in adapted]
        self.b = [m.lora_B[adapter].weight for m in adapted]
        self.scales = [float(m.scaling[adapter]) for m in adapted]
        drop = [m.lora_dropout[adapter] for m in adapted]
        self.dropout = [d.p if isinstance(d, nn.Dropout) else 0.0 for d in drop]
        self.ranks = [int(a.shape[0]) for a in self.a]
        self.drop: AdapterDropout | None = None
        self.in_kernel = kernels and update.available(bases[0].weight.device, dtype)
        """The update is added by the kernel that reads the base product's output (update.py): the
        residual's add for o and down (:class:`LoraProduct`), the gated activation for gate/up
        (:meth:`gated`); and down's LoRA input-gradient term goes to the activation's backward
        (:meth:`handoff`)."""

    def use_dropout(self, seed: torch.Tensor, first_site: int) -> None:
        """Give the adapters with dropout their masks: from ``seed``, at sites ``first_site + j``."""
        if any(self.dropout):
            sites = [first_site + j for j in range(len(self.a))]
            self.drop = AdapterDropout(self.dropout, sites, self.ranks, seed)

    def adapters(self, sink: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """The adapters as the fused product takes them: stacked A, block-diagonal B^T, scale.

        Built from the fp32 parameters through autograd, so their gradients flow back to each
        adapter; a projection without an adapter gets an empty block. ``sink`` maps the parameters
        to the tensors the products use in their place (graphs.py routes the gradients through it).
        """
        if not self.a:
            return None, None, 1.0
        a_params, b_params = self.a, self.b
        if sink is not None:
            used = sink([*self.a, *self.b])
            a_params, b_params = used[:len(self.a)], used[len(self.a):]
        a = torch.cat(a_params).to(self.dtype) if len(a_params) > 1 else a_params[0].to(self.dtype)
        # Scales folded into B when they differ (rare: per-module alpha); else passed as alpha.
        same = all(s == self.scales[0] for s in self.scales)
        adapted = iter(zip(b_params, self.scales, strict=True))
        bts = []
        for present, n in zip(self.present, self.weights.out_features, strict=True):
            if present:
                b, s = next(adapted)
                bts.append(b.t() if same else b.t() * s)
            else:
                bts.append(a.new_zeros(0, n))
        bt = (torch.block_diag(*bts) if len(bts) > 1 else bts[0]).to(self.dtype)
        return a, bt, self.scales[0] if same else 1.0

    def _dropout(self) -> AdapterDropout | None:
        """The adapters' dropout while the model trains (None in evaluation or without dropout)."""
        return self.drop if self.drop is not None and self.modules[0].training else None

    def __call__(self, x: torch.Tensor, adapters: tuple | None = None, value: bool = True,
                 residual: torch.Tensor | None = None, handoff: update.Handoff | None = None) -> torch.Tensor:
        """The fused output, plus ``residual`` when given (added inside the products: no pass of
        its own). With ``value=False`` only its backward is real (see :class:`LoraProduct`): the
        output is a zero that owns no memory, and the base product is skipped."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        return LoraProduct.apply(x, self.weights, a, bt, scale, self._dropout(), value, residual,
                                 self.in_kernel, handoff)

    def separately(self, x: torch.Tensor, adapters: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """Each projection's output as a tensor of its own (:class:`SeparateLoraProduct`: q, k, v;
        a fused module's by its ``split``)."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        return SeparateLoraProduct.apply(x, self.weights, a, bt, scale, self._dropout())

    def handoff(self) -> update.Handoff | None:
        """A :class:`~studio.engine.fast.update.Handoff` for this product's LoRA input-gradient term,
        where the kernel that made its input can take it (the gated activation before the down
        product): the update kernels on and no adapter dropout (its mask would have to go along).
        None otherwise."""
        if not self.in_kernel or not self.a or self._dropout() is not None or update.broken():
            return None
        return update.Handoff()

    def gated(self, x: torch.Tensor, adapters: tuple | None = None, handoff: update.Handoff | None = None,
              activation: str = "silu") -> torch.Tensor | None:
        """``act(gate) * up`` of this gate/up projection's output (``activation``: SiLU or GELU's tanh
        form, update.ACTIVATIONS), the update added inside the activation's kernel
        (update.LoraGated); None where that is off or cannot run (the caller then runs the product
        and an activation of its own). ``handoff``: the next product's (:meth:`handoff`), whose LoRA
        input-gradient term the activation's backward then adds."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        if not self.in_kernel or a is None or update.broken() or activation not in update.ACTIVATIONS:
            return None
        gu, xa = DeferredLoraProduct.apply(x, self.weights, a, bt, scale, self._dropout())
        split = None
        if len(self.present) == 2:  # gate's rows of the block-diagonal B^T first, then up's
            ranks = iter(self.ranks)
            r_gate = next(ranks) if self.present[0] else 0
            r_up = next(ranks) if self.present[1] else 0
            split = (0, r_gate, r_gate, r_up)
        # bt without its autograd history: the product's backward gives the adapters their gradients.
        done, act = update.KERNELS.attempt(lambda: update.LoraGated.apply(gu, xa, bt.detach(), scale, split,
                                                                         handoff, activation))
        return act if done else None

    def from_kept(self, x: torch.Tensor, kept: tuple, cos: torch.Tensor, sin: torch.Tensor, unrotate,
                  adapters: tuple | None = None) -> tuple:
        """A recomputation's q, k and v from the forward's kept copies (:class:`KeptQKV`): the values
        are ``kept``, the backward is the product's and, with ``unrotate``, RoPE's (None: ``kept``
        are the product's outputs, not rotated)."""
        a, bt, scale = adapters if adapters is not None else self.adapters()
        return KeptQKV.apply(x, self.weights, a, bt, scale, self._dropout(), tuple(kept), cos, sin, unrotate)
