"""Small real shapes of the model families the fast path covers beside Llama and Qwen3: the
config.json values of public checkpoints, for bench/vram_measure.py's ``--grid families``.

Each shape is built on the GPU with random weights (the values do not change the memory); the
estimator reads the config.json the build saves. The keys kept are the ones that size or route a
layer (windows, soft-caps, partial RoPE, layers without RoPE, multipliers, biases, tied heads);
token ids are the tiny tokenizer's. Where each value was read is said beside it. Three shapes come
from the config.json files bundled in sample_data/model_configs (read whole, less the keys that
are not the architecture).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NOT_ARCHITECTURE = ("architectures", "auto_map", "transformers_version", "torch_dtype", "dtype",
                    "quantization_config", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id")
"""Keys of a published config.json that are not the architecture (the build sets its own token ids)."""


def bundled(hub_id: str) -> dict:
    """A config.json of sample_data/model_configs, less :data:`NOT_ARCHITECTURE`."""
    config = json.loads((ROOT / "sample_data" / "model_configs" / hub_id / "config.json").read_text())
    return {k: v for k, v in config.items() if k not in NOT_ARCHITECTURE}


FAMILY_MODELS: dict[str, dict] = {
    # huggingface.co/Qwen/Qwen2.5-0.5B config.json (its numbers as several public repositories quote
    # them: 896 / 4864, 24 layers, 14 heads over 2, tied head, RoPE base 1e6); the q/k/v biases are
    # Qwen2's modelling code, no config key
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True),
    # huggingface.co/google/gemma-3-1b-pt config.json (gemma3_text, quoted whole in a public repository's
    # docs): a global layer every 6th, 512-token windows elsewhere
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0),
    # huggingface.co/allenai/OLMo-2-0425-1B config.json (quoted verbatim in a public repository's tests):
    # post-norms, whole-projection q/k norms
    "olmo-2-1b": dict(model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                      max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000.0,
                      tie_word_embeddings=False),
    # huggingface.co/ibm-granite/granite-3.1-2b-base config.json (the shape as a public repository's tests
    # quote it: 2048 / 8192, 40 layers, 32 heads over 8, vocabulary 49155, RoPE base 5e6); the four
    # multipliers as Granite 3.x's 2B config.json sets them (embedding 12, residual 0.22, attention
    # 1/64 = 1/head_dim, logits divided by 8); tied head. The multipliers change no tensor's size.
    "granite-3.1-2b": dict(model_type="granite", hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                           max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=5000000.0,
                           embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                           logits_scaling=8.0, tie_word_embeddings=True),
    # huggingface.co/google/gemma-2-2b config.json (the shape as public repositories quote it: 2304 / 9216,
    # 26 layers, 8 heads over 4, head_dim 256, attention soft-cap 50, final soft-cap 30); the 4096-token
    # window, 8192 positions and vocabulary 256000 as in Gemma 2's bundled 9B config.json
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       sliding_window=4096, rope_theta=10000.0),
    # sample_data/model_configs/HuggingFaceTB/SmolLM3-3B-Base: every 4th layer without RoPE, tied head
    "smollm3-3b": bundled("HuggingFaceTB/SmolLM3-3B-Base"),
    # sample_data/model_configs/microsoft/Phi-4-mini-instruct: fused qkv_proj and gate_up_proj,
    # partial rotary 0.75, longrope scaling, tied head, vocabulary 200064
    "phi-4-mini": bundled("microsoft/Phi-4-mini-instruct"),
    # sample_data/model_configs/mistralai/Mistral-7B-Instruct-v0.3: Llama's layer, vocabulary 32768,
    # no window
    "mistral-7b": bundled("mistralai/Mistral-7B-Instruct-v0.3"),
}
"""The family grid's shapes, smallest first: bench/vram_measure.py builds them in this order."""

TINY_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, vocab_size=1024, max_position_embeddings=512)
"""--cpu: each family's shape at these sizes (head_dim 128 keeps Phi-4-mini's RoPE factors' length;
the tiny tokenizer's 1024 ids)."""


def tiny(shape: dict) -> dict:
    """``shape`` at :data:`TINY_SIZES` (its family's features kept)."""
    return {**shape, **TINY_SIZES}


FAMILY_TINY: dict[str, dict] = {shape["model_type"]: tiny(shape) for shape in FAMILY_MODELS.values()}
"""--cpu: a tiny shape of each family, keyed by model_type (as bench/vram_measure.py's TINY is)."""
