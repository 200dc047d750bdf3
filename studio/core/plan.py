"""Which training path a run takes: the GPU fast path (studio/engine/fast/) or the plain one.

One decision, made here in plain Python, so that the estimator (core/memory/, ``studio estimate``,
the VRAM pane) and the engine (engine/fast/build.py, on the live model) take it with the same code:
each gathers the facts it has into :class:`PathFacts` and calls :func:`choose_path`. The engine
still inspects every module before it builds the fast path; a refusal there that this function did
not foresee is a bug in one of the two.

Plain Python: core imports this; it must never import torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from studio.core.decoder import DECODER_FEATURES, DecoderSpec, MoeSpec, Refusal, describe_decoder, in_words
from studio.core.decoder.spec import EXPERT_PARAMETERS, EXPERTS, PHI3_FUSED, PROJECTIONS

if TYPE_CHECKING:
    from studio.core.config import RunConfig

FAST_PATH_ENV = "STUDIO_FAST_PATH"
"""``1`` forces the fast path on (also on CPU, for tests), ``0`` forces the plain path."""

EXPERT_TARGETS = tuple(f"{EXPERTS}.{name}" for name in EXPERT_PARAMETERS)
"""An expert adapter's target as the path decision names it (PEFT's ``target_parameters`` entry
``mlp.experts.gate_up_proj`` is ``experts.gate_up_proj`` here)."""

FUSED_PROJECTIONS = tuple(name for name, _ in PHI3_FUSED)
"""Phi-3's fused modules: LoRA targets of the fast path once it runs ``fused_projections``."""

FAST_FAMILIES = True
"""Whether the fast path (studio/engine/fast) runs every family core/decoder/ describes (Qwen2/3,
Gemma 1-3, Phi-3, OLMo 2, SmolLM3, Granite, Mistral with a sliding window) or, False, Llama-shaped
decoders only (Llama 2/3 with any RoPE scaling, Mistral without a window, SmolLM2...). True: the
engine's layers run every feature of core/decoder/features.py (tests/engine/test_fast_families.py)."""

SLOW_FEATURES = frozenset({"router_jitter", "qkv_clip"})
"""Features of core/decoder/features.py the fast path does not run: Mixtral's router jitter noise
and OLMoE's q/k/v clipping (no published checkpoint of either family sets them)."""

FAST_DECODER_FEATURES: frozenset[str] = DECODER_FEATURES - SLOW_FEATURES if FAST_FAMILIES else frozenset()
"""What the fast path runs beyond a Llama layer, by the names of core/decoder/features.py: every
family described, mixture-of-experts MLPs (Qwen3-MoE, OLMoE, Mixtral) included."""

FAST_METHODS = ("sft", "dpo", "orpo")
"""``trainer.method`` values the fast path computes the loss of: SFT's cross-entropy, and DPO's and
ORPO's per-answer log-probs (engine/preference.py through ``FastModel.sequence_logps``)."""

FAST_WEIGHTS = ("nf4", "fp4", "bf16", "fp16", "fp32")
"""Base-weight formats the fast path dequantizes or reads (LLM.int8 is not covered)."""


GRAPH_TOKEN_LIMIT = 4096
"""Micro-batches of more tokens than this run without CUDA graphs. Measured on an H100 (Llama-2-7B
NF4 r16, 8192 tokens a micro-batch, bench/results/archive/h100_vram_trainer.json): graphs gave no speed
(11,787 vs 11,959 tokens/s without) and cost 1.07 GiB of reserved memory (their private pool);
at 512 tokens they are what makes the step fast (the host's per-operation cost dominates there)."""


def graphs_for(tokens: int, lora_dropout: float, cuda: bool) -> bool:
    """Whether the fast path replays a micro-batch of ``tokens`` as a CUDA graph: CUDA only, and
    only where the host's cost matters. Adapter dropout keeps them: its masks come from a seed the
    graph reads on every replay (engine/fast/dropout.py); ``lora_dropout`` no longer matters."""
    return cuda and tokens <= GRAPH_TOKEN_LIMIT


