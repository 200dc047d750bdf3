"""A decoder-only causal LM described as data: :class:`DecoderSpec` and the parts it is made of.

One frozen value per model, built from its config.json by core/decoder/families.py. The estimator
counts parameters and activations from it (core/model/info.py, core/memory/), core/plan.py decides
from it whether the fast path runs the model, and the fast path (studio/engine/fast) builds its
layers from it and the loaded modules. Every fact here is one transformers' modelling code reads
from the config (transformers 5.17 to 5.24); the module names are the ones transformers gives.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from studio.core.decoder.features import features_of

NormCast = Literal["normed", "scaled"]
"""When an RMSNorm goes back to the input's dtype: ``normed``, the normalised fp32 value is cast and
then multiplied by the weight (Llama: ``w * x_normed.to(dtype)``); ``scaled``, the weight (plus the
offset) multiplies the fp32 value and the product is cast (Gemma, OLMo 2)."""

QKNorm = Literal["none", "head", "projection"]
"""RMSNorms on q and k before RoPE: ``head`` over each head's ``head_dim`` values after the reshape
(Qwen3, Gemma 3), ``projection`` over the whole q_proj / k_proj output before it (OLMo 2)."""

ATTENTION = "self_attn"
"""The attention module of a decoder layer (q/k/v/o projections, q/k norms) in every family here."""

MLP = "mlp"
"""The MLP module of a decoder layer in every family here."""

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""A Llama-style decoder layer's attention projections, by the module names PEFT targets."""

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""Its gated MLP's projections."""

PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
"""All seven linear modules of a layer none of which is fused: what PEFT's ``all-linear`` means for
a Llama-style model (lm_head excluded), and what the fast path fuses LoRA products for."""

PHI3_FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
"""Phi-3's fused modules and the Llama modules whose rows they hold, in order ([q; k; v], [gate; up])."""

ROUTER = "gate"
"""A sparse MLP's router module (``mlp.gate``: a ``[experts, hidden]`` weight) in the MoE families
here but gpt-oss, whose router is ``mlp.router`` (:attr:`MoeSpec.router`)."""

EXPERTS = "experts"
"""A sparse MLP's experts module (``mlp.experts``), whose 3-D parameters transformers 5.x stores as
``gate_up_proj [experts, 2 x intermediate, hidden]`` (gate's rows first) and ``down_proj [experts,
hidden, intermediate]``; gpt-oss' the other way round (``[experts, in, out]``, the module's
``is_transposed``), gate and up interleaved, and with a bias each (``gate_up_proj_bias``,
``down_proj_bias``)."""

MoeActivation = Literal["silu", "clamped_swiglu"]
"""An expert's gated activation: ``silu`` (``silu(gate) * up``), or gpt-oss' clamped SwiGLU
(``gate`` clamped above at the limit, ``up`` to [-limit, limit], then
``gate * sigmoid(alpha * gate) * (up + 1)``)."""

