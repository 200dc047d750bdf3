"""FastModel: the loss of a PEFT Llama-style model through the fast layers, with the batch laid out
as one flat stream of real tokens and the cross-entropy fused with the output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from studio.core.memory.phases import SCORE_TOKENS
from studio.core.plan import KEEP_ATTENTION_FROM, KEEP_QKV, OFFLOAD_IN_GRAPHS, graphs_for, offload_for
from studio.engine.fast import norm, update
from studio.engine.fast.dropout import DropoutSeed
from studio.engine.fast.graphs import Graphs
from studio.engine.fast.layer import Layer, Segments, padding_mask
from studio.engine.fast.loss import IGNORE_INDEX, chunked_scores, cross_entropy
from studio.engine.fast.offload import HostInputs, OffloadedLayer, flatten


@dataclass
class FastOptions:
    """Which levers the fast path pulls (all on by default; the benchmark turns them off one by one)."""

    kernels: bool = True
    """Use liger-kernel's fused RMSNorm / RoPE / SwiGLU / linear cross-entropy when available."""
    varlen: bool = True
    """Flash-attention varlen for packed or padded batches (else a block-diagonal SDPA mask)."""
    checkpointing: bool = True
    """Recompute each layer in the backward instead of keeping its activations."""
    cache_absmax: bool = False
    """Expand double-quantized 4-bit scales to fp32 once and keep them (+0.40 GB on a 7B model for
    one small kernel less per product; off: the memory matters more, docs/memory.md)."""
    shared_workspace: bool = True
    """Dequantize every fused 4-bit weight into one shared buffer (weights.Workspace) instead of a
    fresh allocation per product."""
    triton_dequant: bool = True
    """Dequantize NF4 weights in one Triton kernel, double-quantized scales included (dequant.py),
    instead of bitsandbytes' three: the same values to the bit. CUDA with Triton only."""
    split_products: bool = True
    """Run a fused projection's base product one projection at a time (weights.FrozenWeights): the
    dequantization buffer holds one projection's weight instead of the fused pair's."""
    offload_inputs: bool = True
    """Keep the checkpointed layer inputs in pinned host memory on CUDA (offload.py; core/plan.py's
    offload_for decides when)."""
    keep_qkv: bool = KEEP_QKV
    """With the layer inputs on the host, each layer's rotated q, k and v wait there too, so that
    the recomputation skips the q/k/v product and RoPE (offload.py's ``HostInputs.keep_qkv``)."""
    last_layer_on_device: bool = True
    """With the layer inputs on the host, the last layer's stay on the device (offload.py's
    ``HostInputs.last_on_device``): its copies could hide behind no compute."""
    keep_attention_from: int | None = KEEP_ATTENTION_FROM
    """With ``keep_qkv``, micro-batches whose longest example has at least this many tokens keep
    each layer's attention output and log-sum-exp on the host too, and the recomputation runs no
    attention (engine/fast/attention.py); None: never."""
    offload_graphed: bool = OFFLOAD_IN_GRAPHS
    """... inside the CUDA graphs too (each graphed layout copies to its own host buffers)."""
    unpad: bool = True
    """Drop padding tokens before the model (padded batches become a flat stream of examples)."""
    hoist_adapters: bool = True
    """Cast and stack the adapters once per forward, outside the checkpointed layers (always, for
    layers whose inputs wait on the host: ``offload_inputs``)."""
    cuda_graphs: bool = True
    """Replay the decoder stack's forward and backward as CUDA graphs (one per batch layout, at most
    ``max_graphs``), so the host's per-operation cost leaves the step; CUDA only."""
    max_graphs: int = 2
    """Layouts beyond this many run without graphs (each graph keeps its own activation memory)."""
    graph_token_limit: int | None = None
    """Micro-batches of more tokens than this run without graphs; None: core/plan.py's
    ``GRAPH_TOKEN_LIMIT``, which the estimator follows (another value is for benchmarks: graphs at
    8192 tokens measured no faster, with 0.49 GiB more reserved, bench/results/h200_v18_levers_graphs.json)."""
    skip_last_product: bool = True
    """A layer recomputed for its backward skips its last product (the down projection), whose
    value nothing reads (layer.py): 7% less work on a 7B model's step."""
    fused_epilogues: bool = True
    """The LoRA update's product writes each output and the base product adds itself in its
    epilogue (weights.LoraProduct), instead of the base product first and the update in a pass of
    its own. The residual stream (o and down) is added after both either way."""
    fused_backward: bool = True
    """The same order in the backward: the LoRA term's product (with dropout, each adapter's masked
    term) writes each input gradient and the base products add themselves in their epilogues
    (weights._input_gradient)."""
    separate_qkv: bool = True
    """q, k and v come out of their products as three tensors (weights.SeparateLoraProduct), not
    column blocks of one that RoPE's kernel copies out and whose gradients are concatenated."""
    update_in_kernel: bool = True
    """Where a kernel reads a fused product's output next (SwiGLU for gate/up, the residual's add
    for o and down), it adds the LoRA update itself from ``x A^T`` and ``B^T`` (engine/fast/update.py),
    and the base product writes the output alone: the update's product no longer writes it first.
    Triton only (CUDA, or its interpreter)."""
    hand_off_down_gradient: bool = True
    """With ``update_in_kernel``, the down product's LoRA input-gradient term goes to SwiGLU's
    backward, which adds it as it reads the gradient (update.Handoff), instead of being written by a
    product of its own."""
    norm_with_stream: bool = True
    """The norms before q/k/v and gate/up are Studio's own (engine/fast/norm.py): their backward adds
    the residual stream's gradient of the same input in the same pass, where liger's norm wrote its
    share and autograd added the two in a pass of their own. Triton only (CUDA, or its interpreter)."""
    input_gradient_of_first_layer: bool = False
    """Compute the first layer's input gradient anyway (for benchmarks): the frozen embeddings' output
    wants none, so by default the first layer's q/k/v products run no input-gradient product."""
    product_library: dict[str, str] | None = None
    """The BLAS library each base product asks torch for (``"cublas"`` or ``"cublaslt"``), by
    projection and direction: keys ``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``, each alone or with
    ``".forward"`` / ``".backward"``, and ``"*"`` or ``"*.forward"`` / ``"*.backward"`` for all;
    the most specific key wins. None: torch's choice everywhere. (cuBLAS and cuBLASLt pick
    different kernels for some of a 7B layer's shapes, bench/product_shapes.py; through the whole
    step cuBLASLt measured within 0.6% of the default on an H200, bench/results/h200_v18_levers_lt.json.)"""
    grad_sink: bool = True
    """The captured backward adds the adapters' gradients into ``.grad`` itself (graphs.GradSink)
    instead of returning a second copy that autograd then adds there after each replay."""


