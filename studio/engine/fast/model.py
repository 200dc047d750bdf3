"""FastModel: the loss of a PEFT decoder model through the fast layers, with the batch laid out
as one flat stream of real tokens and the cross-entropy fused with the output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from studio.core.config import FastPathConfig
from studio.core.memory.phases import SCORE_TOKENS
from studio.core.plan import graphs_for, moe_graphs_off, offload_for
from studio.engine.fast.dropout import DropoutSeed
from studio.engine.fast.graphs import GradSink, Graphs
from studio.engine.fast.layer import Layer, Segments
from studio.engine.fast.loss import IGNORE_INDEX, chunked_scores, cross_entropy, next_token_targets, sequence_logps
from studio.engine.fast.moe import grouped_products
from studio.engine.fast.offload import HostInputs, OffloadedLayer, flatten
from studio.engine.fast.routing import KeptRouting, RouterLog


@dataclass(frozen=True)
class Ends:
    """What the model does before its first layer and after its last, beyond a Llama's (from its
    description, core/decoder); the defaults are a Llama's."""

    embed_scale: float | None = None
    """The embeddings are multiplied by this (Granite's embedding_multiplier); None: as the embedding
    module gives them (Gemma's scale its output themselves)."""
    embed_scale_rounded: bool = False
    """The scale is rounded to the embeddings' dtype first."""
    rope_keys: tuple[str, ...] = ()
    """The layer types the rotary module computes a table for (Gemma 3), stacked in this order
    (layer.py's ``table``); (): it computes one table."""
    rope_width: int = 0
    """Values of a head that rotate (the description's ``rotary_dim``). A rotary module whose tables
    hold each frequency once, half that wide (gpt-oss: its RoPE rotates the two halves of a head
    by one table), has them repeated to this width, the layout of every other family's tables."""
    final_eps: float | None = None
    """The final norm's eps; None: the first layer's."""
    logits_divisor: float = 1.0
    """The logits are divided by this (Granite's logits_scaling): folded into the hidden states."""
    final_softcap: float | None = None
    """Logits become ``tanh(z / cap) * cap`` before the loss (Gemma 2); None: not capped."""


