"""A mixture-of-experts MLP as the fast path runs it: the router, the tokens sorted by expert, one
grouped product per projection, and the routing weights applied in the activation's pass.

transformers 5.x stores a sparse layer's experts as two 3-D parameters of one module
(``mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden]``, gate's rows first, and
``mlp.experts.down_proj [experts, hidden, intermediate]``; gpt-oss' ``[experts, in, out]``, gate and
up interleaved, with a bias each) and loops over the experts in Python.
Here each token's ``top_k`` copies are sorted by expert, so every expert's tokens are one run of
rows, and each projection is one grouped product over those runs (:class:`Groups`): torch's
``grouped_mm`` where it takes the operands (bf16 on a CUDA card of compute capability 8.0 or more;
the CPU build's kernel in any float dtype, for 16-byte aligned strides), else one product per
expert, a loop used on the CPU and for fp16 / fp32 on CUDA only. Experts a 4-bit load packed
(engine/quantized_experts.py) are dequantized one projection at a time (gate/up in two halves of its
output features, :data:`PARTS`), every expert at once, into the model's shared workspace right
before the product that reads them (:class:`ExpertWeights`);
gpt-oss' MXFP4 experts, kept as the checkpoint ships them (engine/mxfp4.py), the same way. For few
rows an expert, stored_experts.py's products read 4-bit experts as stored (gate/up whole) instead.

LoRA on the experts is PEFT's ``target_parameters`` adapter (``lora.ParamWrapper``: one A and one
B per expert, stacked in ``lora_A [r x experts, in]`` and ``lora_B [out, r x experts]``), so an
adapter trained here loads with ``PeftModel``. The router is frozen; its input still gets the
gradient that flows through the routing weights, as in transformers.

engine/fast/routing.py's ``RouterLog`` keeps each sparse layer's routing of the micro-batch: the
tokens each expert took (logged per step) and, when the load-balancing loss is on, the router's
probabilities summed per expert, from which it computes transformers' ``load_balancing_loss_func``.

Routing sorts each token's ``top_k`` copies by expert with a one-byte key (routing.py's
``key_dtype``) and finds each expert's rows by a binary search of the sorted keys
(:meth:`SparseMlp.sort`). A checkpointed layer's forward keeps that routing for its recomputation in
the backward (routing.py's ``KeptRouting``), which runs the router's product and weights again but
neither its top-k nor the sort. Each token's copies move into expert order and back through
engine/fast/expert_copies.py, and the experts' activation times the routing weight runs in
engine/fast/expert_activation.py's kernel.

Nothing in a layer's forward or backward reads a value back to the host where the grouped kernel
takes the operands (the sort and the offsets are device tensors of a shape fixed by the token
count), so a CUDA graph captures the layer; the counts go into fixed tensors the replay writes. The
per-expert loop reads each expert's bounds on the host: eager steps only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from studio.core.decoder import MoeSpec
from studio.engine.fast import dequant, expert_activation, expert_copies, stored_experts
from studio.engine.fast.expert_activation import RoutedActivation
from studio.engine.fast.expert_copies import Combine, Gather
from studio.engine.fast.frozen import Workspace
from studio.engine.fast.routing import KeptRouting, RouterLog, key_dtype
from studio.engine.mxfp4 import Mxfp4Experts, mxfp4_experts
from studio.engine.quantized_experts import PackedExperts, packed_experts

_KERNEL = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
"""torch's grouped product (``torch.nn.functional.grouped_mm`` from 2.10, ``torch._grouped_mm``
before), or None in a build without one."""


PARTS = {"gate_up_proj": 2}
"""Parts a projection's 4-bit experts are dequantized in, each followed by its own grouped
product (its output features; its share of the backward's input gradient, summed). Gate/up has
twice down's features: in halves, the shared workspace holds as much as down's weights (the
experts' ``experts x intermediate x hidden``), not twice that (gpt-oss-20b: 0.53 GB less; Mixtral-8x7B:
0.94 GB). NF4/FP4 experts where the halves fall on whole blocks, and gpt-oss' MXFP4 ones."""


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s address and its non-unit strides are multiples of 16 bytes (the kernel's rule)."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s, n in zip(t.stride(), t.shape, strict=True)
                                           if s != 1 and n > 1)


def grouped_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's grouped product runs in ``dtype`` on ``device``, alignment aside: bf16 on
    a CUDA card of compute capability 8.0 or more, any float dtype on the CPU."""
    if _KERNEL is None:
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def kernel_takes(*operands: torch.Tensor) -> bool:
    """Whether torch's grouped product runs on these operands (:data:`_KERNEL`'s rules)."""
    return grouped_products(operands[0].dtype, operands[0].device) and all(_aligned(t) for t in operands)


class Groups:
    """Rows sorted by expert: expert ``e``'s rows are ``offs[e - 1]:offs[e]``. Products over each
    expert's rows, as one grouped product or (where the kernel does not take them) a loop."""

    def __init__(self, offs: torch.Tensor, loop: bool = False):
        self.offs = offs
        """Where each expert's rows end ``[experts]`` (int32, as the kernel takes them)."""
        self.loop = loop
        """Always the per-expert loop (the reference the kernel is tested against)."""
        self._bounds: list[tuple[int, int]] | None = None

    def bounds(self) -> list[tuple[int, int]]:
        """Each expert's first and past-last row (a host sync, once)."""
        if self._bounds is None:
            if self.offs.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the grouped product does not take these operands (bf16 on a compute "
                                   "capability 8.0+ card, 16-byte aligned: a LoRA rank that is a multiple of 8), "
                                   "and the loop over experts cannot be captured in a CUDA graph")
            ends = self.offs.tolist()
            self._bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        return self._bounds

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x[rows of e] @ w[e]`` for every expert: ``x [rows, k]``, ``w [experts, k, n]`` -> ``[rows, n]``."""
        if not self.loop and kernel_takes(x, w):
            return _KERNEL(x, w, offs=self.offs)
        out = x.new_zeros(x.shape[0], w.shape[2])
        for e, (start, end) in enumerate(self.bounds()):
            if end > start:
                torch.mm(x[start:end], w[e], out=out[start:end])
        return out

    def outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a[rows of e]^T @ b[rows of e]`` for every expert: ``a [rows, m]``, ``b [rows, n]`` ->
        ``[experts, m, n]`` (zeros for an expert without rows): the weight gradients."""
        at = a.t()
        if not self.loop and kernel_takes(at, b):
            return _KERNEL(at, b, offs=self.offs)
        out = a.new_zeros(self.offs.shape[0], a.shape[1], b.shape[1])
        for e, (start, end) in enumerate(self.bounds()):
            if end > start:
                torch.mm(at[:, start:end], b[start:end], out=out[e])
        return out


