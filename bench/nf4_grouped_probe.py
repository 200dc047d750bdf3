"""Does the grouped product that reads NF4 experts itself beat dequantize-then-grouped_mm? (issue 42)

Studio's fast path dequantizes every expert of a projection into a bf16 workspace, then runs torch's
grouped product over it (engine/fast/moe.py), except where each expert gets few rows: there
engine/fast/stored_experts.py's kernels decode the stored NF4 experts inside the product
(``stored_experts.worth_it``). This probe times both products a layer runs of one projection (the
forward's ``x W^T`` and the backward's ``dy W``) at issue 42's shapes, both ways:

- ``studio``: dequant.py's NF4 kernel into a workspace, then ``torch._grouped_mm`` (the dequantize
  way);
- ``fused``: stored_experts.py's products, in its tiles (its constants: ``REDUCE_A``, ``REDUCE_B``,
  ``BLOCK_M``); ``--block-m`` adds a run at another ``BLOCK_M``.

The experts are laid out as the model stores them (gpt-oss ``[experts, in, out]``, the others
``[experts, out, in]``), packed as Studio packs them (engine/quantized_experts.py: NF4, blocks of 64,
double-quantized scales); ``--format mxfp4``: as gpt-oss ships them (MXFP4 ``[experts, out, in]``,
random codes and scales), against mxfp4_dequant.py's kernel then grouped_mm. Rows fall on the experts as ``--routing`` says: ``uniform`` (each the
same) or ``skewed`` (one token's share of each expert drawn log-normal, as a trained router's
imbalance looks). The fused output is checked against the dequantize way's.

The 28th session's sweeps chose the tiles (bench/NOTES.md section 14): the select-tree decoding, a
table load a value, a decode-free stand-in, and the byte-permute decoding the engine keeps
(`h200_nf4_grouped_probe_01a6a73.json`, `_a8a5a72`, `_5cf4a4f` in bench/results/).

    python3 bench/nf4_grouped_probe.py --out /tmp/nf4_grouped.json          # the GPU box
    TRITON_INTERPRET=1 python3 bench/nf4_grouped_probe.py --tiny --out /tmp/x.json   # here: correctness only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # (experts, rows per expert at 2,048 tokens, in, out, stored [experts, in, out])
    "gpt-oss-120b gate/up": (128, 64, 2880, 5760, True),
    "gpt-oss-120b down": (128, 64, 2880, 2880, True),
    "gpt-oss-20b gate/up": (32, 256, 2880, 5760, True),
    "qwen3-30b-a3b gate/up": (128, 128, 2048, 1536, False),
    "qwen3-30b-a3b gate/up at 1024 tokens": (128, 64, 2048, 1536, False),
    "qwen3-30b-a3b down": (128, 128, 768, 2048, False),
    "mixtral-8x7b gate/up": (8, 512, 4096, 28672, False),
}
TINY = {"tiny": (3, 20, 128, 256, False), "tiny transposed": (3, 20, 128, 256, True)}


def counts(experts: int, rows: int, routing: str, gen) -> list[int]:
    import torch

    if routing == "uniform":
        return [rows] * experts
    share = torch.exp(torch.randn(experts, generator=gen) * 0.5)
    raw = share / share.sum() * rows * experts
    out = raw.floor().long()
    out[: rows * experts - int(out.sum())] += 1
    return out.tolist()


def case(name, shape, iters, routing="uniform", block_ms=(), fmt="nf4"):
    import torch

    from studio.engine.fast import stored_experts
    from studio.engine.fast.frozen import dequantize_packed
    from studio.engine.mxfp4 import dequantize_mxfp4
    from studio.engine.quantized_experts import _quantize

    experts, rows, k, n, transposed = shape
    mx = fmt == "mxfp4"
    transposed = transposed and not mx  # MXFP4 is stored [experts, out, in] whatever the model's layout
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    on_dev = torch.Generator(device=dev).manual_seed(0)
    stored = (experts, k, n) if transposed else (experts, n, k)
    if mx:  # every code, scales around 2^-4 (tests/helpers/gpt_oss.py's random_mxfp4)
        packed = torch.randint(0, 256, (experts, n, k // 32, 16), dtype=torch.uint8, device=dev, generator=on_dev)
        scales = torch.randint(118, 128, (experts, n, k // 32), dtype=torch.uint8, device=dev, generator=on_dev)
        dense = dequantize_mxfp4(packed, scales, torch.bfloat16)
    else:
        w = (torch.randn(*stored, generator=on_dev, device=dev) * 0.02).to(torch.bfloat16)
        packed, state = _quantize(w, "nf4", True)
        del w
        dense = torch.empty(stored, dtype=torch.bfloat16, device=dev)
        dequantize_packed(packed, state, dense, None)
    sizes = counts(experts, rows, routing, gen)
    total = sum(sizes)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(dev, torch.int32)
    x = torch.randn(total, k, generator=on_dev, device=dev).to(torch.bfloat16)
    dy = torch.randn(total, n, generator=on_dev, device=dev).to(torch.bfloat16)
    # the math's W [experts, out, in]: forward x W^T, backward dy W
    w_math = dense.transpose(1, 2) if transposed else dense
    if dev == "cuda":
        want = {"forward": torch._grouped_mm(x, w_math.transpose(1, 2), offs=offs),
                "backward": torch._grouped_mm(dy, w_math, offs=offs)}
    else:
        bounds = list(zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True))
        want = {"forward": torch.cat([x[s:e].float() @ w_math[i].float().T for i, (s, e) in enumerate(bounds)]),
                "backward": torch.cat([dy[s:e].float() @ w_math[i].float() for i, (s, e) in enumerate(bounds)])}
    if mx:
        prod = stored_experts.StoredProducts.mxfp4(packed, scales, torch.device(dev))
    else:
        assert stored_experts.supports(state, stored)
        prod = stored_experts.StoredProducts.nf4(packed, state, stored, torch.device(dev))
    window = prod.window()
    # forward: stored [in, out] reduces over A (in); stored [out, in] over B (in); the backward the other
    kernel_of = {"forward": "reduce_a" if transposed else "reduce_b", "backward": "reduce_b" if transposed else "reduce_a"}
    operand = {"forward": x, "backward": dy}
    out = {"format": fmt, "shape": {"experts": experts, "rows": total, "rows_per_expert": rows, "in": k, "out": n,
                                     "stored": "[experts, in, out]" if transposed else "[experts, out, in]"},
           "routing": routing, "most_rows_an_expert": max(sizes),
           "engine_reads_stored": stored_experts.worth_it(total, experts),
           "gflop_each": 2 * total * k * n / 1e9, "packed_gb": packed.numel() / 1e9,
           "bf16_weights_gb": dense.numel() * 2 / 1e9, "passes": {}}
    if mx:
        out["scales_gb"] = scales.numel() / 1e9
    for pass_name in ("forward", "backward"):
        run = getattr(prod, kernel_of[pass_name])
        entry = {"kernel": kernel_of[pass_name], "fused": {}}
        for block_m in (stored_experts.BLOCK_M, *block_ms):
            default, stored_experts.BLOCK_M = stored_experts.BLOCK_M, block_m
            row = {}
            try:
                got = run(operand[pass_name], offs, window)
                ref = want[pass_name].float()
                row["max_rel_err"] = round(((got.float() - ref).abs().max() / ref.abs().max()).item(), 5)
                if dev == "cuda":
                    from bench.gpu_timing import best_ms
                    row["ms"] = round(best_ms(lambda run=run: run(operand[pass_name], offs, window), iters), 4)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile here: say so
                row["error"] = f"{type(exc).__name__}: {exc}"[-400:]
            finally:
                stored_experts.BLOCK_M = default
            entry["fused"][f"BLOCK_M {block_m}"] = row
        if dev == "cuda":
            from bench.gpu_timing import best_ms
            from studio.engine.fast import dequant

            space = torch.empty(stored, dtype=torch.bfloat16, device=dev)
            math = space.transpose(1, 2) if transposed else space
            if mx:
                def unpack():
                    dequantize_mxfp4(packed, scales, torch.bfloat16, space)
            else:
                nf4 = dequant.NF4Weight(state, torch.device(dev))

                def unpack():
                    nf4(packed, space)

            def studio():
                unpack()
                if pass_name == "forward":
                    return torch._grouped_mm(x, math.transpose(1, 2), offs=offs)
                return torch._grouped_mm(dy, math, offs=offs)

            entry["studio_ms"] = round(best_ms(studio, iters), 4)
            entry["dequant_ms"] = round(best_ms(unpack, iters), 4)
            entry["grouped_mm_ms"] = round(entry["studio_ms"] - entry["dequant_ms"], 4)
            fused_ms = entry["fused"][f"BLOCK_M {stored_experts.BLOCK_M}"].get("ms")
            if fused_ms:
                entry["studio_over_fused"] = round(entry["studio_ms"] / fused_ms, 3)
        out["passes"][pass_name] = entry
    print(name, fmt, routing, json.dumps({p: {k: v for k, v in e.items()} for p, e in out["passes"].items()}), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, correctness only (Triton's interpreter)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--only", help="comma-separated shape names")
    parser.add_argument("--format", default="nf4", help="comma-separated: nf4, mxfp4 (gpt-oss' as shipped)")
    parser.add_argument("--block-m", default="", help="comma-separated BLOCK_M values to time beside the engine's")
    parser.add_argument("--budget-s", type=float, default=500)
    parser.add_argument("--commit")
    args = parser.parse_args()
    import torch

    from bench.families import _commit, _versions

    start = time.monotonic()
    shapes = TINY if args.tiny else SHAPES
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only.split(",")}
    block_ms = [int(b) for b in args.block_m.split(",") if b]
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "commit": _commit(args.commit),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "versions": _versions(),
              "cases": {}}
    for fmt in args.format.split(","):
        for routing in args.routing.split(","):
            for name, shape in shapes.items():
                key = f"{name} ({routing})" if fmt == "nf4" else f"{name} ({fmt}, {routing})"
                if time.monotonic() - start > args.budget_s:
                    result.setdefault("skipped", []).append(f"{key}: past --budget-s")
                    continue
                result["cases"][key] = case(name, shape, args.iters, routing, block_ms, fmt)
                Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
