"""The baseline: the usual HF + PEFT + bitsandbytes QLoRA training loop, nothing of Studio's.

NF4 with double quantization, bf16 compute, ``prepare_model_for_kbit_training`` (which keeps the
norms, embeddings and head in fp32 and turns on gradient checkpointing), LoRA r16 / alpha 32 on all
seven projections, torch AdamW, bf16 autocast, gradient clipping at 1.0, one micro-batch per
optimizer step. It reads the batches (token ids, labels, attention masks) from a file that
bench/speed.py writes, so that Studio trains on exactly the same tokens, and writes JSON.

    python bench/baseline_qlora.py --model /tmp/llama2-7b-random --batches b.pt --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

WARMUP = 5
"""Optimizer steps of linear learning-rate warmup."""

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(model_path: str, checkpointing: bool, lora_dropout: float, seed: int):
    """The 4-bit model with LoRA attached, as the HF + PEFT recipe builds it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0}, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    torch.manual_seed(seed)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def train(model, batches: list[dict], steps: int, lr: float, warmup_steps: int, seed: int) -> dict:
    """``steps`` optimizer steps over ``batches`` (cycled); per-step loss, time and tokens."""
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    # Linear warmup over the first steps (as Studio's trainer does), then constant.
    # Studio's schedule (engine/optim.py: schedule): (step + 1) / (warmup + 1) while warming up, then constant.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / (WARMUP + 1) if s < WARMUP else 1.0)
    model.train()
    losses, times, tokens = [], [], []
    torch.cuda.synchronize()
    for step in range(steps):
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        ids = batch["input_ids"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        mask = batch["attention_mask"]
        mask = mask.cuda(non_blocking=True) if mask is not None else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # a sync point: the step's time below is the GPU's too
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(int(batch["tokens"]))
    timed = slice(warmup_steps, None)
    return {"losses": losses, "step_s": times, "tokens": tokens,
            "tokens_per_s": sum(tokens[timed]) / sum(times[timed]),
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved()}


def reset_lora(model, state: dict) -> None:
    """Put the adapters back to their initial values (each workload starts from the same point)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", required=True, help="comma-separated .pt files, one workload each")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lora-dropout", type=float, default=0.05)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = load(args.model, not args.no_checkpointing, args.lora_dropout, args.seed)
    load_s = time.perf_counter() - t0
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    results = {"impl": "baseline", "load_s": load_s,
               "after_load_allocated": torch.cuda.memory_allocated(),
               "trainable_params": sum(p.numel() for p in init.values()), "workloads": {}}
    for path in args.batches.split(","):
        batches = torch.load(path)
        reset_lora(model, init)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        out = train(model, batches, args.steps, args.lr, args.warmup_steps, args.seed)
        name = Path(path).stem
        results["workloads"][name] = out
        finite = all(math.isfinite(x) for x in out["losses"])
        print(f"baseline {name}: {out['tokens_per_s']:.0f} tokens/s, peak {out['peak_allocated'] / 2**30:.2f}"
              f" / {out['peak_reserved'] / 2**30:.2f} GiB, loss {out['losses'][0]:.3f} -> "
              f"{out['losses'][-1]:.3f}{'' if finite else ' (NOT FINITE)'}", flush=True)
    args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
