"""Tiny random models of every family Studio covers (the GGUF exporter writes all but OLMo 2, SmolLM3
and Granite), each with a tokenizer of the kind that family ships and a chat template of that family's
shape, saved as a model folder. The mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) are shaped as
llama.cpp can run them too (tests/engine/test_fast_moe.py has the shapes it cannot: a Qwen3-MoE with a
dense layer, an OLMoE with grouped-query attention).

Byte-level BPE families (Llama 3, Mistral, Qwen) use the project's tiny tokenizer (studio.engine.tiny).
SentencePiece-style families (Gemma, Phi-3) get a tiny BPE with byte fallback, trained here with
``tokenizers`` on the same corpus, shaped as their ``tokenizer.json`` files are: ``<0xNN>`` byte
tokens, ``▁`` for spaces, and a prefix space for Phi-3 (Llama 2 style) but none for Gemma.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""Qwen's turn shape (ChatML), without Qwen's default system prompt."""

QWEN_DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}"
                       "{% endif %}" + CHATML)
"""ChatML with the default system turn Qwen 2.5 adds when the conversation has none."""

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
         "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}"
         "{% endif %}{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
"""Gemma 3's shape: the system text folded into the first user turn."""

PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

OLMO2 = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")

GRANITE = ("{% for m in messages %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] + "
           "'<|end_of_text|>\n' }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}")

MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")

# Qwen2's tokenizer class adds "<|endoftext|>" to a vocabulary that lacks it; it is there from the start.
_SIZE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.1)

FAMILIES: dict[str, dict[str, Any]] = {
    # model_type, config overrides, tokenizer kind, chat template, end-of-turn marker, LoRA targets
    "llama": dict(model_type="llama", config=dict(num_hidden_layers=2, tie_word_embeddings=True),
                  tokenizer="bpe", chat=LLAMA3, end="<|eot_id|>"),
    "mistral": dict(model_type="mistral", config=dict(num_hidden_layers=2, tie_word_embeddings=False),
                    tokenizer="bpe", chat=MISTRAL, end=None),
    "qwen2": dict(model_type="qwen2", config=dict(num_hidden_layers=2, tie_word_embeddings=True),
                  tokenizer="bpe", chat=QWEN_DEFAULT_SYSTEM, end="<|im_end|>"),
    # head_dim apart from hidden / heads, as Qwen3 has it
    "qwen3": dict(model_type="qwen3", config=dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False),
                  tokenizer="bpe", chat=CHATML, end="<|im_end|>"),
    # soft-capping small enough to bite on a random model's logits; a window shorter than the test's rows
    "gemma2": dict(model_type="gemma2", config=dict(num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16,
                                                     sliding_window=8, attn_logit_softcapping=5.0,
                                                     final_logit_softcapping=3.0),
                   tokenizer="spm-gemma", chat=GEMMA, end="<end_of_turn>"),
    # six layers: five sliding, one global with its own RoPE base and linear scaling, as Gemma 3 4B+
    "gemma3": dict(model_type="gemma3_text", config=dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        tokenizer="spm-gemma", chat=GEMMA, end="<end_of_turn>"),
    # fused qkv and gate_up, and a partial rotary width as Phi-4-mini has
    "phi3": dict(model_type="phi3", config=dict(num_hidden_layers=2, tie_word_embeddings=False,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5}),
                 tokenizer="spm-prefix", chat=PHI3, end="<|end|>"),
    # q and k normed over the whole projection, norms after attention and MLP (not before)
    "olmo2": dict(model_type="olmo2", config=dict(num_hidden_layers=2, tie_word_embeddings=False),
                  tokenizer="bpe", chat=OLMO2, end="<|endoftext|>"),
    # every second layer without RoPE, tied embeddings
    "smollm3": dict(model_type="smollm3", config=dict(num_hidden_layers=2, no_rope_layer_interval=2,
                                                      tie_word_embeddings=True),
                    tokenizer="bpe", chat=CHATML, end="<|im_end|>"),
    # Granite 3's four multipliers, far enough from 1 to show if any were lost
    "granite": dict(model_type="granite", config=dict(num_hidden_layers=2, embedding_multiplier=12.0,
                                                      attention_multiplier=0.0625, residual_multiplier=0.22,
                                                      logits_scaling=8.0, tie_word_embeddings=True),
                    tokenizer="bpe", chat=GRANITE, end="<|end_of_text|>"),
    # four experts, two a token, in every layer; the experts narrower than intermediate_size (the
    # width of dense layers this config has none of), head_dim apart from hidden / heads
    "qwen3_moe": dict(model_type="qwen3_moe", config=dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                                                          tie_word_embeddings=False),
                      tokenizer="bpe", chat=CHATML, end="<|im_end|>"),
    "mixtral": dict(model_type="mixtral", config=dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                                      tie_word_embeddings=False),
                    tokenizer="bpe", chat=MISTRAL, end=None),
    # the top-k probabilities not renormalised; as many key/value heads as heads, as llama.cpp's OLMoE
    # needs; tied embeddings, which its GGUF writes twice (llama.cpp's OLMoE needs an output head)
    "olmoe": dict(model_type="olmoe", config=dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                                  num_key_value_heads=4, tie_word_embeddings=True),
                  tokenizer="bpe", chat=OLMO2, end=None),
}

