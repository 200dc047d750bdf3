"""The fast training path: a lean forward/backward for Llama-style QLoRA models.

The plain path (``model(**batch).loss`` through transformers + PEFT + bitsandbytes) spends most of
a step outside the matrix products: per-module Python, fp32 casts of the residual stream, a dropout
kernel per adapter, each 4-bit weight dequantized through several small kernels, a logits tensor of
``tokens x vocab`` floats. This module computes the *same function* with fewer, larger operations:

- each decoder layer runs as one function: its projections sharing an input are fused (q/k/v in one
  product, gate/up in one), the frozen 4-bit weights are dequantized straight into the fused matrix,
  and the LoRA update is added by the same product's epilogue (``addmm``), with a hand-written
  backward that re-dequantizes instead of keeping the bf16 weights;
- the residual stream stays in the compute dtype (bf16) from embedding to loss;
- RMSNorm, RoPE, SwiGLU and the cross-entropy come from liger-kernel's Triton kernels when it is
  installed on a CUDA machine (the cross-entropy is fused with the output projection, so the logits
  are never materialised), with plain torch code as the fallback;
- padding is removed before the model: every micro-batch becomes one flat stream of real tokens, cut
  into examples where ``position_ids`` restart, and attention runs per example (flash-attention
  varlen on CUDA, a block-diagonal mask elsewhere), so packed rows never see each other;
- each layer is checkpointed (non-reentrant): the backward recomputes it from its bf16 input.

The trainable parameters are PEFT's own ``lora_A`` / ``lora_B`` weights, so the optimizer, the
checkpoints and ``save_pretrained`` are untouched; only the loss computation changes.
:func:`prepare` returns None (with a reason) for models it does not cover, and the caller keeps the
plain path.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------ kernels


def _liger():
    """liger-kernel's autograd functions, or None when it (or a CUDA device for it) is missing."""
    if not torch.cuda.is_available():
        return None
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
    except Exception:  # noqa: BLE001 - any import failure (no triton, old version) means "not here"
        return None
    return {"rms_norm": LigerRMSNormFunction, "rope": LigerRopeFunction,
            "swiglu": LigerFusedGateUpSiLUMulFunction, "flce": LigerFusedLinearCrossEntropyFunction}


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm: statistics in fp32, scale in x's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q, k: [B, T, H, D]; cos, sin: [B, T, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _varlen():
    """torch's flash-attention varlen entry point and how it spells "causal", or None."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


# ------------------------------------------------------------------------ fused QLoRA product


class _Weights:
    """The frozen base weights of one or more projections that share an input, as one matrix.

    4-bit weights are dequantized on every call (into one buffer, one kernel each); their
    double-quantized scales are expanded to fp32 once here, since they never change while training.
    """

    def __init__(self, bases: Sequence[nn.Module], dtype: torch.dtype, cache_absmax: bool):
        self.bases = list(bases)
        self.dtype = dtype
        self.out_features = [int(b.out_features) for b in self.bases]
        self.in_features = int(self.bases[0].in_features)
        self._absmax: list[torch.Tensor | None] = []
        self.quantized = [_is_4bit(b) for b in self.bases]
        for base, q in zip(self.bases, self.quantized, strict=True):
            if q and cache_absmax:
                self._absmax.append(_expanded_absmax(base.weight.quant_state))
            else:
                self._absmax.append(None)

    def matrix(self) -> torch.Tensor:
        """The bf16 (compute dtype) weight ``[sum(out_features), in_features]``."""
        if not any(self.quantized):
            if len(self.bases) == 1:
                return self.bases[0].weight.to(self.dtype)
            return torch.cat([b.weight.to(self.dtype) for b in self.bases])
        device = self.bases[0].weight.device
        out = torch.empty(sum(self.out_features), self.in_features, dtype=self.dtype, device=device)
        row = 0
        for base, absmax, n in zip(self.bases, self._absmax, self.out_features, strict=True):
            _dequantize_into(base, absmax, out[row:row + n])
            row += n
        return out


def _is_4bit(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None


def _expanded_absmax(state) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    if state.nested:
        absmax = bnbf.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        return absmax.float()
    return state.absmax.float()


def _dequantize_into(base: nn.Module, absmax: torch.Tensor | None, out: torch.Tensor) -> None:
    state = base.weight.quant_state
    if absmax is None:
        absmax = _expanded_absmax(state)
    args = (base.weight.data, absmax, state.blocksize, state.quant_type, out.shape, out.dtype)
    if out.device.type == "cuda":
        torch.ops.bitsandbytes.dequantize_4bit.out(*args, out=out)
    else:  # bitsandbytes' CPU backend has no out= variant
        out.copy_(torch.ops.bitsandbytes.dequantize_4bit.default(*args))


class _LoraProduct(torch.autograd.Function):
    """``y = x W^T + s (x A^T) B^T`` for a frozen W that is rebuilt, never saved, in the backward.

    ``A`` stacks the adapters' A matrices ``[n*r, in]``; ``Bt`` holds their B matrices transposed on
    a block diagonal ``[n*r, sum(out)]``, so several adapters over one input cost two small products.
    """

    @staticmethod
    def forward(ctx, x, weights: _Weights, a, bt, scale: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w = weights.matrix()
        y = x2 @ w.t()
        del w
        if a is not None:
            xa = x2 @ a.t()
            y.addmm_(xa, bt, alpha=scale)
            ctx.save_for_backward(x2, a, bt, xa)
        else:
            ctx.save_for_backward(x2)
        ctx.weights, ctx.scale, ctx.shape = weights, scale, shape
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x2 = saved[0]
        dy2 = dy.reshape(-1, dy.shape[-1])
        w = ctx.weights.matrix()
        dx = dy2 @ w
        del w
        da = dbt = None
        if len(saved) > 1:
            _, a, bt, xa = saved
            dyb = (dy2 @ bt.t()).mul_(ctx.scale)
            dx.addmm_(dyb, a)
            if ctx.needs_input_grad[2]:
                da = dyb.t() @ x2
            if ctx.needs_input_grad[3]:
                dbt = (xa.t() @ dy2).mul_(ctx.scale)
        return dx.view(ctx.shape), None, da, dbt, None


def _has_adapter(module: nn.Module, adapter: str) -> bool:
    return hasattr(module, "lora_A") and adapter in module.lora_A


class _Projection:
    """Linears reading the same input (with or without a LoRA adapter each), as one product."""

    def __init__(self, modules: Sequence[nn.Module], adapter: str, dtype: torch.dtype, cache_absmax: bool):
        self.modules = list(modules)
        bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in modules]
        self.weights = _Weights(bases, dtype, cache_absmax)
        self.dtype = dtype
        adapted = [m for m in modules if _has_adapter(m, adapter)]
        self.present = [_has_adapter(m, adapter) for m in modules]
        self.a = [m.lora_A[adapter].weight for m in adapted]
        self.b = [m.lora_B[adapter].weight for m in adapted]
        self.scales = [float(m.scaling[adapter]) for m in adapted]
        drop = [m.lora_dropout[adapter] for m in adapted]
        self.dropout = [d.p if isinstance(d, nn.Dropout) else 0.0 for d in drop]

    def adapters(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float] | None:
        """The adapters as the fused product takes them: stacked A, block-diagonal B^T, scale.

        Built from the fp32 parameters through autograd, so their gradients flow back to each
        adapter; a projection without an adapter gets an empty block. None when dropout is on
        (each adapter then needs its own masked input).
        """
        if any(self.dropout):
            return None
        if not self.a:
            return None, None, 1.0
        a = torch.cat(self.a).to(self.dtype) if len(self.a) > 1 else self.a[0].to(self.dtype)
        # Scales folded into B when they differ (rare: per-module alpha); else passed as alpha.
        same = all(s == self.scales[0] for s in self.scales)
        adapted = iter(zip(self.b, self.scales, strict=True))
        bts = []
        for present, n in zip(self.present, self.weights.out_features, strict=True):
            if present:
                b, s = next(adapted)
                bts.append(b.t() if same else b.t() * s)
            else:
                bts.append(a.new_zeros(0, n))
        bt = (torch.block_diag(*bts) if len(bts) > 1 else bts[0]).to(self.dtype)
        return a, bt, self.scales[0] if same else 1.0

    def __call__(self, x: torch.Tensor, adapters: tuple | None = None) -> torch.Tensor:
        if not any(self.dropout):
            a, bt, scale = adapters if adapters is not None else self.adapters()
            return _LoraProduct.apply(x, self.weights, a, bt, scale)
        # Dropout on the adapter input: the base product stays fused, each adapter gets its own mask
        # (as in PEFT), through plain autograd.
        y = _LoraProduct.apply(x, self.weights, None, None, 1.0)
        deltas = []
        adapted = iter(zip(self.a, self.b, self.scales, self.dropout, strict=True))
        for present, n in zip(self.present, self.weights.out_features, strict=True):
            if present:
                a, b, s, p = next(adapted)
                xd = F.dropout(x, p, self.modules[0].training)
                deltas.append((xd @ a.to(self.dtype).t()) @ b.to(self.dtype).t() * s)
            else:
                deltas.append(x.new_zeros(*x.shape[:-1], n))
        return y + (torch.cat(deltas, dim=-1) if len(deltas) > 1 else deltas[0])


# ---------------------------------------------------------------------------- the layer


@dataclass
class _Segments:
    """Where examples start in a flat token stream (attention stays inside each)."""

    cu: torch.Tensor | None = None
    """int32 [n+1] cumulative example lengths (varlen attention), or None for full causal rows."""
    max_len: int = 0
    mask: torch.Tensor | None = None
    """bool [1, 1, T, T] block-diagonal causal mask for the SDPA fallback."""


@dataclass
class _Layer:
    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    kernels: dict | None = field(default=None, repr=False)
    varlen: tuple | None = field(default=None, repr=False)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            # in_place: the incoming gradient (used by nothing else) is overwritten with the result.
            return self.kernels["rms_norm"].apply(x, w, self.eps, 0.0, "llama", True)
        return _rms_norm_torch(x, w, self.eps)

    def adapters(self) -> tuple | None:
        """Each projection's adapters in fused form (see :meth:`_Projection.adapters`)."""
        if any(any(p.dropout) for p in (self.qkv, self.o, self.gate_up, self.down)):
            return None
        return self.qkv.adapters(), self.o.adapters(), self.gate_up.adapters(), self.down.adapters()

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: _Segments,
                adapters: tuple | None = None) -> torch.Tensor:
        b, t, _ = h.shape
        qkv_ad, o_ad, gu_ad, down_ad = adapters if adapters is not None else (None,) * 4
        qkv = self.qkv(self.norm(h, self.ln1), qkv_ad)
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim)
        k = k.view(b, t, self.kv_heads, self.head_dim)
        v = v.view(b, t, self.kv_heads, self.head_dim)
        if self.kernels:
            # liger's RoPE takes [B, H, T, D]; its kernel works on the [B, T, H, D] memory layout.
            qt, kt = self.kernels["rope"].apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = qt.transpose(1, 2), kt.transpose(1, 2)
        else:
            q, k = _rope_torch(q, k, cos, sin)
        attn = self.attention(q, k, v, seg).reshape(b, t, self.heads * self.head_dim)
        h = h + self.o(attn, o_ad)
        gu = self.gate_up(self.norm(h, self.ln2), gu_ad)
        if self.kernels:
            # liger returns the gradient flat: give it a flat input so the shapes agree.
            act = self.kernels["swiglu"].apply(gu.view(-1, gu.shape[-1]), True).view(*gu.shape[:-1], -1)
        else:
            gate, up = gu.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return h + self.down(act, down_ad)

    def attention(self, q, k, v, seg: _Segments) -> torch.Tensor:
        """Causal attention inside each example; returns [B, T, H, D]."""
        if seg.cu is not None and self.varlen is not None:
            fn, causal, gqa = self.varlen
            kw = dict(causal)
            if self.kv_heads != self.heads:
                if gqa:
                    kw["enable_gqa"] = True
                else:
                    rep = self.heads // self.kv_heads
                    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            out = fn(q[0], k[0], v[0], seg.cu, seg.cu, seg.max_len, seg.max_len, **kw)
            return out.unsqueeze(0)
        gqa = self.kv_heads != self.heads
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if gqa:
            rep = self.heads // self.kv_heads
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        if seg.mask is not None:
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seg.mask)
        else:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return out.transpose(1, 2)


