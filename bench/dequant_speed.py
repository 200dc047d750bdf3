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

With ``--mxfp4``, gpt-oss-20b's MXFP4 expert projections instead (issue 42: gate/up
``[32, 5760, 2880]``, down ``[32, 2880, 2880]``, random codes at real checkpoints' scales), two ways
each into the fast path's contiguous workspace and the plain forward's transposed parameter:

- ``torch``: engine/mxfp4.py's torch operations (a table lookup a byte, a multiply, a copy);
- ``triton``: engine/fast/mxfp4_dequant.py's one kernel, checked against ``torch`` bit for bit.

Bandwidth counts the bytes that must move: the packed weight and its scales read, the bf16 weight
written. Usage: ``python bench/dequant_speed.py --out bench/results/current/x.json`` (add
``--mxfp4``, and ``--sweep`` for the kernel's tile choices).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.families import _commit, _versions  # noqa: E402
from bench.gpu_timing import best_ms  # noqa: E402

SHAPES = {"q/k/v/o": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)}
MXFP4_SHAPES = {"gate/up": (32, 5760, 2880), "down": (32, 2880, 2880)}
"""gpt-oss-20b's expert projections ``[experts, out, in]``."""
GPT_OSS_20B_LAYERS = 24


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tile choices")
    parser.add_argument("--mxfp4", action="store_true", help="gpt-oss-20b's MXFP4 experts instead of NF4 weights")
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD, stale on the GPU box)")
    args = parser.parse_args()
    if args.mxfp4:
        import torch

        result = {"what": "MXFP4 dequantization: engine/mxfp4.py's torch way against its Triton kernel",
                  "command": " ".join(sys.argv), "commit": _commit(args.commit), "gpu": torch.cuda.get_device_name(),
                  "versions": _versions(),
                  **mxfp4_rows(MXFP4_SHAPES, torch.device("cuda"), partial(cuda_time, iters=args.iters), args.sweep)}
        result["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

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

    timed = partial(cuda_time, iters=args.iters)

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


def cuda_time(fn, iters: int) -> float:
    """Microseconds a call of ``fn`` takes on the GPU, over one loop of ``iters`` calls after a warm-up
    call (bench/gpu_timing.py)."""
    return best_ms(fn, loops=iters, repeats=1) * 1000


def _same_bits(a, b) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def mxfp4_rows(shapes: dict[str, tuple[int, int, int]], device, timed, sweep: bool) -> dict:
    """Each MXFP4 projection of ``shapes`` dequantized to bf16 on ``device`` by the torch way and the
    kernel (``timed(fn)``: microseconds a call), contiguous and transposed, with whether the kernel's
    values are the torch way's bit for bit, and the kernel's tile choices where ``sweep``."""
    import torch
    import triton

    from studio.engine.fast import mxfp4_dequant
    from studio.engine.mxfp4 import SCALE_BIAS, dequantize_mxfp4

    result = {"versions": {"torch": torch.__version__, "triton": triton.__version__}, "shapes": {}}
    for name, (experts, rows, width) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8, device=device, generator=g)
        # scales about gpt-oss' own (2^-9 to 2^0)
        scales = torch.randint(SCALE_BIAS - 9, SCALE_BIAS + 1, blocks.shape[:-1], dtype=torch.uint8, device=device,
                               generator=g)
        outs = {"contiguous": torch.empty(experts, rows, width, dtype=torch.bfloat16, device=device),
                "transposed": torch.empty(experts, width, rows, dtype=torch.bfloat16, device=device).transpose(1, 2)}
        reference = dequantize_mxfp4(blocks, scales, torch.bfloat16, kernel=False)
        numel = experts * rows * width
        moved = numel // 2 + numel // 32 + numel * 2  # codes, one scale byte a block, bf16 out
        row = {"numel": numel}
        for layout, out in outs.items():
            ways = {"torch": partial(dequantize_mxfp4, blocks, scales, torch.bfloat16, out, kernel=False),
                    "triton": partial(mxfp4_dequant.dequantize, blocks, scales, out)}
            for way, fn in ways.items():
                out.fill_(float("nan"))
                fn()
                exact = _same_bits(out, reference)
                us = timed(fn)
                row[f"{way}_{layout}"] = {"us": round(us, 2), "gb_per_s": round(moved / us / 1e3, 1),
                                          "equal_to_torch": exact}
                print(f"mxfp4 {name} {layout} {way}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s, equal {exact}",
                      flush=True)
            row[f"speedup_{layout}"] = round(row[f"torch_{layout}"]["us"] / row[f"triton_{layout}"]["us"], 3)
        if sweep:
            chosen = mxfp4_dequant.ROWS, mxfp4_dequant.GROUPS, mxfp4_dequant.NUM_WARPS
            row["sweep_us"] = {}
            out = outs["contiguous"]
            for tile_rows, groups in ((1, 16), (4, 8), (8, 8), (16, 4), (16, 8), (32, 4), (16, 16), (32, 8)):
                for warps in (2, 4, 8):
                    mxfp4_dequant.ROWS, mxfp4_dequant.GROUPS, mxfp4_dequant.NUM_WARPS = tile_rows, groups, warps
                    out.fill_(float("nan"))
                    mxfp4_dequant.dequantize(blocks, scales, out)
                    assert _same_bits(out, reference), (tile_rows, groups, warps)
                    row["sweep_us"][f"{tile_rows}x{groups}x{warps}"] = round(
                        timed(partial(mxfp4_dequant.dequantize, blocks, scales, out)), 2)
            mxfp4_dequant.ROWS, mxfp4_dequant.GROUPS, mxfp4_dequant.NUM_WARPS = chosen
            best = min(row["sweep_us"], key=row["sweep_us"].get)
            print(f"mxfp4 {name} sweep: best {best} {row['sweep_us'][best]} us", flush=True)
        result["shapes"][name] = row
    # six dequantizations a layer a step (issue 42): each projection for the forward, its
    # recomputation in the backward, and the backward's input gradient
    per_layer = {key: 3 * sum(result["shapes"][n][f"{key}_contiguous"]["us"] for n in shapes)
                 for key in ("torch", "triton")}
    result["per_layer_step_us"] = {k: round(v, 1) for k, v in per_layer.items()}
    result["step_ms_gpt_oss_20b"] = {k: round(v * GPT_OSS_20B_LAYERS / 1000, 2) for k, v in per_layer.items()}
    return result


if __name__ == "__main__":
    raise SystemExit(main())