MOE_TYPES = ("qwen3_moe", "mixtral", "olmoe")
"""The mixtures of experts among them."""
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""PEFT's ``target_parameters`` for a mixture of experts' expert weights (what ``lora.target_experts`` sets)."""

SPM_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHAT_TOKENS = {"bpe": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                       "[INST]", "[/INST]", "<|user|>", "<|assistant|>", "<|system|>", "<|start_of_role|>",
                       "<|end_of_role|>", "<|end_of_text|>"],
               "spm-gemma": ["<start_of_turn>", "<end_of_turn>"],
               "spm-prefix": ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]}


def lora_targets(model_type: str) -> list[str]:
    """Every projection module of the family's decoder layer (Phi-3's are fused; a mixture of experts'
    are its attention's, its experts being parameters: :func:`expert_targets`)."""
    if model_type == "phi3":
        return ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if model_type in MOE_TYPES:
        return ["q_proj", "k_proj", "v_proj", "o_proj"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def expert_targets(model_type: str) -> list[str] | None:
    """PEFT's ``target_parameters`` for the family's expert weights (None for a dense family)."""
    return EXPERT_PARAMETERS if model_type in MOE_TYPES else None


def tiny_config(name: str, vocab_size: int = 300, **overrides: Any):  # -> PretrainedConfig
    """Family ``name``'s tiny config (the sizes and overrides above, then ``overrides``) without a
    tokenizer: a vocabulary of ``vocab_size`` ids, for tests that need token ids only."""
    from transformers import AutoConfig

    spec = FAMILIES[name]
    settings = {**_SIZE, **spec["config"], **overrides}
    return AutoConfig.for_model(spec["model_type"], vocab_size=vocab_size, **settings)


def spm_tokenizer(prefix_space: bool):  # -> PreTrainedTokenizerFast
    """A tiny SentencePiece-style tokenizer: BPE with byte fallback over ``▁``-joined words."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from studio.engine.tiny import _corpus

    spell = [normalizers.Replace(" ", "\u2581")]
    if prefix_space:
        spell.insert(0, normalizers.Prepend("\u2581"))
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence(spell)
    # Words are learned apart (as SentencePiece does); the saved tokenizer, like Gemma's and Llama 2's,
    # has no pre-tokenizer, and its merges never cross a "▁".
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer_tok.train_from_iterator(_corpus(), trainer=trainers.BpeTrainer(vocab_size=700, show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab = {token: i for i, token in enumerate(SPM_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(spell)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)


def build(name: str, folder: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Save family ``name``'s tiny random model, tokenizer and chat template into ``folder``, its
    weights stored in ``dtype`` (bfloat16 as the Hub's checkpoints are)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    spec = FAMILIES[name]
    if spec["tokenizer"] == "bpe":
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    else:
        tokenizer = spm_tokenizer(prefix_space=spec["tokenizer"] == "spm-prefix")
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS[spec["tokenizer"]]})
    tokenizer.chat_template = spec["chat"]
    config = AutoConfig.for_model(spec["model_type"], **{**_SIZE, **spec["config"]}, vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_gemma3_multimodal(folder: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a tiny Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration, as Gemma 3 4B+ ship):
    the tiny Gemma 3 text model under a one-layer SigLIP vision tower, with Gemma's tokenizer and an
    image processor (``preprocessor_config.json``) beside it."""
    import json

    import torch
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3ImageProcessor

    text = build("gemma3", folder.with_name(folder.name + "-text"), seed)
    config = AutoConfig.for_model(
        "gemma3", text_config=json.loads((text / "config.json").read_text()), mm_tokens_per_image=1,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_hidden_layers=1, image_size=28, patch_size=14))
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(config).to(getattr(torch, dtype)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(text).save_pretrained(folder)
    Gemma3ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(folder)
    return folder
