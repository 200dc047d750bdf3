"""Every family core/decoder/ describes, on the fast path (studio/engine/fast), on the CPU in fp32:
the loss and every LoRA gradient equal those of transformers' own model wrapped by PEFT, for a
padded batch and a packed one (transformers 5.x keeps packed examples apart when it is given the
restarting position ids, no attention mask and no cache), with the layers recomputed by torch's
checkpointing and with their inputs (and q, k, v) kept on the host. Tiny random configs
(tests/helpers/tiny_families.py), LoRA on every linear projection with B initialised non-zero.
Mixture-of-experts families without a fast MLP, state-space and encoder-decoder models are refused in
one line; the mixtures of experts that run are tests/engine/test_fast_moe.py's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers.tiny_families import lora_targets, tiny_config
from torch import nn

from studio.core.config import FastPathConfig
from studio.core.decoder import DECODER_FEATURES
from studio.core.plan import SLOW_FEATURES
from studio.engine import fast
from studio.engine.batching import collate
from studio.engine.fast.build import describe
from studio.engine.fast.dropout import dropout

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2.0] * 6,
             "original_max_position_embeddings": 64}

CASES: dict[str, tuple[str, dict, set[str]]] = {
    # name: (tiny_families entry, config overrides, features the description must show)
    "llama2": ("llama", dict(tie_word_embeddings=False), set()),
    "llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE), set()),
    "mistral": ("mistral", dict(sliding_window=8), {"sliding_window"}),  # shorter than the rows
    "qwen2": ("qwen2", {}, {"linear_bias"}),
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True), {"linear_bias"}),  # on every projection
    "qwen3": ("qwen3", {}, {"qk_norm_head"}),
    "gemma2": ("gemma2", {}, {"attn_softcap", "final_softcap", "sliding_window", "post_norms", "norm_offset",
                              "norm_cast_after_scale", "gelu_tanh", "embed_scale"}),
    # an attention scale of its own, five sliding layers and a global one with its own RoPE table
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=32), {"layer_rope", "attention_scale", "qk_norm_head",
                                                          "sliding_window", "post_norms"}),
    "phi3": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 1.0}), {"fused_projections"}),
    "phi4_mini": ("phi3", dict(rope_parameters=PHI4_ROPE), {"fused_projections", "partial_rotary"}),
    "olmo2": ("olmo2", {}, {"qk_norm_projection", "no_pre_norms", "post_norms", "norm_cast_after_scale"}),
    "smollm3": ("smollm3", {}, {"no_rope_layers"}),
    "granite": ("granite", {}, {"embed_scale", "attention_scale", "residual_scale", "logits_scale"}),
}

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(name: str):
    family, overrides, _ = CASES[name]
    return tiny_config(family, **IDS, **overrides)


def _multimodal_config():
    """A Gemma 3 multimodal checkpoint's config (Gemma3ForConditionalGeneration): the tiny Gemma 3
    text model under a one-layer SigLIP vision tower."""
    from transformers import AutoConfig

    text = _config("gemma3").to_dict()
    return AutoConfig.for_model("gemma3", text_config=text, mm_tokens_per_image=1, **IDS, vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_hidden_layers=1, image_size=28, patch_size=14))


def _peft(config, rate: float = 0.0, targets: list[str] | None = None, dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # Eager attention: the exact reference (an SDPA reference leaves Gemma 2's soft-cap out in some
    # transformers versions, 5.17 among them).
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(dtype)
    if targets is None:
        targets = lora_targets(getattr(config, "text_config", config).model_type)
        if config.model_type == "gemma3":  # the text tower's projections, not the vision tower's
            targets = rf"model\.language_model\..*\.({'|'.join(targets)})"
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=rate, target_modules=targets))
    with torch.no_grad():  # B starts at zero in LoRA, which would make every A gradient zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


def _batch(packing: bool, seed: int = 0):
    """Three examples of 21, 14 and 9 tokens (ids below 300): one a row with an attention mask, or
    packed two and one into rows whose position ids restart."""
    rng = random.Random(seed)
    rows = []
    for n in (21, 14, 9):
        ids = [rng.randrange(3, 300) for _ in range(n)]
        rows.append(SimpleNamespace(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3:]))
    if packing:
        return collate([rows[:2], rows[2:]], pad_id=0, packing=True)
    return collate([[r] for r in rows], pad_id=0, packing=False)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _plain(model, batch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                 labels=batch.labels, use_cache=False).loss


def _assert_same(loss, plain, got, expected, adapters: int) -> None:
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)
    assert got.keys() == expected.keys() and len(got) == 2 * adapters
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        rel = (got[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def _check_family(model, monkeypatch, padded_reference: bool = False) -> None:
    """The fast path against transformers, padded and packed, checkpointed and with host-held inputs.
    ``padded_reference``: the packed batch's reference is transformers on the same examples padded
    (a family whose transformers model builds its masks without the position ids, gpt-oss, does
    not keep packed examples apart)."""
    from studio.engine.fast.offload import HostInputs

    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    adapters = sum(1 for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    for packing in (False, True):
        batch = _batch(packing)
        model.zero_grad(set_to_none=True)
        plain = _plain(model, _batch(False) if padded_reference else batch)
        plain.backward()
        expected = _grads(model)
        for host in (False, True):
            monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, rate, cuda, on=host: on)
            fast_model._host = HostInputs(torch.device("cpu")) if host else None
            model.zero_grad(set_to_none=True)
            loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
            loss.backward()
            _assert_same(loss, plain, _grads(model), expected, adapters)
            if host:  # every layer but the last kept its q, k and v, and took them back
                kept = {key[0] for key in fast_model._host._host if isinstance(key, tuple)}
                assert kept == set(range(len(fast_model.layers) - 1))


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_path_gives_transformers_loss_and_lora_gradients(name: str, monkeypatch) -> None:
    """Each family's tiny model, its description's features really present (a config that lost
    one would test nothing)."""
    config = _config(name)
    model = _peft(config)
    spec = describe(model)
    assert CASES[name][2] <= spec.features, spec.features
    _check_family(model, monkeypatch)


@pytest.mark.parametrize("targets", [["o_proj", "up_proj"], ["k_proj", "down_proj"]])
def test_biases_are_added_with_or_without_an_adapter_on_their_projections(targets, monkeypatch) -> None:
    """Qwen2's q/k/v biases, added by the products of a q/k/v group with no adapter at all, and of
    one whose adapter sits on k alone; a Llama's biases on every projection (attention_bias and
    mlp_bias), o's and down's added with the residual stream, gate/up's before SwiGLU."""
    _check_family(_peft(_config("qwen2"), targets=targets), monkeypatch)
    _check_family(_peft(_config("llama_biases"), targets=targets), monkeypatch)


