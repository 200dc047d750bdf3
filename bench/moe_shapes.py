"""The real shapes of the mixture-of-experts models issue 42 measures, as config.json values, and a
subset of their layers where the whole model is too big for the GPU box's 64 GB disk.

Every value that sizes or routes a layer is the published config.json's; where it was read is said
beside each shape. Token ids are the project's tiny tokenizer's (its 1024 ids are below every
vocabulary here). Random weights in these shapes cost the same to train as the real ones; a subset
of the layers keeps each layer's real shape (experts, widths, heads, routing) and the real
embeddings and head, so a step's time and memory per layer are the real model's, and its totals
are those of a smaller model of the same family.
"""

from __future__ import annotations

MOE_MODELS: dict[str, dict] = {
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json (as public repositories' tests quote it whole):
    # 48 layers, every MLP sparse (decoder_sparse_step 1, no mlp_only_layers), 128 experts of width
    # 768, top 8 renormalised, 32 query heads over 4 KV heads of 128, untied head. Its intermediate_size
    # (6144) sizes no tensor: no layer is dense.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=False, router_aux_loss_coef=0.001,
                          output_router_logits=False, use_sliding_window=False, sliding_window=None),
    # huggingface.co/openai/gpt-oss-20b config.json (as public repositories quote it): 24 layers
    # alternating 128-token windows and full attention (the config class's own layer_types), 32 biased
    # experts of width 2880, top 4, 64 query heads over 8 KV heads of 64 with biases and sinks, YaRN
    # (factor 32 over 4096 positions, base 150000: GptOssConfig's defaults, which are the released
    # models'). GptOssConfig's other defaults are gpt-oss-120b's (36 layers, 128 experts): set here.
    # The release stores its experts in MXFP4; this build saves them in bf16 (as gpt-oss-20b-BF16 does).
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        sliding_window=128, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False,
                        router_aux_loss_coef=0.9, output_router_logits=False),
    # huggingface.co/openai/gpt-oss-120b config.json (sample_data/model_configs/openai/gpt-oss-120b):
    # gpt-oss-20b's layer with 128 experts, over 36 layers (6.4 GB of bf16 a layer in this build)
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
                         num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         sliding_window=128, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False,
                         router_aux_loss_coef=0.9, output_router_logits=False),
    # huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json: Mistral's layer (no window) with 8 experts
    # of width 14336, top 2, vocabulary 32000
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         sliding_window=None, tie_word_embeddings=False, router_aux_loss_coef=0.02,
                         output_router_logits=False, router_jitter_noise=0.0),
    # huggingface.co/allenai/OLMoE-1B-7B-0924 config.json (as public repositories quote it): 16 layers,
    # 64 experts of width 1024, top 8 not renormalised, 16 heads (no GQA), whole-projection q/k norms
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        norm_topk_prob=False, vocab_size=50304, max_position_embeddings=4096, rms_norm_eps=1e-5,
                        rope_theta=10000.0, clip_qkv=None, tie_word_embeddings=False, router_aux_loss_coef=0.01,
                        output_router_logits=False),
}
"""Each MoE model's config.json values (``model_type`` included), by the label the benches use."""

HUB_IDS = {"qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "gpt-oss-20b": "openai/gpt-oss-20b", "gpt-oss-120b": "openai/gpt-oss-120b",
           "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "olmoe-1b-7b": "allenai/OLMoE-1B-7B-0924"}
"""The checkpoint each shape is read from."""

TINY_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1024,
                  max_position_embeddings=512, num_hidden_layers=2)
"""--tiny (the CPU): each shape at these sizes, its family's routing kept (experts, top k, renormalisation)."""

TINY_EXPERTS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128),
                "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
                                max_position_embeddings=131072),  # YaRN's 32x over 4096, as the shape has it
                "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
                "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)}
"""--tiny: four experts of width 32, two a token, in each family's own keys."""


def layer_subset(shape: dict, layers: int | None) -> dict:
    """``shape`` with only its first ``layers`` layers (None: all of them). Every per-layer value is
    kept; where a family lists a value per layer (gpt-oss' layer_types) the first ``layers`` entries
    are its own. Raises ValueError for a count outside 1..the model's layers."""
    real = int(shape["num_hidden_layers"])
    if layers is None:
        return dict(shape)
    if not 1 <= layers <= real:
        raise ValueError(f"--layers {layers}: the model has {real} layers; choose 1 to {real}")
    out = dict(shape, num_hidden_layers=layers)
    if isinstance(shape.get("layer_types"), list):
        out["layer_types"] = shape["layer_types"][:layers]
    if isinstance(shape.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in shape["mlp_only_layers"] if i < layers]
    return out


def tiny(shape: dict) -> dict:
    """``shape`` at :data:`TINY_SIZES` with four small experts (its family's keys and routing kept)."""
    return {**shape, **TINY_SIZES, **TINY_EXPERTS[shape["model_type"]]}