# ---------------------------------------------------------------------------- the model


@dataclass
class FastOptions:
    """Which levers the fast path pulls (all on by default; the benchmark turns them off one by one)."""

    kernels: bool = True
    """Use liger-kernel's fused RMSNorm / RoPE / SwiGLU / linear cross-entropy when available."""
    varlen: bool = True
    """Flash-attention varlen for packed or padded batches (else a block-diagonal SDPA mask)."""
    checkpointing: bool = True
    """Recompute each layer in the backward instead of keeping its activations."""
    cache_absmax: bool = True
    """Expand double-quantized 4-bit scales to fp32 once (+0.25 GB on a 7B model, fewer kernels)."""
    unpad: bool = True
    """Drop padding tokens before the model (padded batches become a flat stream of examples)."""
    hoist_adapters: bool = True
    """Cast and stack the adapters once per forward, outside the checkpointed layers."""
    cuda_graphs: bool = True
    """Replay the decoder stack's forward and backward as CUDA graphs (one per batch layout, at most
    ``max_graphs``), so the host's per-operation cost leaves the step; CUDA only, no LoRA dropout."""
    max_graphs: int = 2
    """Layouts beyond this many run without graphs (each graph keeps its own activation memory)."""


class FastModel:
    """A PEFT Llama-style model's loss, computed by the fast path. Build it with :func:`prepare`."""

    def __init__(self, peft_model: nn.Module, layers: list[_Layer], backbone: nn.Module, head: nn.Module,
                 dtype: torch.dtype, options: FastOptions, kernels: dict | None, varlen: tuple | None):
        self.peft_model = peft_model
        self.layers = layers
        self.backbone = backbone
        self.head = head
        self.dtype = dtype
        self.options = options
        self.kernels = kernels
        self.varlen = varlen
        # The checkpoint must replay the RNG only when something in a layer draws from it.
        self._dropout = any(any(p.dropout) for layer in layers for p in (layer.qkv, layer.o, layer.gate_up,
                                                                          layer.down))
        device = backbone.embed_tokens.weight.device
        use_graphs = options.cuda_graphs and not self._dropout and device.type == "cuda"
        self._graphs = _Graphs(self, options.max_graphs) if use_graphs else None

    def trainable(self) -> list[torch.Tensor]:
        """The adapter weights the stack trains, in a fixed order."""
        out = []
        for layer in self.layers:
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                for a, b in zip(proj.a, proj.b, strict=True):
                    out += [a, b]
        return out

    def describe(self) -> str:
        """One line naming what is on, for logs and events."""
        parts = ["fused 4-bit LoRA products"]
        if self._graphs is not None:
            parts.append("CUDA graphs")
        parts.append("liger kernels" if self.kernels else "torch kernels")
        parts.append("varlen attention" if self.varlen else "SDPA attention")
        if self.options.checkpointing:
            parts.append("per-layer checkpointing")
        return ", ".join(parts)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy over the targets (``mean`` as ``model(...).loss``, or ``sum``).

        Targets are ``labels`` shifted left by one; a target whose token starts a new example (its
        position id is 0) is ignored, so no example is trained to predict the next one.
        """
        b, t = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
            else:
                position_ids = torch.arange(t, device=device).expand(b, t)
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]
        targets[:, :-1].masked_fill_(position_ids[:, 1:] == 0, IGNORE_INDEX)

        # Host syncs, once per micro-batch: the batch's shape decides the attention layout.
        padded = attention_mask is not None and not bool(attention_mask.all())
        restarts = bool((position_ids[:, 1:] == 0).any())
        if padded and not self.options.unpad:
            # Rows kept as they are (the padded baseline's layout): mask the padding's keys.
            ids, pos, seg = input_ids, position_ids, _Segments(mask=_padding_mask(attention_mask))
        elif padded or restarts:
            # One flat stream of real tokens, cut into examples where the position ids restart.
            if padded:
                keep = attention_mask.bool()
                ids, pos, targets = input_ids[keep], position_ids[keep], targets[keep]
            else:
                ids, pos, targets = input_ids.reshape(-1), position_ids.reshape(-1), targets.reshape(-1)
            ids, pos, targets = ids.unsqueeze(0), pos.unsqueeze(0), targets.unsqueeze(0)
            seg = self._segments(pos)
        else:
            ids, pos, seg = input_ids, position_ids, _Segments()

        graphed = self._graphs is not None and torch.is_grad_enabled() and seg.mask is None
        if graphed:
            ids, pos, targets, seg = self._static_layout(ids, pos, targets, seg)
        h = self.backbone.embed_tokens(ids).to(self.dtype)
        cos, sin = self.backbone.rotary_emb(h, pos)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        if graphed:
            h = self._graphs.run(h, cos, sin, seg)
        else:
            h = self.stack(h, cos, sin, seg)
        return self._cross_entropy(h.reshape(-1, h.shape[-1]), targets.reshape(-1), reduction)

    def stack(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: _Segments) -> torch.Tensor:
        """The decoder layers and the final norm."""
        for layer in self.layers:
            # Built outside the checkpoint: the recomputation then reuses them (fewer small ops).
            adapters = layer.adapters() if self.options.hoist_adapters else None
            if self.options.checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer.forward, h, cos, sin, seg, adapters, use_reentrant=False,
                               preserve_rng_state=self._dropout)
            else:
                h = layer.forward(h, cos, sin, seg, adapters)
        return self.layers[0].norm(h, self.backbone.norm.weight) if self.layers else h

    def _static_layout(self, ids, pos, targets, seg: _Segments):
        """Pad a flat stream to a bucketed length with a bucketed number of examples, so that a
        few CUDA graphs cover every batch. The padding is made of one-token examples (and one
        longer one) that take no loss and that no real token attends to."""
        if seg.cu is None:
            return ids, pos, targets, seg
        n_real = ids.shape[1]
        segs = seg.cu.numel() - 1
        slots = max(32, 1 << segs.bit_length())  # > segs: room for at least one padding example
        total = -(-(n_real + slots) // 256) * 256
        pad = total - n_real
        dummies = slots - segs - 1
        device = ids.device
        ids = F.pad(ids, (0, pad))
        targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        tail = torch.arange(pad - dummies, device=device)
        pos = torch.cat([pos, torch.zeros(1, dummies, dtype=pos.dtype, device=device), tail[None]], dim=1)
        cu = torch.cat([seg.cu, n_real + torch.arange(1, dummies + 1, device=device, dtype=seg.cu.dtype),
                        torch.tensor([total], device=device, dtype=seg.cu.dtype)])
        max_len = max(seg.max_len, pad - dummies)
        max_len = 1 << (max_len - 1).bit_length()
        return ids, pos, targets, _Segments(cu=cu, max_len=max_len)

    def _segments(self, pos: torch.Tensor) -> _Segments:
        flat = pos[0]
        starts = torch.nonzero(flat == 0).flatten()
        n = flat.numel()
        if self.varlen is not None:
            cu = torch.cat([starts, torch.tensor([n], device=flat.device)]).to(torch.int32)
            max_len = int((cu[1:] - cu[:-1]).max())  # host sync: the kernel needs it as a number
            return _Segments(cu=cu, max_len=max_len)
        example = torch.cumsum((flat == 0).long(), 0)
        same = example[:, None] == example[None, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=flat.device).tril_()
        return _Segments(mask=(same & causal)[None, None])

    def _cross_entropy(self, h: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        weight = self.head.weight
        if self.kernels and weight.dtype == h.dtype:
            # Positional arguments: liger's autograd function takes no keywords.
            loss = self.kernels["flce"].apply(h, weight, targets, None, None, IGNORE_INDEX, 0.0, 0.0, reduction)
            return loss[0] if isinstance(loss, tuple) else loss
        keep = targets != IGNORE_INDEX  # only target rows go through the fp32 softmax
        logits = (h[keep] @ weight.to(h.dtype).t()).float()
        return F.cross_entropy(logits, targets[keep], reduction=reduction)


class _StackModule(nn.Module):
    """The decoder stack for one batch layout, as the module that CUDA-graph capture takes.

    Its parameters are the adapters (so the captured backward returns their gradients); the
    layout's example count and longest example are fixed in it, the boundaries come in as a tensor.
    """

    def __init__(self, fast: FastModel, max_len: int, flat: bool):
        super().__init__()
        self.adapters = nn.ParameterList(fast.trainable())
        self._fast = [fast]  # a list: not a submodule, so its parameters are not counted twice
        self.max_len, self.flat = max_len, flat

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        seg = _Segments(cu=cu, max_len=self.max_len) if self.flat else _Segments()
        return self._fast[0].stack(h, cos, sin, seg)


class _Graphs:
    """CUDA graphs of the decoder stack, one per batch layout, captured on first use."""

    def __init__(self, fast: FastModel, limit: int):
        self.fast = fast
        self.limit = limit
        self.graphed: dict[tuple, nn.Module] = {}
        self.failed = ""

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: _Segments) -> torch.Tensor:
        flat = seg.cu is not None
        cu = seg.cu if flat else torch.zeros(1, dtype=torch.int32, device=h.device)
        key = (tuple(h.shape), cu.numel(), seg.max_len, h.requires_grad)
        module = self.graphed.get(key)
        if module is None:
            if self.failed or len(self.graphed) >= self.limit:
                return self.fast.stack(h, cos, sin, seg)
            try:
                module = torch.cuda.make_graphed_callables(_StackModule(self.fast, seg.max_len, flat),
                                                           (h, cos, sin, cu), num_warmup_iters=2)
            except torch.cuda.OutOfMemoryError:
                raise  # the trainer halves the micro-batch; the smaller layout gets its own graph
            except Exception as exc:  # noqa: BLE001 - a capture failure leaves the eager path working
                self.failed = f"{type(exc).__name__}: {exc}"
                return self.fast.stack(h, cos, sin, seg)
            self.graphed[key] = module
            # The capture's warm-up ran on a side stream; its cached blocks serve nothing now.
            torch.cuda.empty_cache()
        # The captured backward hands back gradients that live in the graph's memory: gradients that
        # already exist make autograd add them in place instead of keeping (aliasing) that memory.
        for p in self.fast.trainable():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return module(h, cos, sin, cu)


def _padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril_()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def _find(model: nn.Module):
    """The decoder stack, final norm and LM head of a PEFT-wrapped Llama-style model, or a reason."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(inner, "model", None)
    head = getattr(inner, "lm_head", None)
    layers = getattr(backbone, "layers", None)
    if backbone is None or head is None or layers is None:
        return None, "not a decoder-only model with model.layers and lm_head"
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not hasattr(backbone, name):
            return None, f"the backbone has no {name}"
    return (backbone, head, layers), ""