def moe_graphs_off(moe: bool, router_aux: bool, grouped_products: bool) -> str:
    """Why a mixture of experts' steps run without CUDA graphs ('' where they may be captured),
    the one rule the engine (engine/fast/model.py) and the estimator (:func:`choose_path`) follow.
    Its layers' sort by expert, counts and grouped products are device work of a fixed shape, and
    its token counts go into fixed tensors (engine/fast/moe.py): captured. Not captured: the
    load-balancing loss, whose router probabilities reach the loss beside the stack's output, and
    the per-expert loop a card without the grouped product in the compute dtype runs, which reads
    each expert's rows on the host."""
    if not moe:
        return ""
    if router_aux:
        return "a mixture of experts with the load-balancing loss on (trainer.router_aux_loss_coef)"
    if not grouped_products:
        return ("a mixture of experts without torch's grouped product in the compute dtype "
                "(bf16, compute capability 8.0+)")
    return ""


def offload_for(tokens: int, lora_dropout: float, cuda: bool) -> bool:
    """Whether the fast path keeps each checkpointed layer's input in pinned host memory for a
    micro-batch of ``tokens`` (engine/fast/offload.py): on CUDA, on eager and graphed steps alike
    (each graphed layout copies to its own host buffers), with or without adapter dropout (a
    recomputation regenerates its masks); ``trainer.fast_path.host_offload: false`` turns it off
    for the whole run (:attr:`PathChoice.host_offload`). Measured on an H100 in bench/results/
    (docs/memory.md)."""
    return cuda


@dataclass(frozen=True)
class PathFacts:
    """What the decision depends on, as the estimator (from config files) or the engine (from the
    loaded model) knows it."""

    cuda: bool
    """Training runs on a CUDA GPU (the fast path is no faster on a CPU, so it is off there)."""

    weights: str
    """How the frozen base weights are stored: nf4, fp4, int8, bf16, fp16 or fp32."""

    lora_targets: tuple[str, ...]
    """Module names that carry a LoRA adapter (all-linear spelled out)."""

    lora_dropout: float = 0.0
    """Adapter dropout (the fast path keeps its CUDA graphs with it: counter-based masks)."""

    model_blocker: str = ""
    """Why the architecture is not covered ('' when it is): :func:`model_blocker` of its config."""

    env: str = ""
    """The value of STUDIO_FAST_PATH ('' when unset)."""

    dora: bool = False
    """``lora.use_dora``: DoRA's magnitude vectors are not part of the fast path's fused product."""

    method: str = "sft"
    """``trainer.method``: the fast path computes the losses of :data:`FAST_METHODS`."""

    full_finetune: bool = False
    """``lora: null``: every weight trains and there is no adapter; the fast path fuses LoRA products
    over frozen weights, so a full fine-tune takes the plain path."""

    cuda_graphs: bool = True
    """``trainer.fast_path.cuda_graphs``: the fast path may replay its steps as CUDA graphs."""

    host_offload: bool = True
    """``trainer.fast_path.host_offload``: the fast path keeps its layer inputs in host memory."""

    moe: bool = False
    """The model has mixture-of-experts layers (CUDA graphs as :func:`moe_graphs_off` allows)."""

    grouped_products: bool = True
    """torch's grouped product takes the compute dtype on the card: bf16 on a compute capability
    8.0+ card (the engine asks the card; the estimator's config: ``quantization.compute_dtype``
    auto or bfloat16). Without it a mixture of experts loops over its experts, eagerly."""

    router_aux: bool = False
    """A load-balancing loss is added (``trainer.router_aux_loss_coef``, or the model's own): its
    gradient reaches the layers through torch's checkpointing, so the layer inputs stay on the GPU."""

    @classmethod
    def from_config(cls, config: RunConfig, *, cuda: bool, weights: str, model_blocker: str,
                    targets: tuple[str, ...] | None = None, moe: MoeSpec | None = None) -> PathFacts:
        """The facts a run config gives (its LoRA section, method, ``STUDIO_FAST_PATH``) with what
        only the caller knows: the device, the base weights' format (from the quantization section,
        or read off the loaded model) and the architecture's :func:`model_blocker`. ``targets``: the
        LoRA targets as the model's module names when the caller has mapped them (default: the
        config's, ``all-linear`` spelled out). The estimator (core/memory/) and the engine's loader
        (engine/model.py ``fast_path_ahead``) both build their facts here. ``moe``: the model's
        sparse MLP where its layers have one (:func:`moe_facts`); with ``lora.target_experts`` its
        experts' weights are targets too."""
        lora = config.lora
        if targets is None:
            targets = lora_targets(lora.target_modules) if lora is not None else ()
        if lora is not None and lora.target_experts and moe is not None:
            targets = (*targets, *EXPERT_TARGETS)
        fast = config.trainer.fast_path
        return cls(cuda=cuda, weights=weights, lora_targets=tuple(targets),
                   lora_dropout=float(lora.dropout) if lora is not None else 0.0, model_blocker=model_blocker,
                   env=os.environ.get(FAST_PATH_ENV, ""), dora=bool(lora.use_dora) if lora is not None else False,
                   method=config.trainer.method, full_finetune=lora is None, cuda_graphs=fast.cuda_graphs,
                   host_offload=fast.host_offload, **moe_facts(moe, config.trainer.router_aux_loss_coef),
                   grouped_products=config.quantization.compute_dtype in ("auto", "bfloat16"))


