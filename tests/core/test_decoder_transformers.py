"""Each fact of the decoder description (studio/core/decoder/) held against transformers' own model:
every bundled config.json built at full size on the meta device (parameter count, modules, scales,
windows, RoPE tables), the tiny config of every family built on the CPU (the same, and the norms'
and embeddings' arithmetic), and a loaded model's ``config.to_dict()`` read as its config.json is."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from test_decoder import BUNDLED, FAMILY_CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.activations import ACT2FN

from studio.core.decoder import DecoderSpec, describe_decoder
from studio.core.model.info import from_config_dict


def build(config: AutoConfig, device: str = "meta", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def tiny_config(name: str) -> AutoConfig:
    config = dict(FAMILY_CONFIGS[name])
    return AutoConfig.for_model(config.pop("model_type"), **config)


def decoder_of(model: torch.nn.Module, spec: DecoderSpec) -> torch.nn.Module:
    module = model
    for name in spec.decoder_path:
        module = getattr(module, name)
    return module


def source(method) -> str:
    return inspect.getsource(method)


def attention_window(attn: torch.nn.Module) -> int | None:
    """The window transformers' attention passes: its own attribute, or the config's for the
    families that pass ``getattr(self.config, "sliding_window")`` on every layer (Mistral, Phi-3)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if "sliding_window=getattr(self.config" in source(type(attn).forward):
        return getattr(attn.config, "sliding_window", None)  # (OLMoE's config has none: transformers passes None)
    return None


def norm_eps(module: torch.nn.Module) -> float:
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def rope_parameters(text_config, key: str | None) -> dict:
    """transformers' own standardised RoPE parameters of a layer's table."""
    params = text_config.rope_parameters
    return params[key] if key is not None else params


def check(spec: DecoderSpec, model: torch.nn.Module) -> None:
    """Every fact of ``spec`` against the modules and the config transformers built."""
    decoder = decoder_of(model, spec)
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        assert hasattr(decoder, part), part
    text_config = model.config.get_text_config()
    assert (model.lm_head.weight is decoder.embed_tokens.weight) == spec.tied
    assert tuple(decoder.embed_tokens.weight.shape) == (spec.vocab, spec.hidden)
    assert norm_eps(decoder.norm) == spec.norm.eps

    if hasattr(decoder.embed_tokens, "scalar_embed_scale"):
        assert (decoder.embed_tokens.scalar_embed_scale, True) == (spec.embed_scale, spec.embed_scale_rounded)
    elif "embedding_multiplier" in source(type(decoder).forward):
        assert (decoder.embedding_multiplier, False) == (spec.embed_scale, spec.embed_scale_rounded)
    else:
        assert spec.embed_scale == 1.0
    model_forward = source(type(model).forward)
    final_softcap = text_config.final_logit_softcapping if "final_logit_softcapping" in model_forward else None
    assert final_softcap == spec.final_softcap
    assert (text_config.logits_scaling if "logits_scaling" in model_forward else 1.0) == spec.logits_divisor

    rotary = decoder.rotary_emb
    assert len(decoder.layers) == spec.num_layers
    for layer, described in zip(decoder.layers, spec.layers, strict=True):
        norms = {name for name, child in layer.named_children() if "Norm" in type(child).__name__}
        assert norms == set(spec.norms.names())
        assert {norm_eps(getattr(layer, name)) for name in norms} == {spec.norm.eps}
        attn, mlp = layer.self_attn, layer.mlp
        linears = {name for part in (attn, mlp) for name, child in part.named_children()
                   if isinstance(child, torch.nn.Linear)}
        assert linears == set(spec.linear_modules())
        for name in spec.linear_modules():
            fan_in, fan_out = spec.linear_shapes()[name]
            linear = getattr(getattr(layer, spec.parent(name)), name)
            assert (linear.in_features, linear.out_features) == (fan_in, fan_out), name
            assert (linear.bias is not None) == (name in spec.biases), name
        q, k = spec.qk_norm_widths()
        assert hasattr(attn, "q_norm") == (spec.qk_norm != "none")
        if q:
            assert (attn.q_norm.weight.shape[0], attn.k_norm.weight.shape[0]) == (q, k)
            assert norm_eps(attn.q_norm) == spec.norm.eps
        if described.sparse:
            check_sparse(spec, mlp)
        else:
            activation = getattr(mlp, "act_fn", None) or mlp.activation_fn
            assert type(activation) is type(ACT2FN[spec.activation])
        assert (getattr(attn, "sinks", None) is not None) == spec.sinks
        if spec.sinks:
            assert tuple(attn.sinks.shape) == (spec.heads,)
        assert attn.scaling == pytest.approx(spec.attention_scale, rel=1e-12)
        softcap = attn.attn_logit_softcapping if "softcap=self.attn_logit_softcapping" in source(
            type(attn).forward) else None
        assert softcap == spec.attn_softcap
        assert attention_window(attn) == described.window
        assert getattr(layer, "residual_multiplier", 1.0) == spec.residual_scale
        assert getattr(attn, "use_rope", True) == (described.rope is not None)
        if described.rope is None:
            continue
        if described.rope_key is None:
            kind, inv_freq = rotary.rope_type, rotary.inv_freq
        else:
            assert described.rope_key in rotary.layer_types
            kind, inv_freq = rotary.rope_type[described.rope_key], getattr(rotary, f"{described.rope_key}_inv_freq")
        assert kind == described.rope.kind
        assert 2 * inv_freq.shape[0] == described.rope.rotary_dim
        assert rope_parameters(text_config, described.rope_key)["rope_theta"] == described.rope.theta