def _lora_module(module: nn.Module, adapter: str) -> str:
    """Why ``module`` cannot go through the fused product ('' when it can)."""
    if not _has_adapter(module, adapter):
        if isinstance(module, nn.Linear) or _is_4bit(module):
            return "projections with a bias" if getattr(module, "bias", None) is not None else ""
        return f"a {type(module).__name__} projection"
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return "an adapter that is merged or disabled"
    if getattr(module, "use_dora", {}).get(adapter, False):
        return "DoRA adapters"
    base = module.get_base_layer()
    if getattr(base, "bias", None) is not None:
        return "projections with a bias"
    weight = getattr(base, "weight", None)
    if weight is None or (not _is_4bit(base) and weight.dtype not in (torch.bfloat16, torch.float16,
                                                                      torch.float32)):
        return "8-bit base weights"
    return ""


def prepare(model: nn.Module, options: FastOptions | None = None) -> tuple[FastModel | None, str]:
    """Build the fast path for a PEFT LoRA model, or return (None, why not).

    Covered: Llama-architecture decoders (Llama, Mistral-style GQA, SmolLM, ...) without attention
    biases, LoRA on all seven projections (q, k, v, o, gate, up, down), base weights in 4-bit
    (bitsandbytes NF4/FP4) or a float dtype. Frozen float parameters kept in fp32 by
    ``prepare_model_for_kbit_training`` (norms, embeddings, head) are cast back to the compute dtype:
    they were loaded from it, so no information is lost, and the stream then stays in it.
    """
    options = options or FastOptions()
    found, why = _find(model)
    if found is None:
        return None, why
    backbone, head, layers = found
    adapter = getattr(model, "active_adapter", "default")
    if isinstance(adapter, (list, tuple)):
        if len(adapter) != 1:
            return None, "more than one active adapter"
        adapter = adapter[0]
    config = getattr(model, "config", None) or getattr(backbone, "config", None)
    if not hasattr(config, "rms_norm_eps"):
        return None, f"model type {getattr(config, 'model_type', '?')!r} is not covered (no RMSNorm)"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "attention_bias", False) \
            or getattr(config, "mlp_bias", False):
        return None, "only SiLU-gated MLPs without biases are covered"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or hasattr(attn, "q_norm"):
            return None, "a decoder layer that is not Llama-shaped"
        for name in _ATTN:
            why = _lora_module(getattr(attn, name, None) or nn.Identity(), adapter)
            if why:
                return None, f"{why} ({name})"
        for name in _MLP:
            why = _lora_module(getattr(mlp, name, None) or nn.Identity(), adapter)
            if why:
                return None, f"{why} ({name})"

    if not any(_has_adapter(getattr(layer.self_attn, n), adapter) for layer in layers for n in _ATTN) and \
            not any(_has_adapter(getattr(layer.mlp, n), adapter) for layer in layers for n in _MLP):
        return None, "no LoRA adapter on the decoder's projections"
    dtype = _compute_dtype(layers[0])
    for module in (backbone.embed_tokens, backbone.norm, head, *[m for layer in layers for m in
                                                                 (layer.input_layernorm,
                                                                  layer.post_attention_layernorm)]):
        for p in module.parameters(recurse=False):
            if not p.requires_grad and p.dtype == torch.float32 and dtype != torch.float32 \
                    and _exact_in(p, dtype):
                p.data = p.data.to(dtype)

    kernels = _liger() if options.kernels and dtype in (torch.bfloat16, torch.float16) else None
    device = backbone.embed_tokens.weight.device
    varlen = _varlen() if options.varlen and device.type == "cuda" else None
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    built = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        built.append(_Layer(
            qkv=_Projection([attn.q_proj, attn.k_proj, attn.v_proj], adapter, dtype, options.cache_absmax),
            o=_Projection([attn.o_proj], adapter, dtype, options.cache_absmax),
            gate_up=_Projection([mlp.gate_proj, mlp.up_proj], adapter, dtype, options.cache_absmax),
            down=_Projection([mlp.down_proj], adapter, dtype, options.cache_absmax),
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            eps=float(getattr(layer.input_layernorm, "variance_epsilon", config.rms_norm_eps)),
            heads=int(config.num_attention_heads),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim, kernels=kernels, varlen=varlen))
    return FastModel(model, built, backbone, head, dtype, options, kernels, varlen), ""


