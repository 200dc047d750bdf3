"""The decoder description (studio/core/decoder/) on the config.json files Studio bundles and on tiny
configs of every family: what each layer is, what the fast path still lacks for it, what is refused
and why. Plain Python, as the UI reads it; tests/engine/test_decoder_transformers.py holds each fact
against transformers' own modules."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

from studio.cli import estimate as cli_estimate
from studio.core import plan
from studio.core.decoder import DECODER_FEATURES, DecoderSpec, Refusal, describe_decoder
from studio.core.decoder.families import reads_gelu_as_tanh
from studio.core.decoder.spec import POST_NORM, PRE_NORM, SANDWICH
from studio.core.model.info import ModelInfoError, bundled_config, from_config_dict, load_model_info
from studio.core.paths import sample_data_dir

BUNDLED = sorted(sample_data_dir().glob("model_configs/*/*/config.json"))


def bundled(ref: str) -> dict:
    return json.loads((sample_data_dir() / "model_configs" / ref / "config.json").read_text())


def described(config: dict) -> DecoderSpec:
    spec = describe_decoder(config)
    assert isinstance(spec, DecoderSpec), spec
    return spec


# Sizes published on each model card (or the Hub's safetensors total), in billions.
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6.74, "meta-llama/Llama-3.1-8B": 8.03, "mistralai/Mistral-7B-Instruct-v0.3": 7.25,
    "Qwen/Qwen2.5-7B": 7.61, "Qwen/Qwen3-4B": 4.02, "Qwen/Qwen3-8B": 8.19, "Qwen/Qwen3-14B": 14.8,
    "google/gemma-2-9b": 9.24, "google/gemma-3-4b-it": 4.30, "google/gemma-3-12b-it": 12.2,
    "microsoft/Phi-4-mini-instruct": 3.836, "allenai/OLMo-2-1124-7B": 7.30, "HuggingFaceTB/SmolLM3-3B-Base": 3.08,
    # gpt-oss' model card: 20.91B and 116.83B in all (the experts counted as the weights they stand for)
    "openai/gpt-oss-20b": 20.91, "openai/gpt-oss-120b": 116.83,
    # the model cards: 30.5B (3.3B active), 46.7B, 6.9B (1.3B active)
    "Qwen/Qwen3-30B-A3B": 30.5, "mistralai/Mixtral-8x7B-v0.1": 46.7, "allenai/OLMoE-1B-7B-0924": 6.92,
}
GPT_OSS = {"linear_bias", "norm_cast_after_scale", "sliding_window", "mixture_of_experts", "attention_sinks",
           "router_bias", "topk_softmax", "expert_bias", "clamped_swiglu", "interleaved_gate_up"}

# What each bundled model needs beyond a Llama layer (the fast path runs all of it).
NEEDS = {
    "meta-llama/Llama-2-7b-hf": set(), "meta-llama/Llama-3.1-8B": set(), "mistralai/Mistral-7B-Instruct-v0.3": set(),
    "Qwen/Qwen2.5-7B": {"linear_bias"},
    "Qwen/Qwen3-4B": {"qk_norm_head"}, "Qwen/Qwen3-8B": {"qk_norm_head"}, "Qwen/Qwen3-14B": {"qk_norm_head"},
    "google/gemma-2-9b": {"norm_offset", "norm_cast_after_scale", "post_norms", "gelu_tanh", "embed_scale",
                          "attn_softcap", "final_softcap", "sliding_window"},
    "google/gemma-3-4b-it": {"norm_offset", "norm_cast_after_scale", "post_norms", "gelu_tanh", "embed_scale",
                             "qk_norm_head", "sliding_window", "layer_rope", "nested_decoder"},
    "google/gemma-3-12b-it": {"norm_offset", "norm_cast_after_scale", "post_norms", "gelu_tanh", "embed_scale",
                              "qk_norm_head", "sliding_window", "layer_rope", "nested_decoder"},
    "microsoft/Phi-4-mini-instruct": {"fused_projections", "partial_rotary"},
    "allenai/OLMo-2-1124-7B": {"qk_norm_projection", "norm_cast_after_scale", "post_norms", "no_pre_norms"},
    "HuggingFaceTB/SmolLM3-3B-Base": {"no_rope_layers"},
    "openai/gpt-oss-20b": GPT_OSS, "openai/gpt-oss-120b": GPT_OSS,
    "Qwen/Qwen3-30B-A3B": {"qk_norm_head", "mixture_of_experts"}, "mistralai/Mixtral-8x7B-v0.1": {"mixture_of_experts"},
    "allenai/OLMoE-1B-7B-0924": {"qk_norm_projection", "mixture_of_experts"},
}


def test_every_family_of_issues_39_and_42_has_a_bundled_config():
    assert {f"{p.parent.parent.name}/{p.parent.name}" for p in BUNDLED} == set(PUBLISHED)


@pytest.mark.parametrize("ref", sorted(PUBLISHED))
def test_each_bundled_config_is_described_with_its_published_size(ref):
    spec = described(bundled(ref))
    assert spec.features == NEEDS[ref]
    assert from_config_dict(bundled(ref), ref).total_params() == pytest.approx(PUBLISHED[ref] * 1e9, rel=0.005)


def test_gemma_3_multimodal_text_tower_five_local_layers_to_one_global_each_with_its_rope():
    spec = described(bundled("google/gemma-3-4b-it"))
    assert (spec.model_type, spec.config_path, spec.decoder_path) == ("gemma3", ("text_config",),
                                                                     ("model", "language_model"))
    # text_config leaves heads, kv heads, head width and vocabulary to Gemma3TextConfig
    assert (spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.vocab) == (2560, 8, 4, 256, 262_208)
    assert [layer.attention for layer in spec.layers[:6]] == ["sliding_attention"] * 5 + ["full_attention"]
    local, global_ = spec.layers[0], spec.layers[5]
    assert (local.window, local.rope_key, local.rope.kind, local.rope.theta) == (1024, "sliding_attention", "default",
                                                                               10_000.0)
    assert (global_.window, global_.rope_key, global_.rope.kind, global_.rope.theta) == (None, "full_attention",
                                                                                       "linear", 1_000_000.0)
    assert spec.norms == SANDWICH and spec.qk_norm == "head" and spec.norm.offset == 1.0
    assert spec.embed_scale == math.sqrt(2560) and spec.embed_scale_rounded
    assert spec.attention_scale == 256 ** -0.5  # query_pre_attn_scalar
    assert spec.tied and spec.final_softcap is None and spec.attn_softcap is None
    assert 0.41e9 < spec.extra_params < 0.43e9  # SigLIP-So400m and the projector


def test_gemma_2_alternates_local_and_global_layers_and_caps_scores_and_logits():
    spec = described(bundled("google/gemma-2-9b"))
    assert [layer.window for layer in spec.layers[:4]] == [4096, None, 4096, None]
    assert {layer.rope_key for layer in spec.layers} == {None}
    assert (spec.attn_softcap, spec.final_softcap, spec.activation) == (50.0, 30.0, "gelu_pytorch_tanh")
    assert spec.norm.cast == "scaled" and spec.norms == SANDWICH


def test_phi_4_mini_fuses_its_projections_and_rotates_three_quarters_of_each_head():
    spec = described(bundled("microsoft/Phi-4-mini-instruct"))
    assert spec.linear_modules() == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert spec.linear_shapes()["qkv_proj"] == (3072, 3072 + 2 * 8 * 128)
    assert spec.linear_shapes()["gate_up_proj"] == (3072, 2 * 8192)
    assert (spec.parent("qkv_proj"), spec.parent("gate_up_proj")) == ("self_attn", "mlp")
    assert spec.lora_modules(["q_proj", "v_proj", "up_proj"]) == ("qkv_proj", "gate_up_proj")
    assert spec.lora_modules("all-linear") == spec.linear_modules()
    rope = spec.layers[0].rope
    assert (rope.kind, rope.rotary_dim, spec.head_dim) == ("longrope", 96, 128)
    # a 262144-token window over 131072 positions hides nothing: not a sliding-window model
    assert spec.layers[0].window == 262_144 and "sliding_window" not in spec.features


def test_olmo_2_norms_only_the_outputs_and_q_k_over_the_whole_projection():
    spec = described(bundled("allenai/OLMo-2-1124-7B"))
    assert spec.norms == POST_NORM and spec.norms.names() == ("post_attention_layernorm", "post_feedforward_layernorm")
    assert spec.qk_norm_widths() == (4096, 4096)
    assert (spec.norm.offset, spec.norm.cast) == (0.0, "scaled")


def test_smollm3_leaves_every_fourth_layer_without_rope():
    spec = described(bundled("HuggingFaceTB/SmolLM3-3B-Base"))
    assert [i for i, layer in enumerate(spec.layers) if layer.rope is None] == list(range(3, 36, 4))
    assert spec.layers[0].rope.theta == 5_000_000.0 and spec.tied


def test_gpt_oss_alternates_windows_sinks_its_heads_and_routes_to_biased_clamped_experts():
    spec = described(bundled("openai/gpt-oss-20b"))
    assert [layer.window for layer in spec.layers[:4]] == [128, None, 128, None]
    assert all(layer.sparse for layer in spec.layers) and spec.sinks
    assert (spec.head_dim, spec.heads * spec.head_dim, spec.hidden) == (64, 4096, 2880)
    assert spec.biases == ("q_proj", "k_proj", "v_proj", "o_proj") and spec.linear_modules() == spec.biases
    rope = spec.layers[0].rope
    assert (rope.kind, rope.theta, rope.rotary_dim) == ("yarn", 150_000.0, 64)
    assert spec.norm == spec.norm.__class__(0.0, "scaled", 1e-5)
    moe = spec.moe
    assert (moe.experts, moe.top_k, moe.intermediate, moe.router, moe.routing) == (32, 4, 2880, "router", "topk_softmax")
    assert (moe.router_bias, moe.expert_bias, moe.interleaved, moe.activation) == (True, True, True, "clamped_swiglu")
    assert (moe.swiglu_alpha, moe.swiglu_limit, moe.aux_coef(None), moe.aux_coef(0.01)) == (1.702, 7.0, 0.0, 0.01)
    info = from_config_dict(bundled("openai/gpt-oss-20b"), "openai/gpt-oss-20b")
    assert info.expert_format == "mxfp4"
    assert from_config_dict({**bundled("openai/gpt-oss-20b"), "quantization_config": None}, "bf16").expert_format == ""
    assert info.lora_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_llama_qwen_and_mistral_read_their_rope_biases_and_windows():
    llama = described(bundled("meta-llama/Llama-3.1-8B"))
    assert (llama.layers[0].rope.kind, llama.layers[0].rope.theta) == ("llama3", 500_000.0)
    assert llama.norms == PRE_NORM and llama.norm == llama.norm.__class__(0.0, "normed", 1e-5)
    qwen2 = described(bundled("Qwen/Qwen2.5-7B"))
    assert qwen2.biases == ("q_proj", "k_proj", "v_proj")  # never o_proj, whatever attention_bias says
    assert {layer.window for layer in qwen2.layers} == {None}  # sliding_window 131072, use_sliding_window false
    qwen3 = described(bundled("Qwen/Qwen3-8B"))
    assert (qwen3.head_dim, qwen3.heads * qwen3.head_dim, qwen3.hidden) == (128, 4096, 4096)
    mistral = described(bundled("mistralai/Mistral-7B-Instruct-v0.3"))
    assert {layer.window for layer in mistral.layers} == {None}  # an explicit null, not MistralConfig's 4096
    v01 = described({**bundled("mistralai/Mistral-7B-Instruct-v0.3"), "sliding_window": 4096})
    assert {layer.window for layer in v01.layers} == {4096} and v01.features == {"sliding_window"}


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128)
"""The sizes of the tiny configs below (hub-style config.json dicts; the torch tests build them)."""

FAMILY_CONFIGS = {
    "llama": dict(TINY, model_type="llama", attention_bias=True, mlp_bias=True, rope_theta=500_000.0,
                  rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32, "rope_type": "llama3"}),
    "mistral": dict(TINY, model_type="mistral", head_dim=32, sliding_window=8),
    "qwen2": dict(TINY, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2),
    "qwen3": dict(TINY, model_type="qwen3", head_dim=32, attention_bias=True),
    "gemma": dict(TINY, model_type="gemma", head_dim=16, hidden_act="gelu"),
    "gemma2": dict(TINY, model_type="gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(TINY, model_type="gemma3_text", head_dim=16, sliding_window=8, sliding_window_pattern=2,
                        rope_scaling={"factor": 4.0, "rope_type": "linear"}, rope_theta=100_000.0,
                        rope_local_base_freq=1_000.0, final_logit_softcapping=15.0, attn_logit_softcapping=20.0),
    "gemma3": dict(model_type="gemma3", mm_tokens_per_image=4,
                   text_config=dict(TINY, model_type="gemma3_text", head_dim=16, sliding_window=8,
                                    sliding_window_pattern=2, final_logit_softcapping=15.0),
                   vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
    "phi3": dict(TINY, model_type="phi3", num_key_value_heads=4, pad_token_id=0, partial_rotary_factor=0.5, sliding_window=16,
                 original_max_position_embeddings=32,
                 rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0]}),
    "olmo2": dict(TINY, model_type="olmo2", attention_bias=True),
    "smollm3": dict(TINY, model_type="smollm3", no_rope_layer_interval=2, pad_token_id=0),
    "granite": dict(TINY, model_type="granite", embedding_multiplier=12.0, attention_multiplier=0.0078125,
                    residual_multiplier=0.22, logits_scaling=16.0, tie_word_embeddings=True),
    "gpt_oss": dict(TINY, model_type="gpt_oss", head_dim=32, sliding_window=8, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=150_000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}),
}
"""One tiny config.json per model_type described, each with its family's peculiarities switched on."""


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_every_family_is_one_entry_that_describes_its_tiny_config(name):
    spec = described(FAMILY_CONFIGS[name])
    assert spec.num_layers == 4 and len(spec.linear_shapes()) in (4, 7)
    # all of it is what the fast path is to run; but exact GELU, which transformers 5.17 runs for
    # the first Gemma releases' "gelu"
    exact_gelu = {"activation:gelu"} if name == "gemma" and not reads_gelu_as_tanh() else set()
    assert spec.features - exact_gelu <= DECODER_FEATURES


