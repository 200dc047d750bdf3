"""Which models the fast path covers, and building it for one: :func:`prepare` and :func:`enable`."""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn

from studio.core.config import FastPathConfig
from studio.core.plan import FAST_PATH_ENV, PathFacts, choose_path, model_blocker
from studio.engine.fast import norm
from studio.engine.fast.frozen import Workspace, is_4bit
from studio.engine.fast.layer import Layer
from studio.engine.fast.model import FastModel
from studio.engine.fast.ops import liger_kernels, varlen_attention
from studio.engine.fast.projection import Projection, has_adapter

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


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
    if not has_adapter(module, adapter):
        if isinstance(module, nn.Linear) or is_4bit(module):
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
    if weight is None or (not is_4bit(base) and weight.dtype not in (torch.bfloat16, torch.float16,
                                                                      torch.float32)):
        return "8-bit base weights"
    return ""


def prepare(model: nn.Module, options: FastPathConfig | None = None) -> tuple[FastModel | None, str]:
    """Build the fast path for a PEFT LoRA model, or return (None, why not). ``options``: the run's
    ``trainer.fast_path`` (default: everything on).

    Covered: Llama-architecture decoders (Llama, Mistral-style GQA, SmolLM, ...) without attention
    biases, LoRA on all seven projections (q, k, v, o, gate, up, down), base weights in 4-bit
    (bitsandbytes NF4/FP4) or a float dtype. Frozen float parameters kept in fp32 by
    ``prepare_model_for_kbit_training`` (norms, embeddings, head) are cast back to the compute dtype:
    they were loaded from it, so no information is lost, and the stream then stays in it.
    """
    options = options or FastPathConfig()
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
        for name in ATTN:
            why = _lora_module(getattr(attn, name, None) or nn.Identity(), adapter)
            if why:
                return None, f"{why} ({name})"
        for name in MLP:
            why = _lora_module(getattr(mlp, name, None) or nn.Identity(), adapter)
            if why:
                return None, f"{why} ({name})"

    if not any(has_adapter(getattr(layer.self_attn, n), adapter) for layer in layers for n in ATTN) and \
            not any(has_adapter(getattr(layer.mlp, n), adapter) for layer in layers for n in MLP):
        return None, "no LoRA adapter on the decoder's projections"
    dtype = _compute_dtype(layers[0])
    for module in (backbone.embed_tokens, backbone.norm, head, *[m for layer in layers for m in
                                                                 (layer.input_layernorm,
                                                                  layer.post_attention_layernorm)]):
        for p in module.parameters(recurse=False):
            if not p.requires_grad and p.dtype == torch.float32 and dtype != torch.float32 \
                    and _exact_in(p, dtype):
                p.data = p.data.to(dtype)

    half = dtype in (torch.bfloat16, torch.float16)
    liger = liger_kernels() if options.kernels and half else None
    device = backbone.embed_tokens.weight.device
    # Flash-attention kernels take half precision only: an fp32 model on CUDA keeps SDPA.
    varlen = varlen_attention() if device.type == "cuda" and half else None
    stream_norm = options.kernels and norm.available(device, dtype)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    built = []
    workspace = Workspace()
    proj = partial(Projection, adapter=adapter, dtype=dtype, workspace=workspace, kernels=options.kernels)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        built.append(Layer(
            qkv=proj([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=proj([attn.o_proj]),
            gate_up=proj([mlp.gate_proj, mlp.up_proj]),
            down=proj([mlp.down_proj]),
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            eps=float(getattr(layer.input_layernorm, "variance_epsilon", config.rms_norm_eps)),
            heads=int(config.num_attention_heads),
            kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=head_dim, liger=liger, varlen=varlen, norm_with_stream=stream_norm))
    workspace.allocate(dtype, device)
    return FastModel(model, built, backbone, head, dtype, options, liger, varlen), ""


def _compute_dtype(layer: nn.Module) -> torch.dtype:
    module = layer.self_attn.q_proj
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if is_4bit(base):
        dtype = getattr(base, "compute_dtype", None)
        return dtype if dtype is not None else torch.float32
    return base.weight.dtype


def _exact_in(p: torch.Tensor, dtype: torch.dtype) -> bool:
    """True when every value of ``p`` survives a round trip through ``dtype``."""
    with torch.no_grad():
        return bool(torch.equal(p.data.to(dtype).to(p.dtype), p.data))


def path_facts(model: nn.Module, device: torch.device, method: str = "sft",
               options: FastPathConfig | None = None) -> PathFacts:
    """What :func:`studio.core.plan.choose_path` decides on, read off the loaded PEFT model and the
    run's ``trainer.fast_path`` (the estimator reads the same facts off the config files)."""
    options = options or FastPathConfig()
    found, _ = _find(model)
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if hasattr(config, "to_dict") else {}
    adapter = getattr(model, "active_adapter", "default")
    adapter = adapter[0] if isinstance(adapter, (list, tuple)) and adapter else adapter
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if has_adapter(m, adapter)})
    peft_config = getattr(model, "peft_config", {}).get(adapter)
    weights = "bf16"
    if found is not None:
        first = found[2][0].self_attn.q_proj
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
                     host_offload=options.host_offload)


def enable(model: nn.Module, device: torch.device, method: str = "sft",
           options: FastPathConfig | None = None) -> tuple[FastModel | None, str]:
    """The fast path for a trainer's model, where :func:`studio.core.plan.choose_path` (the function
    the estimator uses too) picks it: on CUDA for covered models, off on CPU (where it is no faster);
    the environment variable ``STUDIO_FAST_PATH`` overrides. ``options``: the run's
    ``trainer.fast_path``. Returns (None, why) when off."""
    choice = choose_path(path_facts(model, device, method, options))
    if choice.path != "fast":
        return None, choice.reason
    return prepare(model, options)