def check_sparse(spec: DecoderSpec, mlp: torch.nn.Module) -> None:
    """A sparse layer's router and experts against its :class:`MoeSpec`."""
    moe = spec.moe
    router, experts = getattr(mlp, moe.router), mlp.experts
    assert tuple(router.weight.shape) == (moe.experts, spec.hidden) and router.top_k == moe.top_k
    assert (getattr(router, "bias", None) is not None) == moe.router_bias
    routing = source(type(router).forward)
    assert (routing.index("topk") < routing.index("softmax")) == (moe.routing == "topk_softmax")
    weights = sum(getattr(experts, n).numel() for n in ("gate_up_proj", "down_proj"))
    assert weights == moe.experts * 3 * spec.hidden * moe.intermediate
    assert getattr(experts, "has_bias", False) == moe.expert_bias
    assert (not getattr(experts, "is_concatenated", True)) == moe.interleaved
    clamped = hasattr(experts, "limit")
    assert clamped == (moe.activation == "clamped_swiglu")
    if clamped:
        assert (experts.alpha, experts.limit) == (moe.swiglu_alpha, moe.swiglu_limit)


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_each_bundled_config_at_full_size_is_what_transformers_builds(path):
    raw = json.loads(path.read_text())
    config = AutoConfig.from_pretrained(path.parent)
    model = build(config)
    spec = describe_decoder(raw)
    assert isinstance(spec, DecoderSpec)
    check(spec, model)
    assert from_config_dict(raw, path.parent.name).total_params() == sum(p.numel() for p in model.parameters())
    # the engine reads a loaded model's config.to_dict(): transformers 5.x's own spelling
    assert describe_decoder(config.to_dict()) == spec


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_each_familys_tiny_config_is_what_transformers_builds(name):
    config = tiny_config(name)
    model = build(config, "cpu")
    spec = describe_decoder(FAMILY_CONFIGS[name])
    assert isinstance(spec, DecoderSpec)
    check(spec, model)
    assert from_config_dict(FAMILY_CONFIGS[name], name).total_params() == sum(p.numel() for p in model.parameters())
    assert describe_decoder(config.to_dict()) == spec


def expected_norm(spec: DecoderSpec, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as the description says: the cast before the weight (``normed``) or after (``scaled``)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.norm.eps)
    if spec.norm.cast == "normed":
        return (spec.norm.offset + weight) * normed.to(x.dtype)
    return (normed * (spec.norm.offset + weight.float())).to(x.dtype)


@pytest.mark.parametrize("name", ["llama", "gemma", "gemma2", "gemma3_text", "olmo2", "qwen3", "gpt_oss"])
def test_every_norm_computes_as_described_in_bf16(name):
    torch.manual_seed(0)
    model = build(tiny_config(name), "cpu", torch.bfloat16)
    spec = describe_decoder(FAMILY_CONFIGS[name])
    layer = decoder_of(model, spec).layers[0]
    modules = [getattr(layer, n) for n in spec.norms.names()]
    if spec.qk_norm != "none":
        modules += [layer.self_attn.q_norm]
    for module in modules:
        with torch.no_grad():
            module.weight.normal_()
        x = torch.randn(5, module.weight.shape[0], dtype=torch.bfloat16) * 3
        assert torch.equal(module(x), expected_norm(spec, module.weight, x))
    other = "scaled" if spec.norm.cast == "normed" else "normed"
    wrong = DecoderSpec(**{**spec.__dict__, "norm": spec.norm.__class__(spec.norm.offset, other, spec.norm.eps)})
    assert not torch.equal(modules[0](x := torch.randn(64, modules[0].weight.shape[0], dtype=torch.bfloat16) * 3),
                           expected_norm(wrong, modules[0].weight, x))


def test_gemmas_embedding_scale_is_rounded_to_the_weights_dtype():
    config = dict(FAMILY_CONFIGS["gemma"], hidden_size=48)  # sqrt(48) is not a bf16 number
    spec = describe_decoder(config)
    model = build(AutoConfig.for_model(config.pop("model_type"), **config), "cpu", torch.bfloat16)
    embed = model.model.embed_tokens
    ids = torch.arange(40)
    rounded = embed.weight[ids] * torch.tensor(spec.embed_scale, dtype=torch.bfloat16)
    assert spec.embed_scale_rounded and torch.equal(embed(ids), rounded)
    assert not torch.equal(embed(ids), (embed.weight[ids].float() * spec.embed_scale).to(torch.bfloat16))