def test_the_tiny_configs_switch_on_each_familys_peculiarities():
    spec = {name: described(config) for name, config in FAMILY_CONFIGS.items()}
    assert spec["llama"].biases == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert spec["mistral"].head_dim == 32 and {layer.window for layer in spec["mistral"].layers} == {8}
    assert [layer.window for layer in spec["qwen2"].layers] == [None, None, 8, 8]  # from max_window_layers on
    assert spec["qwen3"].biases == ("q_proj", "k_proj", "v_proj", "o_proj")
    # GemmaConfig's reading of the first releases' "gelu", which changed in transformers 5.18
    assert spec["gemma"].activation == ("gelu_pytorch_tanh" if reads_gelu_as_tanh() else "gelu")
    assert spec["gemma2"].attention_scale == 24 ** -0.5
    assert [layer.rope_key for layer in spec["gemma3_text"].layers] == ["sliding_attention", "full_attention"] * 2
    assert spec["gemma3_text"].final_softcap == 15.0 and spec["gemma3"].final_softcap is None
    assert spec["phi3"].layers[0].rope.rotary_dim == 8 and spec["phi3"].features >= {"sliding_window"}
    assert [layer.rope is None for layer in spec["smollm3"].layers] == [False, True, False, True]
    granite = spec["granite"]
    assert (granite.embed_scale, granite.embed_scale_rounded, granite.attention_scale, granite.residual_scale,
            granite.logits_divisor) == (12.0, False, 0.0078125, 0.22, 16.0)