class FastModel:
    """A PEFT decoder model's loss, computed by the fast path. Build it with :func:`prepare`."""

    _slots_floor = 0
    """The fewest example slots a CUDA-graph layout gets (:meth:`expect_examples`)."""

    def __init__(self, peft_model: nn.Module, layers: list[Layer], backbone: nn.Module, head: nn.Module,
                 dtype: torch.dtype, options: FastPathConfig, liger: dict | None, varlen: tuple | None,
                 ends: Ends | None = None, router: RouterLog | None = None, aux_coef: float = 0.0):
        self.peft_model = peft_model
        self.router = router
        """A mixture of experts' routing of the micro-batch (engine/fast/moe.py); None: dense layers."""
        self.aux_coef = aux_coef
        """The load-balancing loss' weight in the training loss (0: not added)."""
        self.ends = ends or Ends()
        """What comes before the first layer and after the last (:class:`Ends`)."""
        self.layers = layers
        self.backbone = backbone
        self.head = head
        self.dtype = dtype
        self.options = options
        """The run's ``trainer.fast_path`` settings."""
        self.liger = liger
        """liger-kernel's kernels (ops.liger_kernels), or None: torch's operations."""
        self.varlen = varlen
        """Flash-attention's varlen entry point (ops.Varlen), or None: SDPA."""
        device = backbone.embed_tokens.weight.device
        # Adapter dropout draws its masks from one seed tensor (engine/fast/dropout.py): graphs replay
        # them, recomputation regenerates them, and no RNG state is saved around a layer.
        dropping = any(any(p.dropout) for layer in layers for p in layer.projections())
        self._seed = DropoutSeed(device) if dropping else None
        if self._seed is not None:
            for index, layer in enumerate(layers):
                for k, proj in enumerate(layer.projections()):
                    proj.use_dropout(self._seed.tensor, first_site=(index * 4 + k) * 8)
        cuda = device.type == "cuda"
        # The load-balancing loss' gradient reaches the layers through torch's checkpointing only
        # (not through the host-offloaded layers' own backward); a mixture of experts is captured
        # where core/plan.py's moe_graphs_off allows (choose_path, the estimator's rule, is the same).
        offloading = options.host_offload and cuda and not aux_coef
        eager_moe = moe_graphs_off(router is not None, bool(aux_coef), grouped_products(dtype, device))
        self._graphs = Graphs(self, offloading) if options.cuda_graphs and cuda and not eager_moe else None
        self._host = HostInputs(device) if offloading else None
        """The eager steps' host buffers (each graphed layout has its own: graphs.py)."""

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

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy over the targets (``mean`` as ``model(...).loss``, or ``sum``).

        Targets are ``labels`` shifted left by one; a target whose token starts a new example (its
        position id is 0) is ignored, so no example is trained to predict the next one.
        """
        if self._seed is not None and torch.is_grad_enabled():
            self._seed.advance()  # this micro-batch's adapter-dropout masks
        h, targets = self._hidden(input_ids, labels, attention_mask, position_ids)
        loss = cross_entropy(h, self.head.weight, targets, reduction, self.liger, softcap=self.ends.final_softcap,
                             kernels=self.options.kernels)
        if self.router is None:
            return loss
        if torch.is_grad_enabled():
            self.router.tally()
        balance = self.router.balance_loss() if self.aux_coef else None
        if balance is not None:
            # transformers adds coef x aux to the mean loss: a sum carries it once per target
            weight = (targets != IGNORE_INDEX).sum() if reduction == "sum" else 1
            loss = loss + self.aux_coef * balance * weight
        return loss

    def take_expert_tokens(self) -> list[int]:
        """Token copies each expert took, summed over the sparse layers, in the training micro-batches
        since the last call ([] for a dense model): what a step logs."""
        return self.router.take_tokens() if self.router is not None else []

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
            piece_loss, piece_hits = chunked_scores(h, self.head.weight, targets, softcap=self.ends.final_softcap)
            loss = piece_loss if loss is None else loss + piece_loss
            hits = piece_hits if hits is None else hits + piece_hits
        return loss, hits

    def sequence_logps(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor, reference: bool = False, in_step: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the summed log-prob of its target tokens (``labels`` shifted as in :meth:`loss`),
        how many there are, and, without gradients, how many of them are the argmax (zeros with
        them): what engine/preference.py's DPO and ORPO take, without a ``tokens x vocab`` logits
        tensor (loss.py's :func:`~studio.engine.fast.loss.sequence_logps`). ``reference``: through
        the same layers with every adapter off, the base model (DPO's reference pass, under no_grad);
        ``in_step``: that of a training step whose policy pass over the same batch follows, laid out
        as the policy's and replayed as a CUDA graph in its pool where the policy's is graphed."""
        if self._seed is not None and torch.is_grad_enabled() and not reference:
            self._seed.advance()
        h, targets = self._hidden(input_ids, labels, attention_mask, position_ids, reference, in_step)
        wanted = next_token_targets(labels, position_ids) != IGNORE_INDEX
        if attention_mask is not None:
            wanted &= attention_mask.bool()
        scoring = not torch.is_grad_enabled() and not reference
        sums, hits = sequence_logps(h, self.head.weight, targets, wanted, self.liger, hits=scoring,
                                    softcap=self.ends.final_softcap)
        return sums, wanted.sum(1).float(), hits if hits is not None else torch.zeros_like(sums)

    def _hidden(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, reference: bool = False, in_step: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The final normed hidden states ``[N, hidden]`` of the batch's real tokens, and their
        targets ``[N]`` (IGNORE_INDEX where no loss is taken); ``reference``: the adapters off
        (``in_step``: a training step's, graphed as its policy pass is: :meth:`sequence_logps`). Their
        product with the head's weight is the logits (a logits divisor folded in), before any final
        soft-cap (``ends.final_softcap``)."""
        b, t = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
            else:
                position_ids = torch.arange(t, device=device).expand(b, t)
        targets = next_token_targets(labels, position_ids)

        # Host syncs, once per micro-batch: the batch's shape decides the attention layout.
        padded = attention_mask is not None and not bool(attention_mask.all())
        restarts = bool((position_ids[:, 1:] == 0).any())
        if padded or restarts:
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
        graphed = (self._graphs is not None and seg.mask is None and graphs_for(ids.numel(), 0.0, True)
                   and (in_step if reference else torch.is_grad_enabled()))
        if self.router is not None:
            self.router.begin(ids.numel())  # the real tokens, before a graph layout's padding
        if graphed:
            ids, pos, targets, seg = self._static_layout(ids, pos, targets, seg, t)
        h = self._embed(ids)
        cos, sin = self._rope(h, pos)
        if graphed:
            h = self._graphs.run_reference(h, cos, sin, seg) if reference else self._graphs.run(h, cos, sin, seg)
        else:
            offload = (self._host is not None and torch.is_grad_enabled() and not self.aux_coef
                       and offload_for(ids.numel(), 0.0, True))
            h = self.stack(h, cos, sin, seg, self._host if offload else None, reference=reference)
        if self.ends.logits_divisor != 1.0:
            h = h / self.ends.logits_divisor
        return h.reshape(-1, h.shape[-1]), targets.reshape(-1)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids`` in the compute dtype, scaled as the model scales them."""
        h = self.backbone.embed_tokens(ids)
        scale = self.ends.embed_scale
        if scale is not None:
            h = h * (torch.tensor(scale, dtype=h.dtype) if self.ends.embed_scale_rounded else scale)
        return h.to(self.dtype)

    def _rope(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (cos, sin) the layers read: the rotary module's one table ``[B, T, D]``,
        or one per layer type stacked ``[types, B, T, D]`` (``ends.rope_keys``)."""
        if not self.ends.rope_keys:
            cos, sin = self.backbone.rotary_emb(h, pos)
            if cos.shape[-1] * 2 == self.ends.rope_width:
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            return cos.to(self.dtype), sin.to(self.dtype)
        tables = [self.backbone.rotary_emb(h, pos, key) for key in self.ends.rope_keys]
        return (torch.stack([cos.to(self.dtype) for cos, _ in tables]),
                torch.stack([sin.to(self.dtype) for _, sin in tables]))

    def stack(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments,
              host: HostInputs | None = None, sink: GradSink | None = None, reference: bool = False) -> torch.Tensor:
        """The decoder layers and the final norm, each layer checkpointed (recomputed in the
        backward); with ``host``, each layer's saved input waits in that host memory
        (:class:`HostInputs`) instead of on the device; with ``sink``, the adapters are built from
        what it maps each parameter to (graphs.py's gradient sink); with ``reference``, every
        projection gets no adapter (the fused products then run the frozen base only)."""
        if host is not None:
            host.reset(len(self.layers))
        for index, layer in enumerate(self.layers):
            # Built outside the checkpoint: the recomputation then reuses them (fewer small ops),
            # and OffloadedLayer hands the adapters their gradients through them.
            adapters = tuple((None, None, 1.0) for _ in layer.projections()) if reference else layer.adapters(sink)
            # a sparse layer's routing, kept from the forward for the recomputation (moe.py)
            routing = KeptRouting() if layer.moe is not None and torch.is_grad_enabled() else None
            if host is not None:
                spec, tensors = flatten(adapters)
                h = OffloadedLayer.apply(h, cos, sin, layer, seg, index, host, spec, routing, *tensors)
            elif torch.is_grad_enabled():
                h = checkpoint(layer.forward, h, cos, sin, seg, adapters, use_reentrant=False,
                               preserve_rng_state=False, routing=routing)  # nothing in a layer draws from the RNG
            else:
                h = layer.forward(h, cos, sin, seg, adapters)
        if host is not None:
            host.finish()
        return self.layers[0].norm(h, self.backbone.norm.weight, self.ends.final_eps) if self.layers else h

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
        # host syncs: the kernel needs the longest example as a number, and attention in plain torch
        # (soft-caps, sinks) runs example by example
        first = starts.tolist()
        bounds = tuple(zip(first, [*first[1:], n], strict=True))
        if self.varlen is not None:
            cu = torch.cat([starts, torch.tensor([n], device=flat.device)]).to(torch.int32)
            return Segments(cu=cu, max_len=max(b - a for a, b in bounds), bounds=bounds)
        example = torch.cumsum((flat == 0).long(), 0)
        same = example[:, None] == example[None, :]
        causal = torch.ones(n, n, dtype=torch.bool, device=flat.device).tril_()
        return Segments(mask=(same & causal)[None, None], bounds=bounds)
