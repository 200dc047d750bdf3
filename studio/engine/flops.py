"""Model FLOPs utilisation: the card's measured bf16 rate and the useful FLOPs a QLoRA step spends."""

from __future__ import annotations

import torch


def matmul_tflops(device: torch.device, size: int = 4096, repeats: int = 10) -> float:
    """This GPU's bf16 matrix-product rate (TFLOP/s), measured: the ceiling MFU is quoted against."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    end.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def model_flops_per_token(config, seq_len: float, full: bool = False) -> float:
    """Useful FLOPs a QLoRA training step spends per token (recomputation not counted).

    Forward 2N plus the input-gradient backward 2N over the N frozen matrix parameters (no
    weight-gradient products: the base is frozen), plus causal attention (forward and backward:
    3 x 2 x 2 x layers x seq x hidden / 2). LoRA's own products are under 1% and left out.
    A full fine-tune (``full``) also computes every weight's gradient: 2N more.
    """
    if hasattr(config, "get_text_config"):  # a multimodal checkpoint's (Gemma 3): its text decoder's
        config = config.get_text_config()
    h = config.hidden_size
    inter = getattr(config, "intermediate_size", 4 * h)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    n = layers * per_layer + config.vocab_size * h
    attention = 3 * 2 * 2 * layers * seq_len * heads * head_dim / 2
    return (6 if full else 4) * n + attention