def test_transformers_5_spelling_reads_as_the_hubs_older_one():
    """A loaded model's ``config.to_dict()`` (what the engine passes) nests RoPE by layer type."""
    older = FAMILY_CONFIGS["gemma3_text"]
    newer = {k: v for k, v in older.items() if k not in ("rope_scaling", "rope_theta", "rope_local_base_freq",
                                                          "sliding_window_pattern")}
    newer["layer_types"] = ["sliding_attention", "full_attention"] * 2
    newer["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}
    assert described(newer) == described(older)
    llama = bundled("meta-llama/Llama-3.1-8B")
    flat = {k: v for k, v in llama.items() if k not in ("rope_scaling", "rope_theta")}
    flat["rope_parameters"] = {**llama["rope_scaling"], "rope_theta": 500_000.0}
    assert described(flat) == described(llama)


@pytest.mark.parametrize(("config", "family", "why"), [
    ({"model_type": "qwen2_moe", "hidden_size": 2048, "num_experts": 60}, "qwen2_moe", "with a shared expert"),
    ({"model_type": "qwen2_moe", "num_experts": 60}, "qwen2_moe", "mixture-of-experts"),
    ({"model_type": "granitemoe", "num_local_experts": 40}, "granitemoe", "mixture-of-experts"),
    ({"model_type": "dbrx", "d_model": 6144}, "dbrx", "mixture-of-experts"),
    ({"model_type": "phimoe", "num_local_experts": 16}, "phimoe", "mixture-of-experts"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "deepseek_v3", "n_routed_experts: 256"),
    ({"model_type": "mamba", "state_size": 16}, "mamba", "state-space"),
    ({"model_type": "mamba2", "state_size": 128}, "mamba2", "state-space"),
    ({"model_type": "falcon_mamba", "state_size": 16}, "falcon_mamba", "state-space"),
    ({"model_type": "jamba", "num_experts": 16}, "jamba", "state-space"),
    ({"model_type": "t5", "d_model": 512, "is_encoder_decoder": True}, "t5", "encoder-decoder"),
    ({"model_type": "bart", "d_model": 768}, "bart", "encoder-decoder"),
    ({"model_type": "gpt_neox", **TINY}, "gpt_neox", "no entry"),
    ({"model_type": "llava", "text_config": {"model_type": "llama", **TINY}}, "llava", "no entry"),
    (dict(FAMILY_CONFIGS["gemma3_text"], use_bidirectional_attention=True), "gemma3_text", "not a causal LM"),
    ({"model_type": "llama", "hidden_size": 64, "vocab_size": 100}, "llama",
     "no intermediate_size, num_hidden_layers, num_attention_heads"),
])
def test_what_is_not_described_is_refused_in_one_line_naming_the_family(config, family, why):
    refused = describe_decoder(config)
    assert isinstance(refused, Refusal)
    line = str(refused)
    assert line.startswith(f"{family}: ") and why in line and "\n" not in line
    assert plan.model_blocker(config) == line  # the path decision says the same
    with pytest.raises(ModelInfoError, match=why):
        from_config_dict(config, "some/model")


@pytest.mark.parametrize("ref", sorted(PUBLISHED))
def test_the_fast_path_takes_every_bundled_family(ref, monkeypatch):
    config = bundled(ref)
    # FAST_FAMILIES: the engine runs them all, but Mixtral's router jitter and OLMoE's q/k/v clipping
    assert plan.FAST_DECODER_FEATURES == DECODER_FEATURES - plan.SLOW_FEATURES
    assert plan.model_blocker(config) == ""
    assert from_config_dict(config, ref).fast_path_blocker == ""
    # what a feature the engine did not run would say (the switch off: Llama-shaped decoders only)
    monkeypatch.setattr(plan, "FAST_DECODER_FEATURES", frozenset())
    blocked = plan.model_blocker(config)
    assert (blocked == "") == (not NEEDS[ref])
    if NEEDS[ref]:
        assert blocked.startswith(described(config).family + "'s ") and "not in the fast path yet" in blocked


def test_phi_3s_fused_modules_are_fast_targets_and_odd_activations_still_are_not(monkeypatch):
    assert plan.fast_targets()[-4:] == ("qkv_proj", "gate_up_proj", "experts.gate_up_proj", "experts.down_proj")
    relu = dict(FAMILY_CONFIGS["llama"], hidden_act="relu")
    assert plan.model_blocker(relu) == "Llama's relu-gated MLPs: not in the fast path yet"
    monkeypatch.setattr(plan, "FAST_DECODER_FEATURES", frozenset())
    assert "qkv_proj" not in plan.fast_targets()


@pytest.mark.parametrize(("ref", "folder"), [
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"), ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B"),
    ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"), ("google/gemma-3-4b-pt", "google/gemma-3-4b-it"),
    ("google/gemma-2-9b-it", "google/gemma-2-9b"), ("HuggingFaceTB/SmolLM3-3B", "HuggingFaceTB/SmolLM3-3B-Base"),
    ("allenai/OLMo-2-1124-7B-Instruct", "allenai/OLMo-2-1124-7B"),
    ("meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-hf"),
])
def test_a_variant_of_a_bundled_model_is_sized_from_its_config(ref, folder):
    assert bundled_config(ref) == sample_data_dir() / "model_configs" / folder / "config.json"


