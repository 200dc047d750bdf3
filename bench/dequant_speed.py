"""NF4 dequantization: bitsandbytes' kernels against Studio's one Triton kernel, same call, same weights.

For each weight shape of a 7B Llama step (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008),
quantized as the engine loads them (NF4, double-quantized scales, block 64), times three ways of
getting the bf16 weight, and checks the kernel's output against bitsandbytes' to the bit:

- ``bnb``: the fast path's way without its kernel (frozen.dequantize_into: scales expanded per
  call by ``dequantize_blockwise``, the offset added, then ``dequantize_4bit``);
- ``bnb_cached``: bitsandbytes' 4-bit kernel alone, scales expanded once beforehand (what the
  engine's ``cache_absmax`` did until issue 38; here for the bound it gives);
- ``triton``: dequant.NF4Weight, scales expanded inside the kernel.

(The kernel reading scales expanded beforehand, ``triton_cached``, went with ``cache_absmax``.)

Bandwidth counts the bytes that must move: the packed weight and its scales read, the bf16 weight
written. Usage: ``python bench/dequant_speed.py --out bench/results/current/x.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

SHAPES = {"q/k/v/o": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tile choices")
    args = parser.parse_args()

    import bitsandbytes
    import bitsandbytes.functional as bnbf
    import torch
    import triton

    from studio.engine.fast import dequant
    from studio.engine.fast.frozen import dequantize_into, expanded_absmax

    device = torch.device("cuda")
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
                           "triton": triton.__version__}, "shapes": {}}

    def timed(fn) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / args.iters  # microseconds

    class Base:  # what dequantize_into reads: .weight.data and .weight.quant_state
        def __init__(self, packed, state):
            self.weight = packed
            self.weight.quant_state = state

    for name, (rows, cols) in SHAPES.items():
        torch.manual_seed(0)
        w = torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 0.02
        packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        base = Base(packed, state)
        cached = expanded_absmax(state)
        out = torch.empty(rows, cols, device=device, dtype=torch.bfloat16)
        reference = torch.empty_like(out)
        dequantize_into(base, reference)
        kernel = dequant.NF4Weight(state, device)

        def bnb_cached(out=out, packed=packed, state=state, cached=cached):
            torch.ops.bitsandbytes.dequantize_4bit.out(packed, cached, state.blocksize, state.quant_type, out.shape,
                                                       out.dtype, out=out)

        ways = {"bnb": partial(dequantize_into, base, out), "bnb_cached": bnb_cached,
                "triton": partial(kernel, packed, out)}
        numel = rows * cols
        moved = numel // 2 + numel * 2 + (numel // 64)  # packed, bf16 out, one 8-bit scale a block
        row = {"numel": numel}
        for way, fn in ways.items():
            out.fill_(float("nan"))
            fn()
            exact = bool(torch.equal(out, reference))
            us = timed(fn)
            row[way] = {"us": round(us, 2), "gb_per_s": round(moved / us / 1e3, 1), "equal_to_bnb": exact}
            print(f"{name} {way}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s, equal {exact}", flush=True)
        row["speedup_vs_bnb"] = round(row["bnb"]["us"] / row["triton"]["us"], 3)
        if args.sweep:
            chosen = dequant.BLOCKS_PER_PROGRAM, dequant.NUM_WARPS
            row["sweep_us"] = {}
            for blocks in (8, 16, 32, 64, 128):
                for warps in (1, 2, 4, 8):
                    dequant.BLOCKS_PER_PROGRAM, dequant.NUM_WARPS = blocks, warps
                    out.fill_(float("nan"))
                    kernel(packed, out)
                    assert torch.equal(out, reference), (blocks, warps)
                    row["sweep_us"][f"{blocks}x{warps}"] = round(timed(partial(kernel, packed, out)), 2)
            dequant.BLOCKS_PER_PROGRAM, dequant.NUM_WARPS = chosen
            best = min(row["sweep_us"], key=row["sweep_us"].get)
            print(f"{name} sweep: best {best} {row['sweep_us'][best]} us", flush=True)
        result["shapes"][name] = row
    # A 7B step's mix: per layer 4 of q/k/v/o, 2 of gate/up, 1 of down (forward; the backward repeats it).
    layer = {way: 4 * result["shapes"]["q/k/v/o"][way]["us"] + 2 * result["shapes"]["gate/up"][way]["us"]
             + result["shapes"]["down"][way]["us"] for way in ways}
    result["per_layer_pass_us"] = {k: round(v, 1) for k, v in layer.items()}
    result["step_ms_7b_20_per_layer"] = {k: round(v * 32 * 20 / 7 / 1000, 2) for k, v in layer.items()}
    if args.sweep:
        totals = {key: sum((4, 2, 1)[i] * result["shapes"][n]["sweep_us"][key] for i, n in enumerate(SHAPES))
                  for key in result["shapes"]["down"]["sweep_us"]}
        result["sweep_per_layer_pass_us"] = dict(sorted(totals.items(), key=lambda kv: kv[1])[:8])
        print("best per layer pass:", result["sweep_per_layer_pass_us"], flush=True)
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