def libraries_for(choice: dict[str, str] | None, projection: str) -> dict[str, str]:
    """One projection's BLAS library by direction from ``FastOptions.product_library``."""
    known = {f"{p}{d}" for p in ("qkv", "o", "gate_up", "down", "*") for d in ("", ".forward", ".backward")}
    for key in choice or {}:
        if key not in known:
            raise ValueError(f"FastOptions.product_library: unknown key {key!r} (a projection: qkv, o, "
                             "gate_up, down or *; with .forward or .backward for one direction)")
    out = {}
    for direction in ("forward", "backward"):
        for key in (f"{projection}.{direction}", projection, f"*.{direction}", "*"):
            if choice and key in choice:
                if choice[key] not in ("cublas", "cublaslt"):
                    raise ValueError(f"FastOptions.product_library[{key!r}]: {choice[key]!r} is not "
                                     "'cublas' or 'cublaslt'")
                out[direction] = choice[key]
                break
    return out


class FastModel:
    """A PEFT Llama-style model's loss, computed by the fast path. Build it with :func:`prepare`."""

    _slots_floor = 0
    """The fewest example slots a CUDA-graph layout gets (:meth:`expect_examples`)."""

    def __init__(self, peft_model: nn.Module, layers: list[Layer], backbone: nn.Module, head: nn.Module,
                 dtype: torch.dtype, options: FastOptions, kernels: dict | None, varlen: tuple | None):
        self.peft_model = peft_model
        self.layers = layers
        self.backbone = backbone
        self.head = head
        self.dtype = dtype
        self.options = options
        self.kernels = kernels
        self.varlen = varlen
        device = backbone.embed_tokens.weight.device
        in_kernel = options.update_in_kernel and options.fused_epilogues and update.available(device, dtype)
        stream_norm = options.norm_with_stream and norm.available(device, dtype)
        for layer in layers:
            layer.skip_last = options.skip_last_product
            layer.norm_with_stream = stream_norm
            for name, proj in zip(("qkv", "o", "gate_up", "down"), layer.projections(), strict=True):
                proj.weights.libraries = libraries_for(options.product_library, name)
                proj.update_first = options.fused_epilogues
                proj.backward_first = options.fused_backward
                proj.in_kernel = in_kernel
                proj.hand_off = in_kernel and options.hand_off_down_gradient
            layer.qkv.separate = options.separate_qkv and options.fused_epilogues
        # Adapter dropout draws its masks from one seed tensor (engine/fast/dropout.py): graphs replay
        # them, recomputation regenerates them, and no RNG state is saved around a layer.
        dropping = any(any(p.dropout) for layer in layers for p in layer.projections())
        self._seed = DropoutSeed(device) if dropping else None
        if self._seed is not None:
            for index, layer in enumerate(layers):
                for k, proj in enumerate(layer.projections()):
                    proj.use_dropout(self._seed.tensor, first_site=(index * 4 + k) * 8)
        use_graphs = options.cuda_graphs and device.type == "cuda"
        offloading = options.offload_inputs and options.checkpointing and device.type == "cuda"
        # The sink works on the hoisted adapters (built once per forward, outside the layers).
        self._graphs = Graphs(self, options.max_graphs, offloading and options.offload_graphed,
                              options.grad_sink and options.hoist_adapters) if use_graphs else None
        self._host = self.host_inputs(device) if offloading else None

    def host_inputs(self, device: torch.device) -> HostInputs:
        """Host buffers for the layer inputs, set up as :attr:`options` say (one for the eager
        steps, one per graphed layout: graphs.py)."""
        options = self.options
        return HostInputs(device, options.keep_qkv, keep_attention_from=options.keep_attention_from,
                          last_on_device=options.last_layer_on_device)

    def expect_examples(self, most: int) -> None:
        """Size the CUDA-graph layouts for micro-batches of up to ``most`` examples from the start
        (the Trainer knows it from its packed rows), so that a run captures its layout once
        instead of widening it when a fuller micro-batch comes (:meth:`_static_layout`)."""
        self._slots_floor = 1 << (most + 1).bit_length()  # > most + 1: room for two padding pieces

    def release_graphs(self) -> None:
        """Drop the captured graphs and their memory pools (a later training step captures anew)."""
        if self._graphs is not None:
            self._graphs.release()

    @property
    def graphs_failed(self) -> str:
        """Why CUDA graph capture failed ("" if it did not): steps run eagerly from then on."""
        return self._graphs.failed if self._graphs is not None else ""

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
        quantized = bool(self.layers) and any(self.layers[0].qkv.weights.quantized)
        parts = ["fused 4-bit LoRA products" if quantized else "fused LoRA products"]
        if quantized and self.layers[0].qkv.weights.one_kernel:
            parts.append("NF4 dequantized in one Triton kernel")
        if self.options.split_products:
            parts.append("base products one projection at a time")
        if self._graphs is not None:
            parts.append("CUDA graphs")
        if self._host is not None:
            graphed = self._graphs is not None and self._graphs.offload
            parts.append("layer inputs offloaded to the host" + ("" if graphed else " on eager steps"))
            if self.options.skip_last_product:
                parts.append("recomputation without the last product")
            if self._host.keep_qkv:
                parts.append("q/k/v kept on the host for the recomputation")
            if self._host.last_on_device:
                parts.append("the last layer's kept on the device")
            if self._host.keep_attention_from is not None:
                parts.append(f"attention kept on the host from {self._host.keep_attention_from} tokens")
        if self.layers and self.layers[0].o.in_kernel and not update.broken():
            parts.append("LoRA updates added in the SwiGLU and residual kernels"
                         + (", down's LoRA gradient in SwiGLU's backward" if self.layers[0].down.hand_off else ""))
        if self.layers and self.layers[0].norm_with_stream and not norm.broken():
            parts.append("the residual stream's gradient added in the norms' backward")
        if self._seed is not None:
            parts.append("adapter dropout from counter-based masks")
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
        if self._seed is not None and torch.is_grad_enabled():
            self._seed.advance()  # this micro-batch's adapter-dropout masks
        h, targets = self._hidden(input_ids, labels, attention_mask, position_ids)
        return cross_entropy(h, self.head.weight, targets, reduction, self.kernels)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over the targets and the count of argmax hits among them, for
        evaluation: no gradient, no CUDA graph, at most :data:`SCORE_TOKENS` tokens a forward pass,
        and never a ``tokens x vocab`` logits tensor (the loss goes through the vocabulary in
        chunks, :func:`chunked_scores`)."""
        # A few rows at a time: the eager forward's working set grows with the tokens, and on CUDA
        # the training step's activations sit in the graphs' private pool, which this cannot reuse.
        rows = max(1, SCORE_TOKENS // max(1, input_ids.shape[1]))
        loss = hits = None
        for start in range(0, input_ids.shape[0], rows):
            part = slice(start, start + rows)
            h, targets = self._hidden(input_ids[part], labels[part],
                                      None if attention_mask is None else attention_mask[part],
                                      None if position_ids is None else position_ids[part])
            piece_loss, piece_hits = chunked_scores(h, self.head.weight, targets)
            loss = piece_loss if loss is None else loss + piece_loss
            hits = piece_hits if hits is None else hits + piece_hits
        return loss, hits

    def _hidden(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The final normed hidden states ``[N, hidden]`` of the batch's real tokens, and their
        targets ``[N]`` (IGNORE_INDEX where no loss is taken)."""
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
            ids, pos, seg = input_ids, position_ids, Segments(mask=padding_mask(attention_mask))
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
            ids, pos, seg = input_ids, position_ids, Segments()

        # Large micro-batches run eagerly: the graph would cost its private pool and gain nothing
        # (core/plan.py's graphs_for, which the estimator follows too).
        limit = self.options.graph_token_limit
        graphed = (self._graphs is not None and torch.is_grad_enabled() and seg.mask is None
                   and (graphs_for(ids.numel(), 0.0, True) if limit is None else ids.numel() <= limit))
        if graphed:
            ids, pos, targets, seg = self._static_layout(ids, pos, targets, seg, t)
        h = self.backbone.embed_tokens(ids).to(self.dtype)
        if self.options.input_gradient_of_first_layer and torch.is_grad_enabled():
            h.requires_grad_(True)
        cos, sin = self.backbone.rotary_emb(h, pos)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        if graphed:
            h = self._graphs.run(h, cos, sin, seg)
        else:
            offload = (self._host is not None and torch.is_grad_enabled()
                       and offload_for(ids.numel(), 0.0, True))
            h = self.stack(h, cos, sin, seg, self._host if offload else None)
        return h.reshape(-1, h.shape[-1]), targets.reshape(-1)

    def stack(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
              host: HostInputs | None = None, sink=None) -> torch.Tensor:
        """The decoder layers and the final norm; with ``host``, each layer's saved input waits
        in that host memory (:class:`HostInputs`) instead of on the device; with ``sink``, the
        hoisted adapters are built from what it maps each parameter to (graphs.py's gradient
        sink)."""
        if host is not None:
            host.reset(len(self.layers))
        for index, layer in enumerate(self.layers):
            # Built outside the checkpoint: the recomputation then reuses them (fewer small ops). A
            # layer whose input waits on the host takes them hoisted either way: they are the
            # inputs through which OffloadedLayer hands the adapters their gradients.
            adapters = layer.adapters(sink) if self.options.hoist_adapters or host is not None else None
            if host is not None:
                spec, tensors = flatten(adapters)
                h = OffloadedLayer.apply(h, cos, sin, layer, seg, index, host, spec, *tensors)
            elif self.options.checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer.forward, h, cos, sin, seg, adapters, use_reentrant=False,
                               preserve_rng_state=False)  # nothing in a layer draws from the RNG
            else:
                h = layer.forward(h, cos, sin, seg, adapters)
        if host is not None:
            host.finish()
        return self.layers[0].norm(h, self.backbone.norm.weight) if self.layers else h

    def _static_layout(self, ids, pos, targets, seg: Segments, width: int):
        """Pad a flat stream to a layout that few CUDA graphs cover: its length rounded up to 256
        tokens, its example count (``cu``'s length) and longest example (``max_len``) bucketed to
        powers of two, and widened to the layout already captured for that length when there is
        one (graphs.py's ``fit``), so a stream of packed rows is one layout for the whole run.

        The padding tokens form examples of at most ``max_len`` tokens that take no loss and that
        no real token attends to; the remaining slots are empty examples (``cu`` repeats the
        stream's end), which the flash-attention kernel skips, so they cost no tokens. ``width``
        is the batch's row width: no example (a packed row's padding included) is longer."""
        if seg.cu is None:
            return ids, pos, targets, seg
        n_real = ids.shape[1]
        segs = seg.cu.numel() - 1
        total = -(-n_real // 256) * 256
        max_len = 1 << (max(width, seg.max_len, 128) - 1).bit_length()
        slots = max(32, 1 << (segs + -(-(total - n_real) // max_len)).bit_length())
        slots = max(slots, self._slots_floor)
        if self._graphs is not None:
            slots, max_len = self._graphs.fit(total, slots, max_len)
        pad = total - n_real
        device = ids.device
        pieces = [max_len] * (pad // max_len) + ([pad % max_len] if pad % max_len else [])
        ends = (n_real + torch.tensor(pieces).cumsum(0)).to(device=device, dtype=seg.cu.dtype)
        empty = slots - segs - len(pieces)
        cu = torch.cat([seg.cu, ends, torch.full((empty,), total, dtype=seg.cu.dtype, device=device)])
        ids = F.pad(ids, (0, pad))
        targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
        if pad:
            tail = torch.cat([torch.arange(n, device=device, dtype=pos.dtype) for n in pieces])
            pos = torch.cat([pos, tail[None]], dim=1)
        return ids, pos, targets, Segments(cu=cu, max_len=max_len)

    def _segments(self, pos: torch.Tensor) -> Segments:
        flat = pos[0]
        starts = torch.nonzero(flat == 0).flatten()
        n = flat.numel()
        if self.varlen is not None:
            cu = torch.cat([starts, torch.tensor([n], device=flat.device)]).to(torch.int32)
            max_len = int((cu[1:] - cu[:-1]).max())  # host sync: the kernel needs it as a number
            return Segments(cu=cu, max_len=max_len)
        example = torch.cumsum((flat == 0).long(), 0)
        same = example[:, None] == example[None, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=flat.device).tril_()
        return Segments(mask=(same & causal)[None, None])