def test_offline_with_empty_caches_every_bundled_model_loads_by_its_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    for path in BUNDLED:
        ref = f"{path.parent.parent.name}/{path.parent.name}"
        assert load_model_info(ref).total_params() == from_config_dict(json.loads(Path(path).read_text()),
                                                                       ref).total_params()
    assert bundled_config("Qwen/Qwen3-32B") is None
    with pytest.raises(ModelInfoError, match="Qwen/Qwen3-32B: not a local folder"):
        load_model_info("Qwen/Qwen3-32B")


def test_studio_estimate_sizes_qwen3_8b_offline_on_the_path_the_engine_takes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("STUDIO_FAST_PATH", raising=False)
    config = tmp_path / "run.yaml"
    config.write_text("model: {base_model: someone/else}\nlora: {r: 16, target_modules: all-linear}\n"
                      "data: {max_seq_length: 1024}\ntrainer: {micro_batch_size: 4}\n")
    args = Namespace(config=str(config), gpu_gb=24.0, json=True, model="Qwen/Qwen3-8B")
    assert cli_estimate.main(args) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["path"] == "fast"
    monkeypatch.setattr(plan, "FAST_DECODER_FEATURES", frozenset())  # the engine before it ran Qwen3
    assert cli_estimate.main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["path"] == "plain" and plain["plan"]["reason"] == "Qwen3's per-head q/k norms: not in the fast path yet"
    assert fast["total"] < plain["total"]