@dataclass(frozen=True)
class PathChoice:
    """The decision and what it implies for memory and speed."""

    path: str
    """``"fast"`` or ``"plain"``."""

    reason: str
    """Why: for the plain path, what rules the fast one out; for the fast path, what it runs."""

    cuda_graphs: bool = False
    """The decoder stack is replayed as CUDA graphs (fast path, CUDA), for
    micro-batches of up to :data:`GRAPH_TOKEN_LIMIT` tokens (:func:`graphs_for`)."""

    checkpointing: bool = True
    """Whether activations are recomputed: always per layer on the fast path; the config decides on
    the plain one (the caller fills that in)."""

    host_offload: bool = False
    """The checkpointed layer inputs wait in pinned host memory (fast path, CUDA;
    :func:`offload_for`)."""

    eager: str = ""
    """Why the fast path's steps run without CUDA graphs although the settings allow them (a
    mixture of experts: :func:`moe_graphs_off`); '' otherwise."""

    def to_json_dict(self) -> dict:
        """The shape ``studio estimate --json`` carries under ``"plan"``."""
        return {"path": self.path, "reason": self.reason, "cuda_graphs": self.cuda_graphs,
                "checkpointing": self.checkpointing, "host_offload": self.host_offload}


def moe_facts(moe: MoeSpec | None, router_aux_loss_coef: float | None) -> dict[str, bool]:
    """:class:`PathFacts`' ``moe`` and ``router_aux`` for a model with this sparse MLP (None: a dense
    model; :func:`sparse_mlp` of its description) and a run's ``trainer.router_aux_loss_coef``."""
    return {"moe": moe is not None, "router_aux": moe is not None and moe.aux_coef(router_aux_loss_coef) > 0}


def sparse_mlp(spec: DecoderSpec | Refusal) -> MoeSpec | None:
    """The sparse MLP of a description whose layers have one (None: dense, or not described)."""
    return spec.moe if isinstance(spec, DecoderSpec) and spec.sparse_layers else None


def model_blocker(config: Mapping) -> str:
    """Why the fast path does not run a model with this config.json, or a loaded model's
    ``config.to_dict()`` ('' when it does): why Studio does not describe it (core/decoder/), or the
    features of its description the fast path does not run (:func:`decoder_blocker`)."""
    described = describe_decoder(config)
    if isinstance(described, Refusal):
        return str(described)
    return decoder_blocker(described)


