"""Would a grouped product that reads NF4 experts itself beat Studio's way? (issue 42, NEXT_GPU item 1)

Studio's fast path dequantizes every expert of a projection into a bf16 workspace, then runs torch's
grouped product over it (engine/fast/moe.py). Where experts are many and each gets few rows
(gpt-oss-120b: 128 experts, 64 rows each at 2,048 tokens), writing and reading the bf16 weights
costs more than the products. This probe times, on one projection's forward at issue 42's shapes:

- ``studio``: Studio's NF4 dequantization kernel into a workspace (dequant.NF4Weight), then
  ``torch._grouped_mm`` (what a forward pass of ExpertProduct does);
- ``fused``: one Triton kernel here that loads each tile's packed bytes and block scales, decodes
  them in registers and multiplies (``tl.dot``), never writing bf16 weights.

The weights are laid out as gpt-oss stores its experts, ``[experts, in, out]`` with NF4 blocks of
64 along ``out`` (bitsandbytes' packing of the flattened tensor, high nibble first, fp32 block
scales: no double quantization in this probe). Each expert gets the same number of rows (uniform
routing). The fused kernel's output is checked against the dequantized weights' product.

    python3 bench/nf4_grouped_probe.py --out /tmp/nf4_grouped.json          # the GPU box
    TRITON_INTERPRET=1 python3 bench/nf4_grouped_probe.py --tiny --out /tmp/x.json   # here: correctness only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # (experts, rows per expert at 2,048 tokens, in, out): gate/up of each model
    "gpt-oss-120b gate/up": (128, 64, 2880, 5760),
    "gpt-oss-20b gate/up": (32, 256, 2880, 5760),
    "qwen3-30b-a3b gate/up": (128, 128, 2048, 1536),
    "mixtral-8x7b gate/up": (8, 512, 4096, 28672),
}
TINY = {"tiny": (3, 20, 128, 256)}
TILES = [(64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (32, 128, 128, 4, 4)]
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried on the GPU; the first on the CPU."""


def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_grouped(x_ptr, packed_ptr, absmax_ptr, code_ptr, y_ptr, rows, K, N, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
        # y[rows of e] = x[rows of e] @ W_e, W_e [K, N] in NF4, blocks of 64 along N
        pid_m, pid_n, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_in = m < rows
        at_rows = (e * rows + m).to(tl.int64)
        half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        blocks = pid_n * (BLOCK_N // 64) + tl.arange(0, BLOCK_N // 64)
        base = e.to(tl.int64) * K * N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros: a jitted helper the interpreter may not call)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_in = k < K
            a = tl.load(x_ptr + at_rows[:, None] * K + k[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
            flat = base + k.to(tl.int64)[:, None] * N
            byte = tl.load(packed_ptr + flat // 2 + half[None, :], mask=k_in[:, None], other=0).to(tl.int32)
            high = tl.load(code_ptr + (byte >> 4))
            low = tl.load(code_ptr + (byte & 15))
            values = tl.reshape(tl.join(high, low), (BLOCK_K, BLOCK_N // 64, 64))
            scale = tl.load(absmax_ptr + flat // 64 + blocks[None, :], mask=k_in[:, None], other=0.0)
            w = tl.reshape(values * scale[:, :, None], (BLOCK_K, BLOCK_N))
            if FP32_DOT:  # Triton's interpreter: its bf16 dot reads the raw bits
                acc += tl.dot(a.to(tl.float32), w.to(tl.bfloat16).to(tl.float32))
            else:
                acc += tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + at_rows[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_in[:, None] & (n < N)[None, :])

    return nf4_grouped


def fused(fn, x, packed, absmax, code, experts, rows, k, n, tile):
    import torch

    bm, bn, bk, warps, stages = tile
    y = torch.empty(experts * rows, n, dtype=x.dtype, device=x.device)
    grid = (-(-rows // bm), -(-n // bn), experts)
    options = {} if x.device.type == "cpu" else {"num_warps": warps, "num_stages": stages}
    fn[grid](x, packed, absmax, code, y, rows, k, n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
             FP32_DOT=x.device.type == "cpu", **options)
    return y


def case(name, shape, tiles, iters):
    import bitsandbytes.functional as bnbf
    import torch

    experts, rows, k, n = shape
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(experts, k, n, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(experts * rows, k, device=dev, generator=gen).to(torch.bfloat16)
    packed, state = bnbf.quantize_4bit(w.reshape(-1), blocksize=64, quant_type="nf4", compress_statistics=False)
    packed = packed.view(-1)
    code = state.code.to(dev, torch.float32)
    dense = bnbf.dequantize_4bit(packed.view(-1, 1), state).view(experts, k, n)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * rows
    if dev == "cuda":
        want = torch._grouped_mm(x, dense, offs=offs)
    else:
        want = torch.cat([x[e * rows:(e + 1) * rows].float() @ dense[e].float() for e in range(experts)]).to(x.dtype)
    fn = kernel()
    out = {"shape": {"experts": experts, "rows_per_expert": rows, "in": k, "out": n},
           "gflop": 2 * experts * rows * k * n / 1e9, "packed_gb": packed.numel() / 1e9,
           "bf16_weights_gb": w.numel() * 2 / 1e9, "tiles": {}}
    for tile in tiles:
        try:
            got = fused(fn, x, packed, state.absmax, code, experts, rows, k, n, tile)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            entry = {"max_rel_err": round(err, 5)}
            if dev == "cuda":
                from bench.gpu_timing import best_ms
                entry["ms"] = round(best_ms(lambda: fused(fn, x, packed, state.absmax, code, experts, rows, k, n, tile),
                                            iters), 4)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile here: say so, try the next
            entry = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out["tiles"]["x".join(map(str, tile))] = entry
    if dev == "cuda":
        from bench.gpu_timing import best_ms
        from studio.engine.fast import dequant

        nf4 = dequant.NF4Weight(state, torch.device(dev))
        space = torch.empty(experts, k, n, dtype=torch.bfloat16, device=dev)

        def studio():
            nf4(packed.view(-1, 1), space)
            return torch._grouped_mm(x, space, offs=offs)

        assert torch.equal(studio(), want)
        out["studio_ms"] = round(best_ms(studio, iters), 4)
        out["studio_dequant_ms"] = round(best_ms(lambda: nf4(packed.view(-1, 1), space), iters), 4)
        out["grouped_mm_ms"] = round(best_ms(lambda: torch._grouped_mm(x, dense, offs=offs), iters), 4)
        timed = [t["ms"] for t in out["tiles"].values() if "ms" in t and t["max_rel_err"] < 0.02]
        if timed:
            out["fused_best_ms"] = min(timed)
            out["fused_vs_studio"] = round(out["studio_ms"] / min(timed), 3)
    print(name, json.dumps({k: v for k, v in out.items() if k != "tiles"}), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, correctness only (Triton's interpreter)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--commit")
    args = parser.parse_args()
    import torch

    from bench.families import _commit, _versions

    shapes = TINY if args.tiny else SHAPES
    tiles = TILES[:1] if args.tiny or not torch.cuda.is_available() else TILES
    result = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "commit": _commit(args.commit),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "versions": _versions(),
              "cases": {}}
    for name, shape in shapes.items():
        result["cases"][name] = case(name, shape, tiles, args.iters)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
