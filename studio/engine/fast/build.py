"""Which models the fast path covers, and building it for one: :func:`prepare` and :func:`enable`.

A model's layers are built from two things: its description (core/decoder's :class:`DecoderSpec`
of its config: norms and where they sit, q/k norms, activation, fused modules, scales, soft-caps,
each layer's window and RoPE) and its loaded modules (the weights, biases, norm weights and eps,
PEFT's adapters). Every family the description covers runs through the same :class:`Layer`; adding
one is an entry in core/decoder/families.py and its tests, nothing here.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from studio.core.config import FastPathConfig
from studio.core.decoder import DecoderSpec, Refusal, describe_decoder
from studio.core.decoder.spec import ATTENTION, EXPERT_PARAMETERS, EXPERTS, MLP
from studio.core.plan import (
    FAST_PATH_ENV,
    PathFacts,
    choose_path,
    decoder_blocker,
    model_blocker,
    moe_facts,
    sparse_mlp,
)
from studio.engine.fast import fused_attention, norm
from studio.engine.fast.attention import LLAMA, Span
from studio.engine.fast.frozen import Workspace, is_4bit
from studio.engine.fast.layer import LLAMA_NORM, Layer, NormKind
from studio.engine.fast.model import Ends, FastModel
from studio.engine.fast.moe import (
    ExpertProjection,
    SparseMlp,
    expert_problem,
    experts_adapted,
    experts_base,
    grouped_products,
)
from studio.engine.fast.ops import liger_kernels, varlen_attention
from studio.engine.fast.projection import Projection, has_adapter
from studio.engine.fast.routing import RouterLog

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def describe(model: nn.Module) -> DecoderSpec | Refusal:
    """The description of a loaded (PEFT-wrapped) model, from its config."""
    config = getattr(model, "config", None)
    return describe_decoder(config.to_dict() if hasattr(config, "to_dict") else {})


def _find(model: nn.Module, path: tuple[str, ...] = ("model",)):
    """The decoder stack, final norm and LM head of a PEFT-wrapped model whose decoder sits at
    ``path`` (the description's ``decoder_path``), or a reason."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = inner
    for name in path:
        backbone = getattr(backbone, name, None)
    head = getattr(inner, "lm_head", None)
    layers = getattr(backbone, "layers", None)
    if backbone is None or head is None or layers is None:
        return None, f"not a decoder-only model with {'.'.join(path)}.layers and lm_head"
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not hasattr(backbone, name):
            return None, f"the backbone has no {name}"
    return (backbone, head, layers), ""


def projection_groups(spec: DecoderSpec) -> tuple[tuple[str, ...], ...]:
    """The module names of a layer's four fused products (q/k/v, o, gate/up, down): Llama's, or the
    fused modules that hold their rows (Phi-3's qkv_proj and gate_up_proj)."""
    fused = {parts: name for name, parts in spec.fused}
    return ((fused[QKV],) if QKV in fused else QKV, ("o_proj",),
            (fused[GATE_UP],) if GATE_UP in fused else GATE_UP, ("down_proj",))


def _lora_module(module: nn.Module, adapter: str) -> str:
    """Why ``module`` cannot go through the fused product ('' when it can)."""
    if not has_adapter(module, adapter):
        if isinstance(module, nn.Linear) or is_4bit(module):
            return ""
        return f"a {type(module).__name__} projection"
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return "an adapter that is merged or disabled"
    if getattr(module, "use_dora", {}).get(adapter, False):
        return "DoRA adapters"
    weight = getattr(module.get_base_layer(), "weight", None)
    if weight is None or (not is_4bit(module.get_base_layer()) and weight.dtype not in (
            torch.bfloat16, torch.float16, torch.float32)):
        return "8-bit base weights"
    return ""


def _eps(module: nn.Module, default: float) -> float:
    """An RMSNorm module's eps (transformers names it variance_epsilon or eps)."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return default


def prepare(model: nn.Module, options: FastPathConfig | None = None,
            router_aux_loss_coef: float | None = None) -> tuple[FastModel | None, str]:
    """Build the fast path for a PEFT LoRA model, or return (None, why not). ``options``: the run's
    ``trainer.fast_path`` (default: everything on); ``router_aux_loss_coef``: the run's
    ``trainer.router_aux_loss_coef`` (a mixture of experts' load-balancing loss; None: as
    transformers trains the model, core/decoder's ``MoeSpec.aux_coef``).

    Covered: the decoders core/decoder/ describes whose features the fast path runs
    (core/plan.py's ``decoder_blocker``; mixture-of-experts layers through engine/fast/moe.py),
    LoRA on any of their linear projections (Phi-3's fused modules as PEFT names them) and on the
    experts' 3-D parameters (PEFT's ``target_parameters``), base weights in 4-bit (bitsandbytes
    NF4/FP4; experts as engine/quantized_experts.py packs them) or a float dtype.
    Frozen float parameters kept in fp32 by ``prepare_model_for_kbit_training`` (norms, embeddings,
    head, biases) are cast back to the compute dtype: they were loaded from it, so no information
    is lost, and the stream then stays in it.
    """
    options = options or FastPathConfig()
    spec = describe(model)
    if isinstance(spec, Refusal):
        return None, str(spec)
    blocked = decoder_blocker(spec)
    if blocked:
        return None, blocked
    found, why = _find(model, spec.decoder_path)
    if found is None:
        return None, why
    backbone, head, layers = found
    if len(layers) != spec.num_layers:
        return None, f"the model has {len(layers)} layers where its config describes {spec.num_layers}"
    adapter = getattr(model, "active_adapter", "default")
    if isinstance(adapter, (list, tuple)):
        if len(adapter) != 1:
            return None, "more than one active adapter"
        adapter = adapter[0]
    groups = projection_groups(spec)

    def module(layer: nn.Module, name: str) -> nn.Module | None:
        return getattr(getattr(layer, spec.parent(name), None), name, None)

    def linear(described) -> tuple[str, ...]:
        """The linear modules of a layer: a sparse one's MLP has none (its experts run apart)."""
        return tuple(n for group in (groups[:2] if described.sparse else groups) for n in group)

    for layer, described in zip(layers, spec.layers, strict=True):
        for name in linear(described):
            why = _lora_module(module(layer, name) or nn.Identity(), adapter)
            if why:
                return None, f"{why} ({name})"
        if described.sparse:
            mlp = getattr(layer, MLP, None)
            router = getattr(mlp, spec.moe.router, None)
            if getattr(router, "weight", None) is None or not hasattr(mlp, EXPERTS):
                return None, f"a sparse layer without {MLP}.{spec.moe.router}.weight and {MLP}.{EXPERTS}"
            if spec.moe.router_bias and getattr(router, "bias", None) is None:
                return None, f"a router without the bias its description has ({MLP}.{spec.moe.router}.bias)"
            why = expert_problem(getattr(mlp, EXPERTS), adapter) or _experts_as_described(mlp.experts, spec)
            if why:
                return None, why
        if spec.sinks and getattr(getattr(layer, ATTENTION, None), "sinks", None) is None:
            return None, f"an attention without the sinks its description has ({ATTENTION}.sinks)"
        for name in (*spec.norms.names(), *((("q_norm", "k_norm")) if spec.qk_norm != "none" else ())):
            found_norm = module(layer, name) if name in ("q_norm", "k_norm") else getattr(layer, name, None)
            if getattr(found_norm, "weight", None) is None:
                return None, f"a decoder layer without its {name}"
    if not any(has_adapter(m, adapter) for layer, described in zip(layers, spec.layers, strict=True)
               for n in linear(described) if (m := module(layer, n)) is not None) and not any(
            experts_adapted(layer.mlp.experts, adapter) for layer, described in zip(layers, spec.layers, strict=True)
            if described.sparse):
        return None, "no LoRA adapter on the decoder's projections"

    dtype = _compute_dtype(module(layers[0], groups[0][0]))
    moe = spec.moe if spec.sparse_layers else None
    if moe is not None and moe.activation == "clamped_swiglu":
        # what transformers' experts compute: 5.17 fixes alpha and limit in the module whatever the
        # config says, 5.24 reads them from it
        first = experts_base(next(layer.mlp.experts for layer, d in zip(layers, spec.layers, strict=True) if d.sparse))
        moe = replace(moe, swiglu_alpha=float(getattr(first, "alpha", moe.swiglu_alpha)),
                      swiglu_limit=float(getattr(first, "limit", moe.swiglu_limit)))
    router = (RouterLog(moe.experts, moe.top_k, moe.aux_coef(router_aux_loss_coef) > 0, len(layers),
                        backbone.embed_tokens.weight.device) if moe else None)
    frozen = [backbone.embed_tokens, backbone.norm, head]
    for layer in layers:
        frozen += [getattr(layer, name) for name in spec.norms.names()]
        if spec.qk_norm != "none":
            frozen += [module(layer, "q_norm"), module(layer, "k_norm")]
    for layer, described in zip(layers, spec.layers, strict=True):
        for name in linear(described):
            m = module(layer, name)
            frozen.append(m.get_base_layer() if hasattr(m, "get_base_layer") else m)
        if described.sparse:  # the router and the experts' 3-D weights
            frozen += [getattr(layer.mlp, moe.router), experts_base(layer.mlp.experts)]
    for m in frozen:
        for p in m.parameters(recurse=False):
            if not p.requires_grad and p.dtype == torch.float32 and dtype != torch.float32 and _exact_in(p, dtype):
                p.data = p.data.to(dtype)

    half = dtype in (torch.bfloat16, torch.float16)
    liger = liger_kernels() if options.kernels and half else None
    device = backbone.embed_tokens.weight.device
    # Flash-attention kernels take half precision only: an fp32 model on CUDA keeps SDPA.
    varlen = varlen_attention() if device.type == "cuda" and half else None
    kind = NormKind(spec.norm.offset, spec.norm.cast == "scaled")
    # NormBranch's kernel computes Llama's casting only
    stream_norm = options.kernels and norm.available(device, dtype) and kind == LLAMA_NORM
    head_dim = spec.head_dim
    # what flash attention has no kernel for (core/memory/fast.py's fused_attention foresees it)
    fused = ((spec.attn_softcap is not None or spec.sinks) and options.kernels
             and fused_attention.available(device, dtype, head_dim))
    # One RoPE table per layer type where the rotary module takes the type (Gemma 3), stacked
    keys = tuple(dict.fromkeys(s.rope_key for s in spec.layers if s.rope is not None and s.rope_key is not None))
    scale = None if math.isclose(spec.attention_scale, head_dim ** -0.5, rel_tol=1e-9) else spec.attention_scale
    q_width, kv_width = spec.heads * head_dim, spec.kv_heads * head_dim
    built = []
    workspace = Workspace()
    proj = partial(Projection, adapter=adapter, dtype=dtype, workspace=workspace, kernels=options.kernels)
    for index, (layer, described) in enumerate(zip(layers, spec.layers, strict=True)):
        qkv, o, gate_up, down = ([module(layer, n) for n in group] for group in groups)
        sparse = None
        if described.sparse:
            gate_up, down = (ExpertProjection(layer.mlp.experts, n, adapter, dtype, workspace, options.kernels)
                            for n in EXPERT_PARAMETERS)
            gate = getattr(layer.mlp, moe.router)
            sparse = SparseMlp(gate.weight, gate_up, down, moe, router, index,
                               router_bias=gate.bias if moe.router_bias else None, kernels=options.kernels)
        else:
            gate_up, down = proj(gate_up), proj(down)
        norms = {role: getattr(layer, name) if name else None for role, name in (
            ("attn_in", spec.norms.attn_in), ("attn_out", spec.norms.attn_out), ("mlp_in", spec.norms.mlp_in),
            ("mlp_out", spec.norms.mlp_out))}
        first_norm = next(m for m in norms.values() if m is not None)
        q_norm = module(layer, "q_norm") if spec.qk_norm != "none" else None
        k_norm = module(layer, "k_norm") if spec.qk_norm != "none" else None
        rope = described.rope
        span = Span(scale=scale, window=described.window, softcap=spec.attn_softcap)
        built.append(Layer(
            qkv=proj(qkv, split=[q_width, kv_width, kv_width] if len(qkv) == 1 else None),
            o=proj(o), gate_up=gate_up, down=down, moe=sparse,
            ln1=_weight(norms["attn_in"]), ln2=_weight(norms["mlp_in"]),
            eps=_eps(first_norm, spec.norm.eps),
            heads=spec.heads, kv_heads=spec.kv_heads, head_dim=head_dim, liger=liger, varlen=varlen,
            norm_with_stream=stream_norm, norm_kind=kind,
            attn_out=_weight(norms["attn_out"]), mlp_out=_weight(norms["mlp_out"]),
            qk_norm=spec.qk_norm, q_norm=_weight(q_norm), k_norm=_weight(k_norm),
            qk_eps=_eps(q_norm, spec.norm.eps) if q_norm is not None else 0.0,
            rope=rope is not None, partial=rope is not None and rope.rotary_dim < head_dim,
            table=keys.index(described.rope_key) if keys and rope is not None else None,
            span=span if span != Span() else LLAMA, activation=spec.activation,
            sinks=getattr(layer, ATTENTION).sinks if spec.sinks else None, fused_attention=bool(fused),
            residual_scale=spec.residual_scale))
    workspace.allocate(dtype, device)
    # Gemma's embedding modules scale their output themselves; Granite's model multiplies it.
    scales_itself = hasattr(backbone.embed_tokens, "embed_scale")
    ends = Ends(embed_scale=None if spec.embed_scale == 1.0 or scales_itself else spec.embed_scale,
                embed_scale_rounded=spec.embed_scale_rounded, rope_keys=keys,
                rope_width=max((s.rope.rotary_dim for s in spec.layers if s.rope is not None), default=0),
                final_eps=_eps(backbone.norm, spec.norm.eps), logits_divisor=spec.logits_divisor,
                final_softcap=spec.final_softcap)
    aux = moe.aux_coef(router_aux_loss_coef) if moe else 0.0
    return FastModel(model, built, backbone, head, dtype, options, liger, varlen, ends, router, aux), ""


def _experts_as_described(experts: nn.Module, spec: DecoderSpec) -> str:
    """Why an experts module is not laid out as the description says ('' when it is): gate and up
    interleaved or not (transformers' ``is_concatenated``), biases or not (``has_bias``)."""
    base = experts_base(experts)
    if bool(getattr(base, "is_concatenated", True)) == spec.moe.interleaved:
        which = "is not" if spec.moe.interleaved else "is"
        return f"experts whose gate/up {which} interleaved, unlike their description"
    if bool(getattr(base, "has_bias", False)) != spec.moe.expert_bias:
        return f"experts {'without' if spec.moe.expert_bias else 'with'} biases, unlike their description"
    return ""


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.weight


def _compute_dtype(module: nn.Module) -> torch.dtype:
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if is_4bit(base):
        dtype = getattr(base, "compute_dtype", None)
        return dtype if dtype is not None else torch.float32
    return base.weight.dtype


def _exact_in(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when every value of ``p`` survives a round trip through ``dtype``."""
    with torch.no_grad():
        return bool(torch.equal(p.data.to(dtype).to(p.dtype), p.data))


def _first_projection(layer: nn.Module) -> nn.Module | None:
    """The first linear module of a decoder layer (LoRA-wrapped or not): its base weights' format
    is the model's."""
    for m in layer.modules():
        if hasattr(m, "get_base_layer"):
            return m
        if isinstance(m, nn.Linear) or is_4bit(m):
            return m
    return None


def path_facts(model: nn.Module, device: torch.device, method: str = "sft",
               options: FastPathConfig | None = None, router_aux_loss_coef: float | None = None) -> PathFacts:
    """What :func:`studio.core.plan.choose_path` decides on, read off the loaded PEFT model and the
    run's ``trainer.fast_path`` and ``trainer.router_aux_loss_coef`` (the estimator reads the same
    facts off the config files)."""
    options = options or FastPathConfig()
    spec = describe(model)
    found, _ = _find(model, spec.decoder_path if isinstance(spec, DecoderSpec) else ("model",))
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    adapter = getattr(model, "active_adapter", "default")
    adapter = adapter[0] if isinstance(adapter, (list, tuple)) and adapter else adapter
    # The adapters the text decoder runs (its layers and the head): a multimodal checkpoint's vision
    # tower, which PEFT's all-linear adapts too, sees no text and trains on neither path.
    named = [*found[0].named_modules(), ("lm_head", found[1])] if found is not None else model.named_modules()
    # An expert adapter (PEFT's ParamWrapper, nested one a parameter) by the parameter it adapts
    targets = sorted({f"{EXPERTS}.{m.parameter_name}" if hasattr(m, "parameter_name") else name.rsplit(".", 1)[-1]
                      for name, m in named if has_adapter(m, adapter)})
    peft_config = getattr(model, "peft_config", {}).get(adapter)
    weights = "bf16"
    first = _first_projection(found[2][0]) if found is not None and len(found[2]) else None
    if first is not None:
        base = first.get_base_layer() if hasattr(first, "get_base_layer") else first
        if is_4bit(base):
            weights = str(base.weight.quant_state.quant_type)
        elif type(getattr(base, "weight", None)).__name__ == "Int8Params":
            weights = "int8"
        else:
            weights = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
                base.weight.dtype, str(base.weight.dtype))
    return PathFacts(cuda=device.type == "cuda", weights=weights, lora_targets=tuple(targets),
                     lora_dropout=float(getattr(peft_config, "lora_dropout", 0.0) or 0.0),
                     model_blocker=model_blocker(config_dict) if config_dict else "",
                     env=os.environ.get(FAST_PATH_ENV, ""), method=method,
                     dora=bool(getattr(peft_config, "use_dora", False)),
                     full_finetune=not hasattr(model, "peft_config"), cuda_graphs=options.cuda_graphs,
                     host_offload=options.host_offload, **moe_facts(sparse_mlp(spec), router_aux_loss_coef),
                     grouped_products=(sparse_mlp(spec) is None or first is None
                                       or grouped_products(_compute_dtype(first), device)))


def enable(model: nn.Module, device: torch.device, method: str = "sft", options: FastPathConfig | None = None,
           router_aux_loss_coef: float | None = None) -> tuple[FastModel | None, str]:
    """The fast path for a trainer's model, where :func:`studio.core.plan.choose_path` (the function
    the estimator uses too) picks it: on CUDA for covered models, off on CPU (where it is no faster);
    the environment variable ``STUDIO_FAST_PATH`` overrides. ``options``: the run's
    ``trainer.fast_path``; ``router_aux_loss_coef``: its ``trainer.router_aux_loss_coef``. Returns
    the fast model and what it runs, or (None, why not)."""
    choice = choose_path(path_facts(model, device, method, options, router_aux_loss_coef))
    if choice.path != "fast":
        return None, choice.reason
    fast, why = prepare(model, options, router_aux_loss_coef)
    return (fast, choice.reason) if fast is not None else (None, why)
