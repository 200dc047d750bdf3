"""ModelInfo on each family Studio models, against the published parameter counts, and the refusal
(naming what is missing) for what it cannot model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.model_configs import CONFIGS

from studio.core.config import parse_config
from studio.core.decoder.families import reads_gelu_as_tanh
from studio.core.memory import estimate, walkthrough
from studio.core.memory.gpus import GB
from studio.core.memory.params import lora_params
from studio.core.model.info import ModelInfoError, from_config_dict

# Published sizes: the model cards' "Number of Parameters" or the Hub's safetensors total.
PUBLISHED = {
    "llama-2-7b": 6.74e9, "mistral-7b-v0.1": 7.24e9, "qwen2.5-7b": 7.61e9, "qwen3-8b": 8.19e9,
    "gemma-7b": 8.54e9, "gemma-2-9b": 9.24e9, "gemma-3-1b": 1.0e9, "gemma-3-4b": 4.30e9, "phi-3-mini": 3.82e9,
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_matches_the_published_size(name):
    info = from_config_dict(CONFIGS[name], name)
    assert info.total_params() == pytest.approx(PUBLISHED[name], rel=0.01)


def test_gemma_ties_its_embeddings_and_reads_head_dim_from_the_config():
    gemma = from_config_dict(CONFIGS["gemma-7b"], "gemma")
    assert gemma.tied and gemma.head_params() == 0
    assert gemma.head_width == 256 and gemma.linear_shapes()["q_proj"] == (3072, 16 * 256)  # not 3072 / 16
    assert gemma.vocab == 256000
    # its config's "gelu" is the tanh approximation from transformers 5.18 on (the fast path's GeGLU);
    # 5.17 runs exact GELU, which the fast path does not
    assert (gemma.fast_path_blocker == "") == reads_gelu_as_tanh()


def test_gemma3_nested_text_config_takes_the_config_class_defaults_and_counts_the_vision_tower():
    info = from_config_dict(CONFIGS["gemma-3-4b"], "gemma-3-4b")
    assert (info.hidden, info.layers, info.heads, info.kv_heads, info.head_width, info.vocab) == (
        2560, 34, 8, 4, 256, 262208)
    assert info.tied and info.qk_norm and info.norms_per_layer == 4
    assert 0.41e9 < info.vision_params < 0.43e9  # SigLIP-So400m's encoder and the projector


def test_phi3_linear_shapes_are_the_fused_modules_and_lora_targets_map_onto_them():
    info = from_config_dict(CONFIGS["phi-3-mini"], "phi3")
    assert info.linear_shapes() == {"qkv_proj": (3072, 3 * 3072), "o_proj": (3072, 3072),
                                     "gate_up_proj": (3072, 2 * 8192), "down_proj": (8192, 3072)}
    assert info.lora_modules(("q_proj", "v_proj")) == ("qkv_proj",)
    assert info.lora_modules(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")) == (
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # r16 on all four: r x (in + out) per module, 32 layers
    assert lora_params(info, 16, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")) == 32 * 16 * (
        (3072 + 9216) + (3072 + 3072) + (3072 + 16384) + (8192 + 3072))
    with pytest.raises(ValueError, match="qkv_proj"):  # Llama names do not exist in Phi-3
        lora_params(info, 16, ("q_proj",))


def test_qwen2_counts_its_qkv_biases_and_qwen3_its_qk_norms():
    qwen2 = from_config_dict(CONFIGS["qwen2.5-7b"], "qwen2")
    llama_like = from_config_dict({**CONFIGS["qwen2.5-7b"], "model_type": "llama"}, "as-llama")
    assert qwen2.norm_params() - llama_like.norm_params() == 28 * (3584 + 2 * 512)
    qwen3 = from_config_dict(CONFIGS["qwen3-8b"], "qwen3")
    assert qwen3.norm_params() == 36 * (2 * 4096 + 2 * 128) + 4096


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_family_gets_an_estimate_and_the_whole_walkthrough(name):
    info = from_config_dict(CONFIGS[name], name)
    config = parse_config("lora: {target_modules: [" + ", ".join(info.linear_shapes()) + "]}\n")
    result = estimate(config, info, 80 * GB)
    assert result.total > info.total_params() * 0.5  # at least the 4-bit weights
    steps = walkthrough(config, info, 80 * GB)
    assert len(steps) == 7
    totals = [step.estimate.total for step in steps]
    assert totals == sorted(totals, reverse=True)  # every step of the story saves memory
    assert totals[0] > 16 * info.total_params()  # full fp32: 4 + 4 + 8 bytes a parameter, plus activations
    assert totals[0] > 2 * totals[-1]


@pytest.mark.parametrize(("config", "named"), [
    ({"model_type": "phimoe", "hidden_size": 4096, "num_local_experts": 16}, "num_local_experts: 16"),
    ({"model_type": "qwen2_moe", "num_experts": 60}, "mixture-of-experts"),
    ({"model_type": "mamba", "hidden_size": 768, "state_size": 16}, "state-space"),
    ({"model_type": "t5", "d_model": 512, "is_encoder_decoder": True}, "encoder-decoder"),
    ({"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
      "num_attention_heads": 8, "vocab_size": 50304}, "model_type 'gpt_neox'"),
    ({"model_type": "llama", "hidden_size": 64, "vocab_size": 100},
     "no intermediate_size, num_hidden_layers, num_attention_heads"),
    ({"n_embd": 768, "n_layer": 12, "n_head": 12}, "no hidden_size, intermediate_size, num_hidden_layers"),
])
def test_what_cannot_be_modelled_is_refused_naming_what_is_missing(config, named):
    with pytest.raises(ModelInfoError, match=named.replace("(", r"\(")) as caught:
        from_config_dict(config, "some/model")
    assert str(caught.value).startswith("some/model: ")


def test_qwen3_30b_a3b_is_sized_with_its_experts_in_4_bits_and_fits_24_gb() -> None:
    """Qwen3-30B-A3B's config.json keys (num_experts as the Hub spells it): 30.5B parameters, of
    which the experts' 3-D tensors are 29B; a 4-bit run packs them like the linear modules
    (engine/quantized_experts.py: half a byte a value plus the double-quantized scales), drawn as
    their own category, and seq 2048 at micro-batch 1 fits a 24 GB card (the issue's target); an
    8-bit run leaves them in bf16, which does not."""
    from studio.core.memory import estimate
    from studio.core.memory.gpus import GB
    from studio.core.memory.params import experts_stored_bytes, weight_bytes
    from studio.core.memory.plan import plan_for
    from studio.core.model.info import from_config_dict

    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    info = from_config_dict(config, "Qwen/Qwen3-30B-A3B")
    assert info.fast_path_blocker == ""
    assert 30.4e9 < info.total_params() < 30.6e9
    assert info.expert_params() == 48 * 128 * 3 * 2048 * 768
    assert info.lora_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj")
    run = parse_config("model: {base_model: Qwen/Qwen3-30B-A3B}\ndata: {max_seq_length: 2048}\n"
                       "trainer: {micro_batch_size: 1, effective_batch_size: 1}\n")  # NF4, bf16
    plan = plan_for(run, info=info)
    packed = experts_stored_bytes(info, plan)
    assert 0.5 * info.expert_params() < packed < (0.5 + 1 / 64 + 0.001) * info.expert_params()
    assert weight_bytes(info, plan) > packed > 0.8 * weight_bytes(info, plan)  # embeddings and head: fp32
    result = estimate(run, info, 24 * GB)
    assert result.step_categories["experts"] == int(packed) and result.fits, result.total / GB
    assert experts_stored_bytes(info, plan_for(parse_config("quantization: {bits: 8}\n"), info=info)) == (
        2 * info.expert_params())


def test_a_mixture_of_experts_packed_on_load_has_a_load_phase_that_can_set_the_peak() -> None:
    """Experts packed in 4 bits as they load hold one layer's gate/up in 16 bits for a moment (three
    copies reserved): on Qwen3-30B-A3B's first 8 layers at seq 2048 that is the run's peak, as the
    H200 measured; the whole model, load included, still fits a 24 GB card. A bf16 run, a dense model and
    experts kept in the MXFP4 they ship have no such phase."""
    from studio.core.memory import estimate
    from studio.core.memory.result import MODEL_LOAD
    from studio.core.model.info import from_config_dict

    qwen3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
             "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    run = parse_config("model: {base_model: Qwen/Qwen3-30B-A3B}\ndata: {max_seq_length: 2048}\n"
                       "lora: {target_modules: [q_proj, k_proj, v_proj, o_proj]}\n"
                       "trainer: {micro_batch_size: 1, effective_batch_size: 1}\n")
    gate_up = 128 * 2 * 768 * 2048 * 2
    subset = estimate(run, from_config_dict({**qwen3, "num_hidden_layers": 8}, "qwen3-l8"))
    load = subset.phases[MODEL_LOAD]
    kept = subset.step_categories["weights"] + subset.step_categories["experts"]
    assert kept + 2 * gate_up < load.reserved < kept + 3 * gate_up + 64 * 2**20
    assert subset.peak_phase == MODEL_LOAD and subset.peak_reserved == load.reserved
    # drawn as that moment: the experts (some in 16 bits on their way in), no adapter or optimizer yet
    c = subset.categories
    assert c["lora"] == c["optimizer"] == c["activations"] == 0 and c["weights"] + c["experts"] == load.allocated
    from studio.core.memory.gpus import GB

    whole = estimate(run, from_config_dict(qwen3, "Qwen/Qwen3-30B-A3B"), 24 * GB)
    assert MODEL_LOAD in whole.phases and whole.fits  # the load included
    bf16 = parse_config("model: {base_model: Qwen/Qwen3-30B-A3B}\nquantization: {bits: null}\n")
    assert MODEL_LOAD not in estimate(bf16, from_config_dict({**qwen3, "num_hidden_layers": 8}, "q")).phases
    dense = {k: v for k, v in qwen3.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    assert MODEL_LOAD not in estimate(run, from_config_dict({**dense, "model_type": "qwen3"}, "d")).phases


def test_gpt_oss_20b_is_sized_with_its_shipped_mxfp4_experts_and_fits_16_gb(tmp_path, monkeypatch) -> None:
    """gpt-oss-20b's bundled config.json: the parameters transformers builds (20.91B: the experts
    3-D tensors 19.11B, their biases, the routers' biases, the sinks); a 4-bit run keeps the experts
    in the MXFP4 the checkpoint ships (4.25 bits a weight, the biases in bf16: 10.2 GB), drawn as
    their own category, and seq 2048 at micro-batch 1 fits a 16 GB card (the issue's target). The
    same model from a bf16 checkpoint packs them in NF4 instead; a bf16 run keeps them in bf16."""
    from studio.core.memory import estimate
    from studio.core.memory.gpus import GB
    from studio.core.memory.params import MXFP4_BYTES, experts_stored_bytes
    from studio.core.memory.plan import plan_for
    from studio.core.model.info import load_model_info

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    info = load_model_info("openai/gpt-oss-20b")  # offline: Studio's bundled config.json
    assert info.fast_path_blocker == "" and info.expert_format == "mxfp4"
    assert info.total_params() == 20_914_757_184
    assert info.expert_weight_params() == 24 * 32 * 3 * 2880 * 2880
    assert info.expert_params() - info.expert_weight_params() == 24 * 32 * (2 * 2880 + 2880)
    assert info.router_params() == 24 * 32 * (2880 + 1)
    run = parse_config("model: {base_model: openai/gpt-oss-20b}\ndata: {max_seq_length: 2048}\n"
                       "trainer: {micro_batch_size: 1, effective_batch_size: 1}\n")  # 4-bit, bf16
    plan = plan_for(run, info=info)
    shipped = experts_stored_bytes(info, plan)
    biases = 2 * (info.expert_params() - info.expert_weight_params())
    assert shipped == info.expert_weight_params() * MXFP4_BYTES + biases
    assert 10.1e9 < shipped < 10.2e9
    result = estimate(run, info, 16 * GB)
    assert result.categories["experts"] == int(shipped) and result.fits, result.total / GB
    assert "model load" not in result.phases  # kept as shipped: never in 16 bits on the card
    nf4 = experts_stored_bytes(replace(info, expert_format=""), plan)
    assert 0.5 * info.expert_weight_params() < nf4 - biases < shipped
    bf16 = plan_for(parse_config("quantization: {bits: null}\n"), info=info)
    assert experts_stored_bytes(info, bf16) == 2 * info.expert_params()


def test_gpt_oss_sinks_cost_eager_blocks_of_scores_only_without_the_fused_attention() -> None:
    """gpt-oss-20b at seq 2048 (its query heads 8 to a key/value head): with the fast path's kernels
    on (the default, bf16) its sinks run in the fused attention, whose memory is flash attention's
    but for the attention output its recomputation takes back from the host (one layer's on the
    device: ``kept_attention_per_token``); with ``kernels: false`` the eager attention's blocks of
    fp32 scores (EAGER_TENSORS tensors of EAGER_SCORES values: 320 MiB) join the training step's
    activations in its place, and nothing else changes."""
    from studio.core.memory.attention import EAGER_SCORES, EAGER_TENSORS, fused_attention, kept_attention_per_token
    from studio.core.memory.fast import fast_step
    from studio.core.memory.plan import plan_for
    from studio.core.model.info import load_model_info

    info = load_model_info("openai/gpt-oss-20b")
    text = "model: {base_model: openai/gpt-oss-20b}\ndata: {max_seq_length: 2048}\ntrainer: {micro_batch_size: 1"
    fused, eager = (replace(plan_for(parse_config(text + extra + "}\n"), info=info), path="fast")
                    for extra in ("", ", fast_path: {kernels: false}"))
    assert fused_attention(info, fused) and not fused_attention(info, eager)
    with_fused, with_eager = fast_step(info, fused), fast_step(info, eager)
    grown = {k: with_eager.categories[k] - v for k, v in with_fused.categories.items()}
    kept = 2048 * kept_attention_per_token(info, fused)
    assert abs(grown.pop("activations") - (EAGER_TENSORS * 4 * EAGER_SCORES - kept)) <= 1
    assert all(v == 0 for k, v in grown.items() if k != "overhead"), grown


@pytest.mark.parametrize("name", ["google/gemma-2-9b", "openai/gpt-oss-20b"])
def test_the_fused_attention_s_kept_output_is_counted_once_on_the_device(name: str) -> None:
    """Gemma-2-9B (soft-capped scores) and gpt-oss-20b (sinks) at seq 2048 on the fast path: each
    layer's recomputation takes its fused attention's output and log-sum-exp back from host memory
    (engine/fast/offload.py), so one layer's of them, the next one's prefetched, sits on the device
    beside the recomputed layer: ``heads x (head_width x 2 + 4)`` bytes a token (16.1 MiB for
    Gemma-2-9B), whatever the depth, and nothing with ``kernels: false`` (the eager attention keeps
    nothing) or for a model whose attention flash attention runs."""
    from studio.core.memory.attention import kept_attention_per_token
    from studio.core.memory.fast import fast_step
    from studio.core.memory.plan import plan_for
    from studio.core.model.info import load_model_info

    info = load_model_info(name)
    text = f"model: {{base_model: {name}}}\ndata: {{max_seq_length: 2048}}\ntrainer: {{micro_batch_size: 1"
    fused, eager = (replace(plan_for(parse_config(text + extra + "}\n"), info=info), path="fast")
                    for extra in ("", ", fast_path: {kernels: false}"))
    kept = 2048 * info.heads * (info.head_width * 2 + 4)
    assert 2048 * kept_attention_per_token(info, fused) == kept and kept_attention_per_token(info, eager) == 0
    # what flash attention would run: nothing kept
    assert kept_attention_per_token(replace(info, softcapped=False, sinks=False), fused) == 0
    for deep in (info, replace(info, layers=2 * info.layers)):
        grown = fast_step(deep, fused).categories["activations"] - fast_step(
            replace(deep, softcapped=False, sinks=False), fused).categories["activations"]
        assert abs(grown - kept) <= 1, (deep.layers, grown, kept)
    if name == "google/gemma-2-9b":
        assert kept == 16.125 * 2**20


def test_the_estimate_takes_a_mixture_of_experts_path_as_the_engine_does() -> None:
    """The estimate's path decision reads the model's sparse MLP as the engine's loader does
    (core/plan.py's PathFacts.from_config with ``moe``): a mixture of experts is captured in CUDA
    graphs like a dense model, except with a load-balancing loss (eager steps, the layer inputs on
    the card) or a compute dtype the grouped product does not take (fp16: a loop over experts)."""
    from studio.core.memory.estimate import path_choice
    from studio.core.model.info import from_config_dict

    config = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    moe = from_config_dict(config, "tiny-moe")
    dense = from_config_dict({**config, "model_type": "qwen3"}, "tiny-dense")
    run = parse_config("trainer: {micro_batch_size: 1, effective_batch_size: 1}\n")
    balanced = parse_config("trainer: {micro_batch_size: 1, effective_batch_size: 1, router_aux_loss_coef: 0.001}\n")
    assert (path_choice(run, dense).cuda_graphs, path_choice(run, dense).host_offload) == (True, True)
    assert (path_choice(run, moe).path, path_choice(run, moe).cuda_graphs, path_choice(run, moe).host_offload) == (
        "fast", True, True)
    assert "CUDA graphs" in path_choice(run, moe).reason and not path_choice(run, moe).eager
    choice = path_choice(balanced, moe)
    assert (choice.cuda_graphs, choice.host_offload) == (False, False)
    assert "load-balancing loss" in choice.eager and "eager steps (" in choice.reason, choice
    fp16 = path_choice(parse_config("quantization: {compute_dtype: float16}\n"), moe)
    assert not fp16.cuda_graphs and "grouped product" in fp16.eager, fp16
    assert path_choice(parse_config("quantization: {compute_dtype: float16}\n"), dense).cuda_graphs


def test_a_mixture_of_experts_and_graphs_turned_off_are_estimated_as_eager_steps() -> None:
    """Where the engine replays no CUDA graph (a mixture of experts with its load-balancing loss, or
    trainer.fast_path.cuda_graphs false), the estimate's fast step is the eager one: its note says so
    (and why, for the experts) and no graph pool is counted; without the loss the experts' step is
    graphed."""
    from studio.core.memory import estimate
    from studio.core.model.info import from_config_dict

    moe = from_config_dict({"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 64, "vocab_size": 1024, "num_experts": 8, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": []}, "tiny-moe")
    llama = from_config_dict(CONFIGS["llama-2-7b"], "llama-2-7b")
    run = parse_config("trainer: {micro_batch_size: 1, effective_batch_size: 1}\ndata: {max_seq_length: 512}\n")
    eager = parse_config("trainer: {micro_batch_size: 1, effective_batch_size: 1, fast_path: {cuda_graphs: false}}\n"
                         "data: {max_seq_length: 512}\n")
    balanced = parse_config("trainer: {micro_batch_size: 1, effective_batch_size: 1, router_aux_loss_coef: 0.01}\n"
                            "data: {max_seq_length: 512}\n")
    for config, info in ((run, llama), (run, moe)):
        assert any("CUDA graphs" in note for note in estimate(config, info).notes)
    for config, info in ((balanced, moe), (eager, llama)):
        notes = estimate(config, info).notes
        assert any("eager steps" in note for note in notes) and not any("CUDA graphs" in note for note in notes)
    assert any(note.endswith("eager steps with the layer inputs in host memory") for note in estimate(eager, llama).notes)
    assert any("eager steps: a mixture of experts with the load-balancing loss" in note
               for note in estimate(balanced, moe).notes)
    assert estimate(balanced, moe).peak_reserved < estimate(run, moe).peak_reserved  # no graph pool
    assert estimate(eager, llama).peak_reserved < estimate(run, llama).peak_reserved  # no graph pool
