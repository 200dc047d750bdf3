"""Published config.json values of public checkpoints, one entry a family: what the estimator's
tests size (tests/core/test_model_families.py, tests/engine/test_vram_phases.py)."""

# config.json values of public checkpoints (the keys the shape needs; sliding windows, RoPE and
# token ids left out). Where each was read:
CONFIGS = {
    # huggingface.co/meta-llama/Llama-2-7b-hf config.json, bundled as
    # sample_data/model_configs/meta-llama/Llama-2-7b-hf/config.json; transformers' LlamaConfig defaults
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # huggingface.co/mistralai/Mistral-7B-v0.1 config.json; transformers' MistralConfig defaults
    # (models/mistral/configuration_mistral.py, checkpoint mistralai/Mistral-7B-v0.1)
    "mistral-7b-v0.1": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                            max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5,
                            tie_word_embeddings=False),
    # huggingface.co/Qwen/Qwen2.5-7B config.json (the same numbers are quoted in public code found with
    # find_string '"vocab_size": 152064': hidden 3584, 18944, 28 layers, 28 heads, 4 kv heads, untied)
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # huggingface.co/Qwen/Qwen3-8B config.json (head_dim explicit, q/k norms in the modelling code)
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # google/gemma_pytorch gemma/config.py GemmaConfig defaults (= get_config_for_7b); the config.json
    # leaves tie_word_embeddings to GemmaConfig's default (True)
    "gemma-7b": dict(model_type="gemma", hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                     max_position_embeddings=8192, hidden_act="gelu", rms_norm_eps=1e-6),
    # google/gemma_pytorch gemma/config.py get_config_for_9b (Gemma 2)
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6),
    # huggingface.co/google/gemma-3-1b-pt config.json (text-only Gemma 3)
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6),
    # huggingface.co/google/gemma-3-4b-pt config.json: the text model nested in text_config, which leaves
    # heads, kv heads, head_dim and vocabulary to Gemma3TextConfig's defaults; a SigLIP vision tower
    "gemma-3-4b": dict(model_type="gemma3",
                       text_config=dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                                        num_hidden_layers=34, sliding_window=1024),
                       vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, image_size=896,
                                          intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27,
                                          patch_size=14, vision_use_head=False)),
    # huggingface.co/microsoft/Phi-3-mini-4k-instruct config.json; transformers' Phi3Config defaults
    # (models/phi3/configuration_phi3.py, checkpoint microsoft/Phi-3-mini-4k-instruct)
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
}
