"""gpt-oss on the fast path in its real per-layer shapes, on the GPU: the loss and every LoRA gradient
against transformers + PEFT on the same weights (bf16), then the fast step's time and peak memory.

The model is gpt-oss-20b's (or 120b's) bundled config.json (sample_data/model_configs) cut to
``--layers`` of its layers (default 2: a sliding-window layer and a full one), random weights in
bf16; its experts are random MXFP4 blocks and scales attached as a 4-bit load of the shipped
checkpoint attaches them (studio/engine/mxfp4.py), so both sides read the same dequantized experts.
The attention stays in bf16 (a real run's is NF4: engine/model.py). LoRA r16 (alpha 32) on q/k/v/o
and, unless ``--no-experts``, on the experts (PEFT's target_parameters), B drawn at random so that
A's gradients are not zero. One row of ``--tokens`` random ids (transformers' gpt-oss keeps no
packed examples apart, so the reference is one example).

A systematic error (a missed term, a wrong layout) shows as a relative gradient error and a norm
ratio well off bf16's rounding; per side the JSON keeps the loss, the median and worst relative
error of the adapters' gradients and their norm ratio, and the fast step's seconds and peak
allocated / reserved GiB, with the command, the commit, the GPU and the versions.

    # the GPU box, from the repository root (a 16 GB card's share: --layers 2 fits an H100 easily)
    python3 bench/gpt_oss_probe.py --model openai/gpt-oss-20b --layers 2 --tokens 2048 --out $OUT/gpt_oss_probe.json
    # here, on the CPU: a tiny gpt-oss in fp32 (the same code path, no timing worth reading)
    python3 bench/gpt_oss_probe.py --tiny --out /tmp/gpt_oss_probe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NOT_ARCHITECTURE = ("architectures", "transformers_version", "quantization_config", "torch_dtype", "dtype",
                    "eos_token_id", "pad_token_id", "layer_types")
"""config.json keys the probe's build sets itself or leaves out (layer_types: cut with the layers)."""

TINY = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=300, sliding_window=8,
            max_position_embeddings=256, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 64})
"""The --tiny shape (a CPU smoke run of the same code)."""


def build(args, device, dtype):
    """The PEFT-wrapped model: the config cut to ``--layers``, random weights, MXFP4 experts."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.engine import mxfp4

    config = json.loads((ROOT / "sample_data" / "model_configs" / args.model / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in NOT_ARCHITECTURE}
    config.update(num_hidden_layers=args.layers, initializer_range=0.02)
    if args.tiny:
        config.update(TINY)
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=dtype,
                                                 attn_implementation="eager")
    g = torch.Generator(device="cpu").manual_seed(1)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        tensors = {}
        for name in ("gate_up_proj", "down_proj"):
            e, fan_in, fan_out = getattr(experts, name).shape
            # every code; scales near 2^-7, a trained model's order of magnitude for these widths
            blocks = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(119, 124, (e, fan_out, fan_in // 32), dtype=torch.uint8, generator=g)
            tensors[name] = (blocks.to(device), scales.to(device))
        mxfp4.attach(experts, tensors)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    experts = None if args.no_experts else ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    torch.manual_seed(2)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, target_parameters=experts))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def grads(model) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="openai/gpt-oss-20b", help="a bundled config (sample_data/model_configs)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="timed fast steps after one warm-up step")
    parser.add_argument("--no-experts", action="store_true", help="LoRA on the attention only")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape in fp32 on the CPU")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    import transformers

    from studio.engine import fast

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.layers, args.tokens = 2, min(args.tokens, 40)
    model = build(args, device, dtype)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(3, vocab, (1, args.tokens), generator=g).to(device)
    labels = ids.clone()

    with torch.autocast(device.type, dtype=dtype, enabled=cuda):
        reference = model(input_ids=ids, labels=labels, use_cache=False).loss
    reference.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    fast_model, why = fast.prepare(model)
    if fast_model is None:
        raise SystemExit(f"the fast path refused the model: {why}")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loss = fast_model.loss(ids, labels)
    loss.backward()
    got = grads(model)
    errors = {n: float((got[n] - g_).norm() / g_.norm()) for n, g_ in expected.items() if g_.norm() > 0}
    norm_ratio = float(torch.cat([got[n].flatten() for n in expected]).norm()
                       / torch.cat([g_.flatten() for g_ in expected.values()]).norm())

    times = []
    for _ in range(0 if args.tiny else args.steps):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fast_model.loss(ids, labels).backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    result = {
        "command": " ".join(sys.argv), "commit": commit,
        "gpu": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": args.model, "layers": args.layers, "tokens": args.tokens, "dtype": str(dtype),
        "experts_adapted": not args.no_experts,
        "loss": {"transformers": reference.item(), "fast": loss.item(),
                 "relative_difference": abs(loss.item() - reference.item()) / abs(reference.item())},
        "gradients": {"adapters": len(errors), "median_relative_error": statistics.median(errors.values()),
                      "worst_relative_error": max(errors.values()), "worst": max(errors, key=errors.get),
                      "norm_ratio": norm_ratio},
        "fast_step_s": statistics.median(times) if times else None,
        "tokens_per_s": args.tokens / statistics.median(times) if times else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("loss", "gradients", "fast_step_s", "peak_reserved_gib")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
