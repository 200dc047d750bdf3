"""A tiny gpt-oss for the tests: its config (the tiny families' sizes, the traits the fast path must
run switched on) and a checkpoint folder that ships its experts in MXFP4 as OpenAI's do."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.tiny_families import _SIZE

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, head_dim=32, sliding_window=8,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})
"""A sliding layer (a window shorter than the tests' rows) then a full one, heads wider than
hidden / heads, YaRN whose factor agrees with the positions; sinks, router and expert biases are
drawn at random by transformers' initialisation."""

CHECKPOINT_KEYS = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
"""gpt-oss' quantization_config.modules_to_not_convert: what its checkpoints leave in bf16."""


def gpt_oss_config(**overrides):
    """transformers' GptOssConfig of the tiny gpt-oss (300-id vocabulary unless overridden)."""
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt_oss", **{"vocab_size": 300, **IDS, **_SIZE, **GPT_OSS, **overrides})


def random_mxfp4(shape: tuple[int, ...], seed: int):
    """MXFP4 blocks and scales of a ``[..., rows, in]`` weight: every 4-bit code, scales around 2^-4."""
    import torch

    *lead, rows, width = shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, rows, width // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 128, (*lead, rows, width // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def mxfp4_folder(folder: Path, **overrides) -> Path:
    """A tiny random gpt-oss checkpoint as OpenAI ships theirs: bf16 but for the experts' weights,
    stored as MXFP4 blocks and scales, ``quant_method: mxfp4`` in its config; the tiny tokenizer.
    ``overrides``: config fields (more layers, other widths)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = gpt_oss_config(vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tensors = {}
    for index, (name, value) in enumerate(model.state_dict().items()):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # [experts, in, out] in the model; [experts, out, in / 32, 16] in the checkpoint
            blocks, scales = random_mxfp4((value.shape[0], value.shape[2], value.shape[1]), seed=index)
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = value.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shipped = {**config.to_dict(), "dtype": "bfloat16",
               "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": list(CHECKPOINT_KEYS)}}
    (folder / "config.json").write_text(json.dumps(shipped))
    tokenizer.save_pretrained(folder)
    return folder