def _compute_dtype(layer: nn.Module) -> torch.dtype:
    module = layer.self_attn.q_proj
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if _is_4bit(base):
        dtype = getattr(base, "compute_dtype", None)
        return dtype if dtype is not None else torch.float32
    return base.weight.dtype


def _exact_in(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when every value of ``p`` survives a round trip through ``dtype``."""
    with torch.no_grad():
        return bool(torch.equal(p.data.to(dtype).to(p.dtype), p.data))


FAST_PATH_ENV = "STUDIO_FAST_PATH"
"""``1`` forces the fast path on (also on CPU, for tests), ``0`` forces the plain path."""


def enable(model: nn.Module, device: torch.device) -> tuple[FastModel | None, str]:
    """The fast path for a trainer's model: on by default on CUDA, off on CPU (where it is no
    faster); the environment variable ``STUDIO_FAST_PATH`` overrides. Returns (None, why) when off."""
    import os

    wanted = os.environ.get(FAST_PATH_ENV, "")
    if wanted == "0":
        return None, f"{FAST_PATH_ENV}=0"
    if device.type != "cuda" and wanted != "1":
        return None, "not on a CUDA device"
    return prepare(model)


def matmul_tflops(device: torch.device, size: int = 4096, repeats: int = 10) -> float:
    """This GPU's bf16 matrix-product rate (TFLOP/s), measured: the ceiling MFU is quoted against."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def model_flops_per_token(config, seq_len: float) -> float:
    """Useful FLOPs a QLoRA training step spends per token (recomputation not counted).

    Forward 2N plus the input-gradient backward 2N over the N frozen matrix parameters (no
    weight-gradient products: the base is frozen), plus causal attention (forward and backward:
    3 x 2 x 2 x layers x seq x hidden / 2). LoRA's own products are under 1% and left out.
    """
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * h)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    n = layers * per_layer + config.vocab_size * h
    attention = 3 * 2 * 2 * layers * seq_len * heads * head_dim / 2
    return 4 * n + attention


__all__ = ["FAST_PATH_ENV", "FastModel", "FastOptions", "enable", "matmul_tflops", "model_flops_per_token", "prepare"]