@pytest.mark.parametrize(("version", "activation"), [("5.17.0", "gelu"), ("5.18.0", "gelu_pytorch_tanh"),
                                                     ("5.24.0", "gelu_pytorch_tanh"), ("6.0.0.dev0", "gelu_pytorch_tanh")])
def test_gemmas_legacy_gelu_is_read_as_the_installed_transformers_reads_it(version, activation, monkeypatch):
    monkeypatch.setattr("importlib.metadata.version", lambda name: version)
    assert described(FAMILY_CONFIGS["gemma"]).activation == activation


def test_a_config_that_names_no_model_type_is_sized_as_a_llama_but_not_taken_for_one():
    config = {k: v for k, v in bundled("meta-llama/Llama-2-7b-hf").items() if k != "model_type"}
    spec = described(config)
    assert (spec.model_type, spec.family, spec.features) == ("", "Llama", frozenset())
    assert from_config_dict(config, "x").total_params() == from_config_dict(bundled("meta-llama/Llama-2-7b-hf"),
                                                                            "x").total_params()
    assert plan.model_blocker(config).startswith("config.json names no model_type")


def test_what_a_4_bit_gpt_oss_stores_is_said_as_it_is():
    """A 4-bit gpt-oss keeps its shipped MXFP4 experts (only the other weights are NF4): `studio
    estimate` and the VRAM pane say both; a 16-bit load, or a dense model, says one format."""
    from studio.core.config import parse_config
    from studio.core.memory.plan import plan_for

    gpt_oss = from_config_dict(bundled("openai/gpt-oss-20b"), "openai/gpt-oss-20b")
    llama = from_config_dict(bundled("meta-llama/Llama-3.1-8B"), "meta-llama/Llama-3.1-8B")
    four = parse_config("model: {base_model: openai/gpt-oss-20b}\n")
    sixteen = parse_config("model: {base_model: openai/gpt-oss-20b}\nquantization: {bits: null}\n")
    assert plan_for(four, info=gpt_oss).stored == "NF4 weights, MXFP4 experts"
    assert plan_for(sixteen, info=gpt_oss).stored == "BF16 weights"
    assert plan_for(four, info=llama).stored == "NF4 weights"
