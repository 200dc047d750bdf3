"""Would a product kernel of Studio's own that takes SwiGLU (and gate/up's LoRA update) into its
epilogue beat cuBLAS's product plus Studio's SwiGLU kernel? Issue 13's last route, measured on its own.

At micro-batch 16 a 7B step runs gate/up's product twice (the forward, and the recomputation for the
backward) and SwiGLU after each: ~12 ms a step of SwiGLU forwards on an H200
(bench/results/archive/h200_v18_profile.json), reading the 2 x 11008-wide output back and writing the
11008-wide one. A product that applies SwiGLU to its accumulators before they leave the chip writes
only SwiGLU's output in the forward (nothing saves the product's: the layer is recomputed), and in
the recomputation writes the product's output and SwiGLU's without reading either back.

Cases, each at 8192 and 4096 tokens (``--tokens``), a 7B layer's gate/up (4096 -> 2 x 11008), rank 16:

- ``cublas``: ``torch.mm`` alone (what the engine's product costs);
- ``cublas_swiglu``: ``torch.mm`` then engine/fast/update.py's SwiGLU with the update (the engine's
  forward and recomputation today);
- ``triton_product``: this file's kernel writing the product's output only (Triton's product against
  cuBLAS's, nothing fused);
- ``fused_forward``: this file's kernel writing SwiGLU's output only (product, update and SwiGLU in one);
- ``fused_recompute``: the same also writing the product's output (what the backward reads).

The kernel walks its tiles in grouped order, persistent (one program an SM) or one program a tile,
loads and stores through TMA descriptors, and keeps gate's and up's accumulators side by side for the
same rows and columns. Each of
``--configs`` (:func:`parse_config`) is timed; the fastest counts. Every case runs under
sustained load: the card is first held busy for ``--heat-s`` seconds, and the cases then run
interleaved in ``--rounds`` rounds of ``--loops`` calls (medians reported), so each sees the same
clock (the cards lower it at their power limit: bench/NOTES.md entry 13).

    python3 bench/fused_gate_up.py --out bench/results/current/x.json
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import loop_ms  # noqa: E402
from studio.engine.fast.kernels import interpreted  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # the module's docstring stays readable without Triton
    triton = tl = None


if triton is not None:
    def gate_up_kernel(x_desc, wg_desc, wu_desc, g_desc, u_desc, act_desc, xa_ptr, bt_ptr, m, ffn, k_dim,
                       scale, stride_xa, stride_bt, rank,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RANK: tl.constexpr,
                       GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, WRITE_GU: tl.constexpr,
                       SWIGLU: tl.constexpr, LORA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr,
                       WS_TILES: tl.constexpr, WS_K: tl.constexpr):
        """``x [m, k] @ [Wg; Wu]^T``: gate's and up's base outputs (``WRITE_GU``, each ``[m, ffn]``)
        and ``silu(gate + upd_g) * (up + upd_u)`` (``SWIGLU``), ``upd = scale * xa @ bt`` with ``xa``
        ``[m, 2 rank]`` (gate's rank, then up's) and ``bt`` ``[2 rank, 2 ffn]`` block-diagonal."""
        pid = tl.program_id(0)
        # no tl.cdiv: a jitted helper, which the interpreter cannot call when Triton was imported
        # before TRITON_INTERPRET was set (the tests)
        tiles_m = (m + BM - 1) // BM
        tiles_n = (ffn + BN - 1) // BN
        tiles = tiles_m * tiles_n
        k_tiles = (k_dim + BK - 1) // BK
        in_group = GROUP_M * tiles_n
        for tile in tl.range(pid, tiles, PROGRAMS, flatten=FLATTEN, warp_specialize=WS_TILES):
            group = tile // in_group
            first_m = group * GROUP_M
            size_m = tl.minimum(tiles_m - first_m, GROUP_M)
            pid_m = first_m + (tile % in_group) % size_m
            pid_n = (tile % in_group) // size_m
            om = pid_m * BM
            on = pid_n * BN
            acc_g = tl.full((BM, BN), 0.0, tl.float32)
            acc_u = tl.full((BM, BN), 0.0, tl.float32)
            for kk in tl.range(0, k_tiles, warp_specialize=WS_K):
                a = x_desc.load([om, kk * BK])
                wg = wg_desc.load([on, kk * BK])
                wu = wu_desc.load([on, kk * BK])
                if DOT_F32:
                    a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
                acc_g = tl.dot(a, wg.T, acc_g)
                acc_u = tl.dot(a, wu.T, acc_u)
            if WRITE_GU:
                g_desc.store([om, on], acc_g.to(g_desc.dtype))
                u_desc.store([om, on], acc_u.to(u_desc.dtype))
            if SWIGLU:
                gate = acc_g.to(g_desc.dtype).to(tl.float32)  # the engine rounds the base output first
                up = acc_u.to(u_desc.dtype).to(tl.float32)
                if LORA:
                    rows = om + tl.arange(0, BM)
                    cols = on + tl.arange(0, BN)
                    r = tl.arange(0, RANK)
                    row_in = rows < m
                    col_in = cols < ffn
                    r_in = r < rank
                    xa_g = tl.load(xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + r[None, :],
                                   mask=row_in[:, None] & r_in[None, :], other=0.0)
                    xa_u = tl.load(xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + rank + r[None, :],
                                   mask=row_in[:, None] & r_in[None, :], other=0.0)
                    bt_g = tl.load(bt_ptr + r[:, None] * stride_bt + cols[None, :],
                                   mask=r_in[:, None] & col_in[None, :], other=0.0)
                    bt_u = tl.load(bt_ptr + (rank + r)[:, None] * stride_bt + ffn + cols[None, :],
                                   mask=r_in[:, None] & col_in[None, :], other=0.0)
                    if DOT_F32:
                        xa_g, xa_u = xa_g.to(tl.float32), xa_u.to(tl.float32)
                        bt_g, bt_u = bt_g.to(tl.float32), bt_u.to(tl.float32)
                    gate += tl.dot(xa_g, bt_g) * scale
                    up += tl.dot(xa_u, bt_u) * scale
                act = gate / (1.0 + tl.exp(-gate)) * up
                act_desc.store([om, on], act.to(act_desc.dtype))


@functools.cache
def _jitted(interpreted: bool):
    """The kernel jitted for Triton's interpreter or its compiler (Triton decides when it wraps a
    function, so the tests, which set ``TRITON_INTERPRET`` after importing this, get their own)."""
    return triton.jit(gate_up_kernel)


def fused_gate_up(x, w, xa, bt, scale: float, rank: int, config: tuple, write_gu: bool, swiglu: bool,
                  programs: int, out=None):
    """Run :func:`gate_up_kernel`: ``(gu or None, act or None)``; ``w`` is ``[2 ffn, k]``, gate first."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps, group, flatten, persistent, ws = config
    m, k_dim = x.shape
    ffn = w.shape[0] // 2
    gu, act = out if out is not None else (None, None)
    if gu is None:
        gu = x.new_empty(m, 2 * ffn) if write_gu else x.new_empty(1, 2 * bn)
    if act is None:
        act = x.new_empty(m, ffn) if swiglu else x.new_empty(1, bn)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    wg_desc = TensorDescriptor.from_tensor(w[:ffn], [bn, bk])
    wu_desc = TensorDescriptor.from_tensor(w[ffn:], [bn, bk])
    g_desc = TensorDescriptor.from_tensor(gu[:, :gu.shape[1] // 2], [bm, bn])
    u_desc = TensorDescriptor.from_tensor(gu[:, gu.shape[1] // 2:], [bm, bn])
    act_desc = TensorDescriptor.from_tensor(act, [bm, bn])
    lora = xa is not None
    xa_, bt_ = (xa, bt) if lora else (x, x)
    tiles = -(-m // bm) * -(-ffn // bn)
    grid = (min(programs, tiles) if persistent else tiles,)
    kernel = _jitted(interpreted())
    kernel[grid](x_desc, wg_desc, wu_desc, g_desc, u_desc, act_desc, xa_, bt_, m, ffn, k_dim, float(scale),
                 xa_.stride(0), bt_.stride(0), rank, BM=bm, BN=bn, BK=bk,
                 RANK=max(16, 1 << max(0, rank - 1).bit_length()), GROUP_M=group, PROGRAMS=grid[0],
                 WRITE_GU=write_gu, SWIGLU=swiglu, LORA=lora, DOT_F32=x.device.type != "cuda", FLATTEN=flatten,
                 WS_TILES=ws == "w", WS_K=ws == "k", num_stages=stages, num_warps=warps)
    return (gu if write_gu else None), (act if swiglu else None)


def parse_config(text: str) -> tuple:
    """``BMxBNxBKxSTAGESxWARPS`` with an optional ``-`` and flags ``gG``, ``f``, ``n``: tile rows, columns (each of gate and up), inner size,
    pipeline stages, warps; ``gG`` rows of tiles in a group (8), ``f`` the persistent loop flattened
    into the inner one (Triton pipelines across tiles), ``n`` one program a tile (not persistent), ``w``
    or ``k`` Triton's warp specialization asked for on the loop over tiles or over the inner
    dimension (``tl.range(warp_specialize=True)``)."""
    head, _, flags = text.partition("-")
    bm, bn, bk, stages, warps = (int(v) for v in head.split("x"))
    group = int(re.search(r"g(\d+)", flags).group(1)) if "g" in flags else 8
    ws = "w" if "w" in flags else "k" if "k" in flags else ""
    return bm, bn, bk, stages, warps, group, "f" in flags, "n" not in flags, ws


def config_name(cfg: tuple) -> str:
    bm, bn, bk, stages, warps, group, flatten, persistent, ws = cfg
    flags = (f"g{group}" if group != 8 else "") + ("f" if flatten else "") + ("" if persistent else "n") + ws
    return f"{bm}x{bn}x{bk}x{stages}x{warps}" + (f"-{flags}" if flags else "")


def reference(x, w, xa, bt, scale: float, rank: int):
    """The engine's order in plain torch: the base output rounded, the update in fp32, SwiGLU in fp32."""
    import torch

    ffn = w.shape[0] // 2
    gu = (x.float() @ w.float().T).to(x.dtype)
    upd = (xa.float() @ bt.float()) * scale
    g = gu[:, :ffn].float() + upd[:, :ffn]
    u = gu[:, ffn:].float() + upd[:, ffn:]
    return gu, (torch.nn.functional.silu(g) * u).to(x.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="8192,4096")
    parser.add_argument("--configs", default="128x128x64x3x8,128x128x64x3x8-f,128x128x64x4x8-f,"
                        "128x128x64x3x8-n,128x128x64x3x8-g16f,128x128x128x2x8-f,64x128x64x4x4-f",
                        help="comma-separated, each as parse_config reads it")
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heat-s", type=float, default=3.0)
    parser.add_argument("--code", default="", help="the commit that ran (recorded in the JSON)")
    args = parser.parse_args()

    import torch

    from studio.engine.fast import update

    dev, bf = torch.device("cuda"), torch.bfloat16
    hidden, ffn, rank, scale = 4096, 11008, 16, 2.0
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    configs = [parse_config(c) for c in args.configs.split(",")]
    result = {"command": " ".join(sys.argv), "code": args.code, "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__},
              "programs": programs, "tokens": {}}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    w = (torch.randn(2 * ffn, hidden, device=dev) * 0.02).to(bf)
    bt = torch.zeros(2 * rank, 2 * ffn, device=dev, dtype=bf)
    bt[:rank, :ffn] = 0.01 * torch.randn(rank, ffn, device=dev)
    bt[rank:, ffn:] = 0.01 * torch.randn(rank, ffn, device=dev)
    split = (0, rank, rank, rank)
    heat = torch.randn(8192, 8192, device=dev, dtype=bf)

    for m in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(m, hidden, device=dev, dtype=bf)
        xa = (torch.randn(m, 2 * rank, device=dev) * 0.5).to(bf)
        gu = torch.empty(m, 2 * ffn, device=dev, dtype=bf)
        act = torch.empty(m, ffn, device=dev, dtype=bf)
        flops = 2.0 * m * hidden * 2 * ffn
        ref_gu, ref_act = reference(x, w, xa, bt, scale, rank)
        entry: dict = {"checks": {}, "configs": {}}

        def cublas():
            torch.mm(x, w.T, out=gu)

        def cublas_swiglu():
            torch.mm(x, w.T, out=gu)
            update.gated(gu, xa, bt, scale, split)

        def case(cfg, write_gu, swiglu):
            return lambda: fused_gate_up(x, w, xa if swiglu else None, bt, scale, rank, cfg, write_gu, swiglu,
                                         programs, out=(gu, act))

        # Correctness first (and every config compiled outside the timed loops).
        cublas_swiglu()
        torch.cuda.synchronize()
        working = []
        for cfg in configs:
            name = config_name(cfg)
            try:
                g_out, a_out = case(cfg, True, True)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a config that does not compile here is reported
                entry["configs"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            entry["checks"][name] = {
                "gu_max_abs_diff": float((g_out.float() - ref_gu.float()).abs().max()),
                "act_max_abs_diff": float((a_out.float() - ref_act.float()).abs().max()),
                "act_mean_abs": float(ref_act.float().abs().mean()),
            }
            working.append(cfg)
        studio_act = update.gated(torch.mm(x, w.T), xa, bt, scale, split)
        entry["checks"]["studio_swiglu_act_max_abs_diff"] = float((studio_act.float() - ref_act.float()).abs().max())

        cases = {"cublas": cublas, "cublas_swiglu": cublas_swiglu}
        for cfg in working:
            name = config_name(cfg)
            cases[f"triton_product/{name}"] = case(cfg, True, False)
            cases[f"fused_forward/{name}"] = case(cfg, False, True)
            cases[f"fused_recompute/{name}"] = case(cfg, True, True)
        for fn in cases.values():  # warm
            fn()
        heat_end = time.perf_counter() + args.heat_s
        while time.perf_counter() < heat_end:
            for _ in range(20):
                torch.mm(heat, heat)
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(loop_ms(fn, args.loops))
        med = {name: statistics.median(v) for name, v in times.items()}
        for name, v in times.items():
            entry["configs"].setdefault(name, {})
            entry["configs"][name] = {"median_ms": round(med[name], 4), "min_ms": round(min(v), 4),
                                      "max_ms": round(max(v), 4),
                                      "tflops": round(flops / med[name] / 1e9, 1)}
        best = {}
        for kind in ("triton_product", "fused_forward", "fused_recompute"):
            names = [n for n in med if n.startswith(kind + "/")]
            if names:
                fastest = min(names, key=med.get)
                best[kind] = {"config": fastest.split("/")[1], "ms": round(med[fastest], 4)}
        summary = {"cublas_ms": round(med["cublas"], 4), "cublas_swiglu_ms": round(med["cublas_swiglu"], 4),
                   "swiglu_share_ms": round(med["cublas_swiglu"] - med["cublas"], 4), "best": best}
        for kind in ("fused_forward", "fused_recompute"):
            if kind in best:
                summary[f"{kind}_saves_ms"] = round(med["cublas_swiglu"] - best[kind]["ms"], 4)
        if "triton_product" in best:
            summary["triton_product_over_cublas"] = round(best["triton_product"]["ms"] / med["cublas"], 4)
        entry["summary"] = summary
        result["tokens"][str(m)] = entry
        print(m, json.dumps(summary), flush=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