def decoder_blocker(spec: DecoderSpec) -> str:
    """The features of ``spec`` outside :data:`FAST_DECODER_FEATURES`, the first three in words
    ('' when none)."""
    if not spec.model_type:  # transformers picks a class by model_type: which one is a guess here
        return "config.json names no model_type (sized as a Llama); the fast path takes the families it knows by name"
    missing = spec.features - FAST_DECODER_FEATURES
    if not missing:
        return ""
    return f"{spec.family}'s {in_words(missing, most=3)}: not in the fast path yet"


def fast_targets() -> tuple[str, ...]:
    """The modules a LoRA adapter may sit on for the fast path: the seven Llama projections,
    Phi-3's fused qkv_proj and gate_up_proj once the fast path runs fused projections, and the
    experts' parameters (PEFT's ``target_parameters``, named ``experts.<parameter>``) once it runs
    mixtures of experts."""
    fused = FUSED_PROJECTIONS if "fused_projections" in FAST_DECODER_FEATURES else ()
    experts = EXPERT_TARGETS if "mixture_of_experts" in FAST_DECODER_FEATURES else ()
    return PROJECTIONS + fused + experts


def choose_path(facts: PathFacts) -> PathChoice:
    """The path a run takes: fast where it covers the model and the setup, else plain."""
    if facts.env == "0":
        return PathChoice("plain", f"{FAST_PATH_ENV}=0")
    if facts.dora:
        return PathChoice("plain", "DoRA adapters (the fast path's fused LoRA product has no magnitude vector)")
    if facts.method not in FAST_METHODS:
        return PathChoice("plain", f"trainer.method is {facts.method}; the fast path computes the "
                          f"{', '.join(m.upper() for m in FAST_METHODS)} losses only")
    if not facts.cuda and facts.env != "1":
        return PathChoice("plain", "not on a CUDA device")
    if facts.full_finetune:
        return PathChoice("plain", "full fine-tuning: the fast path fuses LoRA products over frozen weights")
    if facts.model_blocker:
        return PathChoice("plain", facts.model_blocker)
    if facts.weights not in FAST_WEIGHTS:
        return PathChoice("plain", f"{'8-bit' if facts.weights == 'int8' else facts.weights} base weights")
    covered = fast_targets()
    others = [t for t in facts.lora_targets if t not in covered]
    if others:
        return PathChoice("plain", f"LoRA on {', '.join(others)} (the fast path covers {', '.join(covered)})")
    if not facts.lora_targets:
        return PathChoice("plain", "no LoRA adapter on the decoder's projections")
    eager_moe = moe_graphs_off(facts.moe, facts.router_aux, facts.grouped_products)
    graphs = facts.cuda and facts.cuda_graphs and not eager_moe
    offload = facts.cuda and facts.host_offload and not facts.router_aux
    what = "fused 4-bit LoRA products" if facts.weights in ("nf4", "fp4") else "fused LoRA products"
    if graphs:
        what += f", CUDA graphs up to {GRAPH_TOKEN_LIMIT} tokens a micro-batch"
    elif facts.cuda and facts.cuda_graphs:
        what += f", eager steps ({eager_moe})"
    if offload:
        what += ", layer inputs in host memory"
    what += ", per-layer checkpointing"
    if facts.method == "sft":
        what += ", fused cross-entropy"
    else:
        what += ", each answer's log-prob from the fused cross-entropy"
        if facts.method == "dpo":
            what += ", the reference pass through the same layers with the adapters off"
            if graphs:
                what += " (a CUDA graph in the policy's memory pool)"
    return PathChoice("fast", what, cuda_graphs=graphs, host_offload=offload,
                      eager=eager_moe if facts.cuda and facts.cuda_graphs else "")


def lora_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """A config's ``lora.target_modules`` as names (``all-linear``: the seven projections of a
    Llama-style model, lm_head excluded, as PEFT reads it)."""
    if isinstance(targets, str):
        return PROJECTIONS if targets == "all-linear" else (targets,)
    targets = tuple(targets)
    return PROJECTIONS if targets == ("all-linear",) else targets