def test_the_text_tower_of_a_gemma_3_multimodal_checkpoint(monkeypatch) -> None:
    """Gemma3ForConditionalGeneration: the decoder at model.language_model, the head at the top."""
    config = _multimodal_config()
    model = _peft(config)
    assert "nested_decoder" in describe(model).features
    _check_family(model, monkeypatch)
    # PEFT's all-linear adapts the vision tower too, which text never runs through: the path
    # decision counts the text decoder's adapters (as the estimator does), so the run is fast
    from studio.core.plan import choose_path
    from studio.engine.fast.build import path_facts

    everything = _peft(config, targets="all-linear")
    assert any("vision_tower" in name for name, _ in everything.named_parameters() if "lora_A" in name)
    monkeypatch.setenv(fast.FAST_PATH_ENV, "1")
    assert choose_path(path_facts(everything, torch.device("cpu"))).path == "fast"
    # the trainer's MFU on a GPU reads the text decoder's sizes (the outer config has none)
    assert fast.model_flops_per_token(config, 64) == fast.model_flops_per_token(config.get_text_config(), 64)


def test_every_feature_of_the_description_is_exercised_by_a_family_here() -> None:
    """A feature added to core/decoder without a family here (or in test_fast_moe.py, the mixtures
    of experts and what their sparse MLP does not run) to test it fails this."""
    from test_fast_moe import CASES as MOE_CASES
    from test_fast_moe import _config as moe_config

    from studio.core.decoder import describe_decoder

    covered = set().union(*(features for _, _, features in CASES.values())) | {"nested_decoder"}
    moe = set().union(*(describe_decoder(moe_config(name).to_dict()).features for name in MOE_CASES)) | SLOW_FEATURES
    assert covered | moe == DECODER_FEATURES, DECODER_FEATURES - covered - moe


class _SameMask(nn.Module):
    """PEFT's dropout module replaced by the fast path's mask for the same site (the reference)."""

    def __init__(self, p: float, seed: torch.Tensor, site: int):
        super().__init__()
        self.p, self.seed, self.site = p, seed, site

    def forward(self, x):
        shape = x.shape
        return dropout(x.reshape(-1, shape[-1]), self.p, self.seed, self.site).view(shape)


