"""The adapters' gradients of one batch on the fast path, with its defaults and with each of
bench/speed.py's levers (``trainer.fast_path`` settings switched), against the plain PEFT forward of
the same model (bf16 autocast), on the Llama-2-7B shape (random weights, NF4, LoRA r16 on all 7
projections, B randomised so that A's gradients are not zero).

A variant that computes the same function can still round differently in bf16; a systematic error
(a gradient scaled, a term missed) shows as a relative error and a norm ratio well above the
others'. Per variant: the median and worst relative error over the adapters' gradients, the
gradient norm's ratio to the plain forward's, and the loss. (Its ``old_engine`` variant, the orders
before the eighth session, went with those orders in issue 38: bench/NOTES.md.)

    python bench/grad_agreement.py --out $OUT/grads.json --levers no_kernels,no_graphs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--levers", default="no_kernels,no_graphs,no_offload")
    parser.add_argument("--tokens", default="512x4", help="SEQxMB")
    parser.add_argument("--models-dir", default="/tmp/models")
    parser.add_argument("--code", default="")
    args = parser.parse_args()

    import torch
    import transformers

    from bench.speed import LEVERS, fast_facts, random_7b
    from studio.core.config import FastPathConfig
    from studio.engine import fast

    t0 = time.perf_counter()
    model = random_7b(args.models_dir)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    seq, mb = (int(x) for x in args.tokens.split("x"))
    ids = torch.randint(3, 32000, (mb, seq), generator=g).cuda()
    pos = torch.arange(seq, device="cuda").expand(mb, seq).contiguous()

    def grads() -> dict:
        return {n: p.grad.detach().float().clone() for n, p in params.items()}

    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        plain = model(input_ids=ids, labels=ids, position_ids=pos).loss
    plain.backward()
    reference = grads()
    ref_norm = torch.sqrt(sum((v ** 2).sum() for v in reference.values())).item()
    result = {"what": "adapter gradients of one batch: fast path (defaults, then each lever) against the plain "
                      "PEFT forward, bf16", "code": args.code, "command": " ".join(sys.argv),
              "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "tokens": args.tokens, "plain_loss": plain.item(), "plain_grad_norm": ref_norm, "variants": {}}
    variants = {"all": {}, **{k: LEVERS[k] for k in args.levers.split(",") if k}}
    for name, options in variants.items():
        fm, why = fast.prepare(model, FastPathConfig(**options))
        if fm is None:
            result["variants"][name] = {"error": why}
            continue
        for _ in range(3):  # the graphed layouts capture on a later call: the last one is a replay
            model.zero_grad(set_to_none=True)
            loss = fm.loss(ids, ids, None, pos)
            loss.backward()
        got = grads()
        rel = sorted(((got[n] - r).norm() / r.norm()).item() for n, r in reference.items())
        worst = max(reference, key=lambda n: ((got[n] - reference[n]).norm() / reference[n].norm()).item())
        norm = torch.sqrt(sum((v ** 2).sum() for v in got.values())).item()
        result["variants"][name] = {"loss": loss.item(), "median_rel_error": rel[len(rel) // 2],
                                    "worst_rel_error": rel[-1], "worst": worst, "grad_norm_ratio": norm / ref_norm,
                                    "fast_path": fast_facts(fm)}
        print(name, json.dumps(result["variants"][name]), flush=True)
        fm.release_graphs()
        del fm
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