class ExpertWeights:
    """One projection's frozen expert weights (a 3-D parameter of the model's experts module:
    ``[experts, out, in]``, or ``[experts, in, out]`` where ``transposed``: gpt-oss), read in the
    compute dtype: a 16-bit parameter as it is, stored ones (engine/quantized_experts.py's 4-bit
    ``PackedExperts``, engine/mxfp4.py's ``Mxfp4Experts``) dequantized into ``workspace`` on each
    read, which then holds one projection's weights until the next read of any weight."""

    def __init__(self, param: torch.Tensor, dtype: torch.dtype, packed: PackedExperts | Mxfp4Experts | None = None,
                 workspace: Workspace | None = None, kernel: bool = True, transposed: bool = False,
                 parts: int = 1):
        self.param = param
        self.dtype = dtype
        self.experts = int(param.shape[0])
        self.out_features, self.in_features = (int(n) for n in (param.shape[1:] if not transposed
                                                                else param.shape[:0:-1]))
        self.packed = packed
        """The stored weights, or None (16-bit)."""
        self.transposed = getattr(packed, "transposed", transposed) if packed is not None else transposed
        """What :meth:`stacked` reads (the parameter, or the stored weights dequantized) is laid out
        ``[experts, in, out]``; MXFP4's weights are ``[experts, out, in]`` whatever the parameter's."""
        self.workspace = workspace if packed is not None else None
        self.kernel: dequant.NF4Weight | bool | None = None
        """What the stored weights' ``dequantize`` takes as its kernel (``kernel``: the
        ``trainer.fast_path.kernels`` setting): dequant.py's NF4 kernel for packed weights, where it
        covers them; for MXFP4 ones the setting itself (engine/mxfp4.py's kernel where it runs)."""
        self.parts = 1
        """How many parts of the output features :meth:`stacked` dequantizes at a time (:data:`PARTS`)."""
        self._windows: list[tuple[int, int, int]] = []
        if packed is not None and parts > 1:
            # the output features are dimension 2 of a transposed layout [experts, in, out], else 1
            windows = [packed.window(2 if self.transposed else 1, p, parts) for p in range(parts)]
            width = self.out_features // parts * torch.empty((), dtype=dtype).element_size()
            if all(w is not None for w in windows) and self.out_features % parts == 0 and width % 16 == 0:
                self.parts, self._windows = parts, windows
        if packed is not None:
            assert workspace is not None, "stored experts need a workspace"
            workspace.reserve(self.experts * self.out_features * self.in_features // self.parts)
            if isinstance(packed, Mxfp4Experts):
                self.kernel = kernel
            elif isinstance(packed, PackedExperts) and kernel and dequant.supports(packed.quant_state, dtype) \
                    and dequant.available(packed.packed.device):
                self.kernel = dequant.NF4Weight(packed.quant_state, packed.packed.device)
        self.stored = stored_experts.reader(packed, dtype) if kernel and packed is not None else None
        """stored_experts.py's products over the stored 4-bit weights (``kernel``; CUDA, bf16 / fp16),
        for few rows an expert (:meth:`reads_stored`); None: the weights are always dequantized."""

    def reads_stored(self, rows: int, groups: Groups) -> bool:
        """Whether products over ``rows`` sorted rows read the stored 4-bit weights (:attr:`stored`; few
        rows an expert: stored_experts.worth_it), the whole output at once, instead of dequantizing them."""
        return self.stored is not None and not groups.loop and stored_experts.worth_it(rows, self.experts)

    def _window(self, part: int | None) -> tuple[int, int, int, int]:
        """The stored weight's window of output features ``part`` covers (all of them: None)."""
        n = self.out_features // self.parts if part is not None else self.out_features
        cols = (part * n if part is not None else 0, n)
        return self.stored.window(b=cols) if self.transposed else self.stored.window(a=cols)

    def product(self, x: torch.Tensor, groups: Groups, part: int | None = None, backward: bool = False
                ) -> torch.Tensor:
        """``x[rows of e] @ W_e^T`` for every expert over output features ``part`` (all: None), or
        with ``backward`` ``x[rows of e] @ W_e``, ``x`` over those features (the input's gradient)."""
        if self.reads_stored(x.shape[0], groups):
            run = self.stored.reduce_a if self.transposed != backward else self.stored.reduce_b
            done, y = stored_experts.KERNELS.attempt(lambda: run(x, groups.offs, self._window(part)))
            if done:
                return y
        if part is None and self.parts > 1:  # read whole, in parts after all (the kernels failed)
            n = self.out_features // self.parts
            if backward:
                return sum(self.product(x[:, p * n:][:, :n].contiguous(), groups, p, True) for p in range(self.parts))
            return torch.cat([self.product(x, groups, p) for p in range(self.parts)], dim=1)
        w = self.stacked(part)
        return groups.mm(x, w if backward else w.transpose(1, 2))

    def stacked(self, part: int | None = None) -> torch.Tensor:
        """Every expert's weight ``[experts, out, in]`` in the compute dtype (stored ones: in the
        workspace, valid until the next read; a transposed layout as a view); ``part``: only that
        part of the output features, ``[experts, out / parts, in]`` (:attr:`parts`)."""
        if self.packed is None:  # (in one part: only stored weights are read in parts)
            w = self.param.detach().to(self.dtype)
            return w.transpose(1, 2) if self.transposed else w
        out = self.out_features // self.parts if part is not None else self.out_features
        assert part is not None or self.parts == 1, "a weight read in parts is read one part at a time"
        rows, cols = (self.in_features, out) if self.transposed else (out, self.in_features)
        w = self.workspace.take(self.experts * rows, cols).view(self.experts, rows, cols)
        if part is not None and self.parts > 1:
            self.packed.dequantize_window(self.dtype, w, self._windows[part], self.kernel)
        else:
            self.packed.dequantize(self.dtype, w, self.kernel)
        return w.transpose(1, 2) if self.transposed else w


class ExpertProduct(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e^T + scale * x[rows of e] @ A_e^T @ B_e^T`` over the sorted
    rows, with a backward that reads the frozen weights again (nothing of them saved) and gives A
    and B their gradients with grouped products too. With ``value`` False only the backward is
    real: the output is a zero that owns no memory, and neither the weights' dequantization nor a
    product runs but ``x A^T``, which the backward reads (a recomputation whose output nothing
    reads: :class:`SparseMlp`). ``part``: only that part of the output features (a weight read in
    parts, :attr:`ExpertWeights.parts`; ``b`` that part's rows): :class:`SparseMlp` runs one product
    a part and hands the parts to the activation as they are, and autograd sums the parts' input
    gradients (an expert adapter's ``x A^T``, ``r`` columns, is computed once a part: under 1% of
    the products it sits beside)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: ExpertWeights, groups: Groups, a: torch.Tensor | None,
                b: torch.Tensor | None, scale: float, value: bool = True, part: int | None = None) -> torch.Tensor:
        out_features = weights.out_features // weights.parts if part is not None else weights.out_features
        xa = groups.mm(x, a.transpose(1, 2)) if a is not None else None
        if value:
            y = weights.product(x, groups, part)
            if xa is not None:
                y.add_(groups.mm(xa, b.transpose(1, 2)), alpha=scale)
        else:
            y = x.new_zeros(()).expand(x.shape[0], out_features)
        ctx.weights, ctx.groups, ctx.scale, ctx.part = weights, groups, scale, part
        ctx.save_for_backward(x if a is not None else None, xa, a, b)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, xa, a, b = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        dy = dy.contiguous()
        dx = ctx.weights.product(dy, groups, ctx.part, backward=True) if ctx.needs_input_grad[0] else None
        da = db = None
        if a is not None:
            dyb = groups.mm(dy, b)
            if dx is not None:
                dx.add_(groups.mm(dyb, a), alpha=scale)
            if ctx.needs_input_grad[3]:
                da = groups.outer(dyb, x).mul_(scale)
            if ctx.needs_input_grad[4]:
                db = groups.outer(dy, xa).mul_(scale)
        return dx, None, None, da, db, None, None, None


def _wrappers(experts: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The experts module under PEFT's ``ParamWrapper`` layers (nested, one per adapted parameter),
    and the wrappers by the parameter they adapt."""
    wrappers = {}
    while hasattr(experts, "parameter_name") and hasattr(experts, "base_layer"):
        wrappers[experts.parameter_name] = experts
        experts = experts.base_layer
    return experts, wrappers


def experts_base(experts: nn.Module) -> nn.Module:
    """The model's experts module under any PEFT ``ParamWrapper`` around it."""
    return _wrappers(experts)[0]


def experts_adapted(experts: nn.Module, adapter: str) -> bool:
    """Whether ``adapter`` adapts one of the experts' parameters."""
    return any(adapter in w.lora_A for w in _wrappers(experts)[1].values())


def expert_problem(experts: nn.Module, adapter: str) -> str:
    """Why a sparse layer's experts module cannot run here ('' when it can)."""
    base, wrappers = _wrappers(experts)
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(base, name, None)
        if not isinstance(param, torch.Tensor) or param.dim() != 3:
            return f"experts without a 3-D {name} (transformers 5.x stores them so)"
        if not param.dtype.is_floating_point:
            return f"quantized expert weights ({name}: {param.dtype})"
    if getattr(base, "has_bias", False) and not all(isinstance(getattr(base, f"{n}_bias", None), torch.Tensor)
                                                    for n in ("gate_up_proj", "down_proj")):
        return "experts whose has_bias is set without gate_up_proj_bias and down_proj_bias"
    for name, wrapper in wrappers.items():
        if adapter in getattr(wrapper, "lora_A", {}) and (getattr(wrapper, "merged", False)
                                                          or getattr(wrapper, "disable_adapters", False)):
            return f"an expert adapter that is merged or disabled ({name})"
    return ""


class ExpertProjection:
    """One projection of every expert (gate/up or down) with its PEFT adapter, if any: the
    adapters of engine/fast/projection.py's :class:`Projection` in the experts' stacked form."""

    def __init__(self, experts: nn.Module, name: str, adapter: str, dtype: torch.dtype,
                 workspace: Workspace | None = None, kernel: bool = True):
        base, wrappers = _wrappers(experts)
        stored = packed_experts(base).get(name) or mxfp4_experts(base).get(name)
        self.weights = ExpertWeights(getattr(base, name), dtype, stored, workspace, kernel,
                                     transposed=bool(getattr(base, "is_transposed", False)),
                                     parts=PARTS.get(name, 1))
        self.dtype = dtype
        bias = getattr(base, f"{name}_bias", None) if getattr(base, "has_bias", False) else None
        self.bias = bias.detach().to(dtype) if bias is not None else None
        """Each expert's frozen bias ``[experts, out]`` in the compute dtype (gpt-oss), or None."""
        wrapper = wrappers.get(name)
        present = wrapper is not None and adapter in wrapper.lora_A
        self.a = [wrapper.lora_A[adapter].weight] if present else []
        """PEFT's ``lora_A [r x experts, in]`` (one entry), or none."""
        self.b = [wrapper.lora_B[adapter].weight] if present else []
        """PEFT's ``lora_B [out, r x experts]`` (one entry), or none."""
        self.scale = float(wrapper.scaling[adapter]) if present else 1.0
        self.dropout = [0.0] * len(self.a)
        """PEFT's ParamWrapper takes no adapter dropout."""

    def use_dropout(self, seed: torch.Tensor, first_site: int) -> None:
        """Nothing to do: expert adapters have no dropout (:attr:`dropout`)."""

    def adapters(self, sink=None) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """``(A [experts, r, in], B [experts, out, r], scale)`` from PEFT's weights through
        autograd (``sink`` as :meth:`Projection.adapters` takes it); (None, None, 1.0) without one.
        PEFT's layout: expert e's A is rows ``e*r:(e+1)*r`` of lora_A, its B the columns
        ``j*experts + e`` of lora_B (``ParamWrapper.get_delta_weight``)."""
        if not self.a:
            return None, None, 1.0
        a, b = (sink([*self.a, *self.b]) if sink is not None else (self.a[0], self.b[0]))
        w = self.weights
        a = a.to(self.dtype).view(w.experts, -1, w.in_features)
        b = b.to(self.dtype).view(w.out_features, -1, w.experts).permute(2, 0, 1).contiguous()
        return a, b, self.scale


class SparseMlp:
    """A sparse layer's MLP: router, experts' gate/up and down (:class:`ExpertProjection`), the
    gated activation (SiLU, or gpt-oss' clamped SwiGLU) with the routing weight in the same pass,
    and the weighted sum of each token's experts summed back into its row."""

    def __init__(self, router: torch.Tensor, gate_up: ExpertProjection, down: ExpertProjection, spec: MoeSpec,
                 log: RouterLog, index: int, loop: bool = False, router_bias: torch.Tensor | None = None,
                 kernels: bool = True):
        self.router = router
        """The router's weight ``[experts, hidden]`` (frozen)."""
        self.router_bias = router_bias
        """The router's bias ``[experts]`` (frozen: gpt-oss), or None."""
        self.gate_up = gate_up
        self.down = down
        self.spec = spec
        self.log = log
        self.index = index
        """This layer's place in the stack (its :class:`RouterLog` entry)."""
        self.loop = loop
        """Products by the per-expert loop whatever the kernel takes (tests)."""
        self.kernels = kernels
        """The activation and the sums of each token's copies run in Studio's kernels where they can
        (engine/fast/expert_activation.py, expert_copies.py; the ``trainer.fast_path.kernels``
        setting); False: in torch's operations."""
        self._experts = torch.arange(spec.experts, dtype=key_dtype(spec.experts), device=router.device)
        """Every expert's index as a sort key: where each expert's sorted rows end is where these
        fall among the sorted keys (:meth:`sort`)."""

    def route(self, x2: torch.Tensor, chosen: torch.Tensor | None = None, probs: bool = True
              ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The router's probabilities over every expert ``[tokens, experts]`` (fp32; None where
        ``probs`` is off and the routing does not compute them), and each token's top-k experts
        and weights ``[tokens, k]``, as transformers' routers compute them (:attr:`MoeSpec.routing`).
        ``chosen``: the experts a forward chose (a recomputation's), taken instead of a top-k.

        The top-k gives only the experts (outside autograd); the weights are gathered from what it
        ranked, under autograd, in a forward and its recomputation alike: both save the same tensors
        for the backward (torch's checkpointing pairs them one by one), and the gather's backward is
        the top-k's (the gradient scattered back to the chosen experts)."""
        bias = self.router_bias.to(x2.dtype) if self.router_bias is not None else None
        logits = F.linear(x2, self.router.to(x2.dtype), bias)
        k = self.spec.top_k
        if self.spec.routing == "topk_softmax":
            if chosen is None:
                chosen = torch.topk(logits.detach(), k, dim=-1).indices
            weights = torch.softmax(logits.gather(-1, chosen), dim=-1, dtype=torch.float32)
            every = torch.softmax(logits, dim=-1, dtype=torch.float32) if probs else None
            return every, chosen, weights.to(x2.dtype)
        every = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if chosen is None:
            chosen = torch.topk(every.detach(), k, dim=-1).indices
        weights = every.gather(-1, chosen)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return every, chosen, weights.to(x2.dtype)

    def sort(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token copy's expert as a sort key (``chosen`` flattened: copy ``t x top_k + j`` is
        token t's j-th), the copies in expert order (int64; stable, so each expert's rows keep
        token order) and where each expert's rows end (int32, what the grouped kernel takes): a
        one-byte radix sort and a binary search of the sorted keys, on the device (bincount would
        read its input's maximum back to the host on CUDA)."""
        keys = chosen.reshape(-1).to(self._experts.dtype)
        sorted_keys, order = torch.sort(keys, stable=True)
        offs = torch.searchsorted(sorted_keys, self._experts, right=True, out_int32=True)
        return keys, order, offs

    def activate(self, gu: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation of gate/up's output (gate's columns first, or alternating
        with up's: :attr:`MoeSpec.interleaved`)."""
        spec = self.spec
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if spec.interleaved else gu.chunk(2, dim=-1)
        if spec.activation == "clamped_swiglu":
            gate = gate.clamp(max=spec.swiglu_limit)
            up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
            return gate * torch.sigmoid(gate * spec.swiglu_alpha) * (up + 1)
        return F.silu(gate) * up

    def activated(self, parts: list[torch.Tensor], weight: torch.Tensor, expert: torch.Tensor | None
                  ) -> torch.Tensor:
        """The experts' gated activation of gate/up's output, in ``parts`` of its output features
        (``[rows, 2 x width / parts]`` each, :attr:`ExpertWeights.parts`), gate/up's bias of each
        row's ``expert`` added first (gpt-oss), times each row's routing weight ``weight [rows]``:
        one kernel a pass where it runs (:class:`~studio.engine.fast.expert_activation.RoutedActivation`,
        which reads the parts where they are), else :meth:`activate` and a product in torch's
        operations."""
        bias = self.gate_up.bias
        if self.kernels and expert_activation.available(parts[0].device, parts[0].dtype):
            parts = [p if p.stride(-1) == 1 else p.contiguous() for p in parts]
            done, act = expert_activation.KERNELS.attempt(
                lambda: RoutedActivation.apply(weight, expert if bias is not None else None, bias, self.spec, *parts))
            if done:
                return act
        gu = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        if bias is not None:
            gu = gu + bias[expert]
        return self.activate(gu) * weight[:, None]

    def __call__(self, x: torch.Tensor, gate_up_adapters: tuple, down_adapters: tuple,
                 kept: KeptRouting | None = None, read: bool = True) -> torch.Tensor:
        """The MLP's output for the normed stream ``x [B, T, hidden]``. ``kept``: where a
        checkpointed forward keeps its routing (:class:`KeptRouting`), and its recomputation, which
        finds it there, takes it. ``read``: whether anything reads the output's value beyond the
        residual stream's sum (a norm or a scale after the block, engine/fast/layer.py); where
        nothing does, the recomputation's output is a zero that carries the backward, and neither
        down's product, nor its weights' dequantization, nor the combine runs (torch's checkpointing
        keeps no recomputed value, the host-held layers add only the gradient through it)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        k = self.spec.top_k
        balance = self.log.balance and torch.is_grad_enabled()
        again = kept is not None and kept.held
        if again:  # the recomputation: the forward's experts and sort, nothing recorded twice
            keys, order, offs = kept.take()
            chosen, order = keys.view(-1, k).long(), order.long()
            probs, _, weights = self.route(x2, chosen, probs=balance)
        else:
            probs, chosen, weights = self.route(x2, probs=balance)
            keys, order, offs = self.sort(chosen)
            if kept is not None:
                kept.keep(keys, order.int(), offs)
            self.log.record(self.index, chosen.reshape(-1), probs.sum(0) if balance else None, x2.shape[0])
        rows = order // k
        groups = Groups(offs, loop=self.loop)
        # copies moved by expert_copies.py's Functions: a token's copies meet in one kernel's sum
        pos = expert_copies.positions(order)
        summed = self.kernels and expert_copies.available(x2.device, x2.dtype)
        weight = Gather.apply(weights.reshape(-1, 1), order, pos, 1, summed).view(-1)
        a, b, scale = gate_up_adapters
        xs = Gather.apply(x2, rows, pos, k, summed)
        w = self.gate_up.weights
        if w.parts > 1 and not w.reads_stored(xs.shape[0], groups):  # a product a part, each read where it lies
            n = w.out_features // w.parts
            gus = [ExpertProduct.apply(xs, w, groups, a, b[:, p * n:(p + 1) * n] if b is not None else None, scale,
                                       True, p) for p in range(w.parts)]
        else:
            gus = [ExpertProduct.apply(xs, w, groups, a, b, scale)]
        biased = self.gate_up.bias is not None or self.down.bias is not None
        expert = chosen.reshape(-1)[order] if biased else None  # each sorted row's expert: whose biases it adds
        # the routing weight taken into the activation: the down product (and its bias) carry it
        act = self.activated(gus, weight, expert)
        a, b, scale = down_adapters
        value = read or not again
        y = ExpertProduct.apply(act, self.down.weights, groups, a, b, scale, value)
        # down's bias, times the routing weight, is added in the combine's sum
        return Combine.apply(y, rows, pos, k, summed, value, self.down.bias, expert, weight).view(shape)