@pytest.mark.parametrize("host", [False, True])
def test_adapter_dropout_on_gemma_3_equals_peft_with_the_same_masks(host: bool, monkeypatch) -> None:
    """Adapter dropout (the fast path's own counter-based masks) on Gemma 3, whose recomputation
    runs its q/k norms and RoPE again from the kept product outputs: loss and gradients equal PEFT's
    modules given the same masks."""
    from studio.engine.fast.offload import HostInputs

    order = {"q_proj": (0, 0), "k_proj": (0, 1), "v_proj": (0, 2), "o_proj": (1, 0), "gate_proj": (2, 0),
             "up_proj": (2, 1), "down_proj": (3, 0)}
    rate = 0.2
    model = _peft(_config("gemma3"), rate=rate)
    fast_model, why = fast.prepare(model, options=FastPathConfig(cuda_graphs=False))
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, r, cuda: host)
    fast_model._host = HostInputs(torch.device("cpu")) if host else None
    batch = _batch(packing=True)
    torch.manual_seed(7)
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    seed = fast_model._seed.tensor  # the seed that step used, still in place
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            layer = int(name.split(".layers.")[1].split(".")[0])
            proj, j = order[name.rsplit(".", 1)[1]]
            module.lora_dropout["default"] = _SameMask(rate, seed, (layer * 4 + proj) * 8 + j)
    plain = _plain(model, batch)
    plain.backward()
    _assert_same(loss, plain, got, _grads(model), 7 * 6)


@pytest.mark.parametrize(("model_type", "kind", "settings"), [
    ("phimoe", "mixture-of-experts", dict(num_local_experts=2, num_experts_per_tok=1)),
    ("qwen2_moe", "mixture-of-experts", dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)),
    ("mamba", "state-space", dict(state_size=4, expand=2, conv_kernel=2)),
    ("t5", "encoder-decoder", dict(d_model=32, d_ff=64, num_heads=2, d_kv=16, num_layers=1))])
def test_mixture_of_experts_state_space_and_encoder_decoder_models_are_refused_in_one_line(
        model_type: str, kind: str, settings: dict) -> None:
    from transformers import AutoConfig, AutoModel

    sizes = {} if model_type == "t5" else dict(hidden_size=32) if model_type == "mamba" else dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    layers = {} if model_type == "t5" else dict(num_hidden_layers=1)
    config = AutoConfig.for_model(model_type, vocab_size=100, **layers, **sizes, **settings)
    model = AutoModel.from_config(config)
    fast_model, why = fast.prepare(model)
    assert fast_model is None
    assert why.startswith(f"{model_type}: ") and kind in why and "\n" not in why, why


@pytest.mark.parametrize("name", ["qwen2", "llama_biases", "olmo2", "phi3", "granite", "gemma2"])
def test_studio_s_own_kernels_train_these_families_as_without_them(name: str, kernel_device) -> None:
    """Studio's Triton kernels (engine/fast/update.py: the LoRA update added inside the gated
    activation and the residual's add; norm.py: Llama's norm with the stream's gradient) where a
    family uses them: biases in the products (Qwen2's q/k/v; o's and down's with the residual's
    kernel), post-norms and no pre-norms (OLMo 2, no residual fused), fused gate_up and qkv modules
    (Phi-3), a residual multiplier (Granite), GeGLU with sandwich norms and soft-caps (Gemma 2: its
    update and down's handed-over term in the GELU kernel; no residual fused, Gemma's norms in
    torch; its attention through the fused soft-cap kernels). In bf16 with the kernels on and off
    against fp32: the kernels' loss and gradients as close to fp32's as the products' own order
    (Triton's interpreter on the CPU, compiled on CUDA)."""
    pytest.importorskip("triton")
    batch = _batch(packing=True).to(kernel_device)
    runs = {}
    for dtype, on in ((torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        model = _peft(_config(name), dtype=dtype).to(kernel_device)
        fast_model, why = fast.prepare(model, FastPathConfig(kernels=on, cuda_graphs=False))
        assert fast_model is not None, why
        layer = fast_model.layers[0]
        assert layer.gate_up.in_kernel is on and layer.norm_with_stream is (on and name not in ("olmo2", "gemma2"))
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        runs[dtype, on] = (loss.item(), _grads(model))
    ref_loss, ref = runs[torch.float32, False]
    errors = {}
    for on in (True, False):
        loss, grads = runs[torch.bfloat16, on]
        assert abs(loss - ref_loss) < 0.005 * abs(ref_loss)
        errors[on] = [((grads[n].float() - g).norm() / g.norm()).item() for n, g in ref.items()]
    mean_on, mean_off = (sum(e) / len(e) for e in (errors[True], errors[False]))
    assert mean_on < 1.5 * mean_off + 0.005, (mean_on, mean_off)
    assert max(errors[True]) < 0.08, max(errors[True])