Routing = Literal["softmax_topk", "topk_softmax"]
"""How a router turns its logits into each token's experts and weights: ``softmax_topk``, the
softmax over every expert then the top k (renormalised where :attr:`MoeSpec.renormalize`:
Qwen3-MoE, OLMoE, Mixtral); ``topk_softmax``, the top k logits then the softmax over those k
(gpt-oss: the same weights as a renormalised softmax_topk, in its order of operations)."""

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The experts module's parameters, by the names PEFT's ``target_parameters`` takes
(``mlp.experts.gate_up_proj``): one LoRA adapter per expert, stacked in one A and one B."""


@dataclass(frozen=True)
class NormSpec:
    """How every RMSNorm of the model computes (the layers', the final one, the q/k norms)."""

    offset: float
    """Added to the weight before it scales: 1.0 for Gemma 1-3 (``x * (1 + w)``, weights init at 0), else 0."""

    cast: NormCast
    """When the result goes back to the input's dtype (:data:`NormCast`)."""

    eps: float
    """``rms_norm_eps``: added to the mean square under the root."""


@dataclass(frozen=True)
class NormPlacement:
    """Which norm module of a decoder layer sits where, by role (None: no norm there).

    Pre-norm (Llama): ``attn_in`` input_layernorm, ``mlp_in`` post_attention_layernorm (which,
    despite its name, normalises the MLP's input). Sandwich (Gemma 2, 3): all four. Post-only
    (OLMo 2): ``attn_out`` and ``mlp_out``, each on a branch's output before the residual add."""

    attn_in: str | None
    """Normalises the residual stream before attention."""

    attn_out: str | None
    """Normalises the attention's output before it is added to the residual stream."""

    mlp_in: str | None
    """Normalises the residual stream before the MLP."""

    mlp_out: str | None
    """Normalises the MLP's output before it is added to the residual stream."""

    def names(self) -> tuple[str, ...]:
        """The norm modules a layer holds, in the order the layer runs them."""
        return tuple(n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n)


PRE_NORM = NormPlacement("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = NormPlacement("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm")
POST_NORM = NormPlacement(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True)
class RopeSpec:
    """The rotary embedding a layer applies; the model's own rotary module computes its cos/sin."""

    kind: str
    """``rope_type``: default, linear, llama3, yarn, longrope, dynamic..."""

    theta: float
    """``rope_theta``: the base of the frequencies."""

    rotary_dim: int
    """Leading values of each head that rotate (``head_dim * partial_rotary_factor``); the rest
    pass through unchanged (Phi-4-mini rotates 96 of 128)."""


@dataclass(frozen=True)
class MoeSpec:
    """A sparse (mixture-of-experts) MLP: a router picks ``top_k`` of ``experts`` gated MLPs for each
    token and sums their outputs weighted by its probabilities (transformers' ``*SparseMoeBlock``:
    Qwen3-MoE, OLMoE, Mixtral)."""

    experts: int
    """Experts in each sparse layer (``num_experts``, or Mixtral's ``num_local_experts``)."""

    top_k: int
    """Experts each token goes through (``num_experts_per_tok``)."""

    intermediate: int
    """Width of one expert's gate and up outputs (``moe_intermediate_size``; Mixtral and OLMoE:
    ``intermediate_size``)."""

    renormalize: bool
    """The router's softmax over all experts, then the top k, then (True) those k probabilities
    divided by their sum (``norm_topk_prob``; Mixtral always); False: the k probabilities as they are."""

    aux_loss_coef: float
    """``router_aux_loss_coef``: the load-balancing loss' weight where it is added."""

    aux_loss_on: bool
    """``output_router_logits``: transformers adds the load-balancing loss to a training loss."""

    shared_experts: int = 0
    """Experts every token goes through besides the routed ones (none in the families here)."""

    router: str = ROUTER
    """The router module's name under the MLP (``gate``; gpt-oss: ``router``)."""

    routing: Routing = "softmax_topk"
    """The order of the router's softmax and top-k (:data:`Routing`)."""

    router_bias: bool = False
    """The router's logits carry a bias (``mlp.router.bias``: gpt-oss)."""

    expert_bias: bool = False
    """Each expert's gate/up and down add a bias (``gate_up_proj_bias [experts, 2 x intermediate]``,
    ``down_proj_bias [experts, hidden]``: gpt-oss); the down bias is weighted by the routing weight
    with the rest of the expert's output."""

    activation: MoeActivation = "silu"
    """The experts' gated activation (:data:`MoeActivation`)."""

    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's sigmoid gain (``swiglu_alpha``; transformers 5.17 fixes it at 1.702)."""

    swiglu_limit: float = 7.0
    """The clamped SwiGLU's clamp (``swiglu_limit``; transformers 5.17 fixes it at 7.0)."""

    interleaved: bool = False
    """gate_up's outputs alternate gate, up, gate, up... (gpt-oss) instead of gate's block first."""

    def aux_coef(self, setting: float | None) -> float:
        """The load-balancing loss' weight a run adds: ``trainer.router_aux_loss_coef`` where set,
        else what transformers adds when it trains the model (the config's coefficient where
        ``output_router_logits``, else none)."""
        if setting is not None:
            return float(setting)
        return self.aux_loss_coef if self.aux_loss_on else 0.0

    def routed_params(self, hidden: int) -> int:
        """Parameters of one sparse layer's experts (gate, up and down of each, their biases included)."""
        return self.experts * 3 * hidden * self.intermediate + self.expert_bias_params(hidden)

    def expert_bias_params(self, hidden: int) -> int:
        """Parameters of one sparse layer's expert biases (0 without :attr:`expert_bias`)."""
        return self.experts * (2 * self.intermediate + hidden) if self.expert_bias else 0

    def router_params(self, hidden: int) -> int:
        """Parameters of one sparse layer's router (its bias included)."""
        return self.experts * (hidden + (1 if self.router_bias else 0))


@dataclass(frozen=True)
class LayerSpec:
    """What differs from one decoder layer to the next: its attention span and its RoPE."""

    attention: str
    """The layer's type as transformers names it: ``full_attention`` or ``sliding_attention``."""

    window: int | None
    """A query attends to itself and the ``window - 1`` tokens before it (transformers'
    ``sliding_window``; flash attention's ``window_size=(window - 1, 0)``); None: every earlier token."""

    rope: RopeSpec | None
    """The rotation of q and k; None for a layer without RoPE (SmolLM3's ``no_rope_layers[i] == 0``)."""

    rope_key: str | None
    """The ``layer_type`` argument the model's rotary module takes for this layer's table
    (Gemma 3: ``rotary_emb(x, position_ids, layer_type)``); None where it takes none."""

    sparse: bool = False
    """The layer's MLP is the decoder's mixture of experts (:class:`MoeSpec`), not a dense gated MLP
    (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step`` keep some dense)."""


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder-only causal LM's layer as data: dimensions, norms, biases, activation, fused
    modules, scales, soft-caps and each layer's attention span and RoPE. Built by
    :func:`studio.core.decoder.describe_decoder` from a config.json."""

    model_type: str
    """config.json's ``model_type`` (the outer one for a multimodal checkpoint: ``gemma3``); ''
    when it names none, which is sized as a Llama but not taken for one on the fast path."""

    family: str
    """What a person calls the family (Llama, Qwen3, Gemma 3...)."""

    config_path: tuple[str, ...]
    """Where the text decoder's keys sit in config.json: () or ("text_config",) (Gemma 3 checkpoints)."""

    decoder_path: tuple[str, ...]
    """Attributes from the loaded ``AutoModelForCausalLM`` to the module holding embed_tokens,
    layers, norm and rotary_emb: ("model",), or ("model", "language_model") for Gemma 3's multimodal
    Gemma3ForConditionalGeneration (its lm_head stays at the top)."""

    hidden: int
    """``hidden_size``: width of the residual stream."""

    intermediate: int
    """``intermediate_size``: width of the gated MLP's gate and up outputs."""

    heads: int
    """``num_attention_heads``."""

    kv_heads: int
    """``num_key_value_heads`` (grouped-query attention when fewer than heads)."""

    head_dim: int
    """Width of one head: config.json's ``head_dim`` or hidden / heads (Qwen3 128, Gemma 256)."""

    vocab: int
    """``vocab_size``: rows of the embedding and of the output head."""

    max_positions: int
    """``max_position_embeddings``."""

    tied: bool
    """The output head is the embedding matrix (``tie_word_embeddings`` of the loaded top model)."""

    norm: NormSpec
    """How every RMSNorm computes."""

    norms: NormPlacement
    """The layer's norm modules by role."""

    qk_norm: QKNorm
    """Norms on q and k (modules ``q_norm`` and ``k_norm`` of the attention)."""

    biases: tuple[str, ...]
    """Linear modules of a layer that carry a bias (frozen; added by the base product)."""

    activation: str
    """The gated MLP's activation as transformers' ACT2FN names it: ``down(act(gate) * up)``;
    silu (SwiGLU) or gelu_pytorch_tanh (GeGLU: the Gemma family)."""

    fused: tuple[tuple[str, tuple[str, ...]], ...]
    """Modules that hold several projections' rows, and which, in order (Phi-3: :data:`PHI3_FUSED`);
    LoRA targets the fused module as PEFT names it, one adapter over its whole output."""

    embed_scale: float
    """The embeddings are multiplied by this (Gemma: sqrt(hidden); Granite: embedding_multiplier)."""

    embed_scale_rounded: bool
    """The scale is first rounded to the embedding weight's dtype (Gemma's scaled embedding module
    keeps it as a buffer cast to the weight's dtype: sqrt(3072) becomes 55.5 in bf16); else a
    Python float multiplies (Granite)."""

    attention_scale: float
    """What q.k is multiplied by before the softmax: head_dim ** -0.5; Gemma 2/3
    query_pre_attn_scalar ** -0.5; Granite attention_multiplier."""

    attn_softcap: float | None
    """Attention scores become ``tanh(s / cap) * cap`` before the mask (Gemma 2); None: not capped."""

    final_softcap: float | None
    """Logits become ``tanh(z / cap) * cap`` (Gemma 2, Gemma 3 text); None: not capped."""

    residual_scale: float
    """Each branch's output is multiplied by this before the residual add (Granite residual_multiplier)."""

    logits_divisor: float
    """The logits are divided by this (Granite logits_scaling)."""

    layers: tuple[LayerSpec, ...]
    """Every decoder layer, in order."""

    extra_params: int = 0
    """Parameters outside the text decoder that load with it (Gemma 3's vision tower and projector)."""

    moe: MoeSpec | None = None
    """The sparse MLP of the layers whose :attr:`LayerSpec.sparse` is set; None: a dense decoder."""

    router_jitter: float = 0.0
    """Mixtral's ``router_jitter_noise``: in training, the sparse MLP's input is multiplied by noise
    drawn from [1 - j, 1 + j] (0: none)."""

    qkv_clip: float | None = None
    """OLMoE's ``clip_qkv``: q, k and v are clamped to [-clip, clip] (None: not clamped)."""

    sinks: bool = False
    """Each attention head has a learned sink (``self_attn.sinks [heads]``: gpt-oss): a logit that
    joins every query's softmax denominator and attends to nothing, so a query may give its keys
    less than all of its weight."""

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is the mixture of experts."""
        return sum(1 for layer in self.layers if layer.sparse)

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers``."""
        return len(self.layers)

    @property
    def features(self) -> frozenset[str]:
        """What this decoder needs beyond a Llama layer (core/decoder/features.py names them)."""
        return features_of(self)

    def linear_modules(self) -> tuple[str, ...]:
        """A layer's linear modules in the order it runs them, as named in the model (and by PEFT);
        a decoder whose every MLP is sparse has the attention's only (its router and experts are
        not linear modules)."""
        if self.layers and all(layer.sparse for layer in self.layers):
            return ATTENTION_PROJECTIONS
        return linear_modules(self.fused)

    def parent(self, module: str) -> str:
        """The attention or the MLP module a linear module (or q/k norm) belongs to."""
        attention = {*ATTENTION_PROJECTIONS, "q_norm", "k_norm"}
        attention.update(f for f, parts in self.fused if set(parts) <= attention)
        return ATTENTION if module in attention else MLP

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear module of a layer, by :meth:`linear_modules`."""
        return linear_shapes(self.hidden, self.intermediate, self.heads * self.head_dim,
                             self.kv_heads * self.head_dim, self.fused)

    def lora_modules(self, targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """A config's ``lora.target_modules`` as this model's module names (:func:`lora_modules`;
        ``all-linear`` is :meth:`linear_modules`)."""
        if targets == "all-linear" or list(targets) == ["all-linear"]:
            return self.linear_modules()
        return lora_modules(targets, self.fused)

    def qk_norm_widths(self) -> tuple[int, int]:
        """Weights of the q and k norms of a layer (0, 0 without them)."""
        if self.qk_norm == "head":
            return self.head_dim, self.head_dim
        if self.qk_norm == "projection":
            return self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 0, 0


def linear_modules(fused: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[str, ...]:
    """A layer's linear modules in order when ``fused`` modules hold some of Llama's seven."""
    holders = dict.fromkeys(next((f for f, parts in fused if name in parts), name) for name in PROJECTIONS)
    return tuple(holders)


def linear_shapes(hidden: int, intermediate: int, q: int, kv: int,
                  fused: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear module of a layer whose q projection is ``q`` wide
    and k and v ``kv`` wide; a fused module's output is its parts' outputs stacked."""
    h, i = hidden, intermediate
    in_out = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))  # q, k, v, o, gate, up, down
    separate = dict(zip(PROJECTIONS, in_out, strict=True))
    parts = dict(fused)
    return {name: (separate[parts[name][0]][0], sum(separate[p][1] for p in parts[name])) if name in parts
            else separate[name] for name in linear_modules(fused)}


def lora_modules(targets: str | tuple[str, ...] | list[str],
                 fused: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> tuple[str, ...]:
    """A config's ``lora.target_modules`` as module names: ``all-linear`` is every linear module of a
    layer (lm_head excluded, as PEFT reads it); a Llama name becomes the fused module holding it
    (Phi-3: q_proj is qkv_proj); other names pass through."""
    if isinstance(targets, str):
        targets = (targets,)
    if tuple(targets) == ("all-linear",):
        return linear_modules(fused)
    names = (next((f for f, parts in fused if t in parts), t) for t in targets)
    return tuple(dict.fromkeys(names))
