"""How fast each of a 7B step's matrix products runs on this GPU, shape by shape and layout by layout.

The fast path's products run at ~90% of a square 8192^3 product's rate (bench/NOTES.md, the
ceiling). This times each product of a Llama-2-7B layer as the engine calls it (forward ``x @ W^T``
with the LoRA update already in the output, so the base product adds itself: ``addmm_``; backward
``dy @ W``), beside alternatives: the projections that share an input fused into one product
(q/k/v, gate/up), an inner size widened by the rank (the LoRA update folded into the base product),
and cuBLASLt instead of cuBLAS. The projections that run split (one at a time, each writing its column
block of the fused output, reading its block of the output's gradient) are also timed that way
(``*_columns``). Each case is the best of several timed repeats of a loop of 20 products; TFLOP/s
counts the product's multiply-adds only. ``--sustained N`` also times N square products in one loop.

    python3 bench/product_shapes.py --out bench/results/current/x.json [--tokens 8192,4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import best_ms  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="8192,4096")
    parser.add_argument("--loops", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sustained", type=int, default=0,
                        help="also time this many square products in one loop (0: not)")
    args = parser.parse_args()

    import torch

    dev = torch.device("cuda")
    bf = torch.bfloat16
    hidden, inter, rank = 4096, 11008, 16

    def timed(fn) -> float:
        return best_ms(fn, args.loops, args.repeats)

    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda}, "cases": {}}
    t0 = time.perf_counter()
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=bf)
    ms = timed(lambda: torch.mm(a, a))
    result["cases"]["square_8192"] = {"ms": round(ms, 4), "tflops": round(2 * n ** 3 / ms / 1e9, 1)}
    if args.sustained:
        # The same product for about as long as a few training steps: a card that lowers its clock
        # under sustained load shows it here, where the short loops above see the boost clock.
        # nvidia-smi samples the clock and the power draw meanwhile.
        with card_samples() as samples:
            ms = best_ms(lambda: torch.mm(a, a), args.sustained, 1)
        result["cases"]["square_8192_sustained"] = {"ms": round(ms, 4), "loops": args.sustained,
                                                    "tflops": round(2 * n ** 3 / ms / 1e9, 1),
                                                    "card": summary(samples)}

    for backend in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(backend)
        for m in (int(t) for t in args.tokens.split(",")):
            # (name, out features N, inner K): forward x[M,K] @ W[N,K]^T; backward dy[M,N] @ W[N,K]
            shapes = [("q_or_k_or_v_or_o", hidden, hidden), ("qkv_fused", 3 * hidden, hidden),
                      ("gate_or_up", inter, hidden), ("gate_up_fused", 2 * inter, hidden),
                      ("down", hidden, inter), ("q_folded_k4112", hidden, hidden + rank),
                      ("gate_folded_k4112", inter, hidden + rank)]
            for name, out_f, in_f in shapes:
                w = torch.randn(out_f, in_f, device=dev, dtype=bf) * 0.02
                x = torch.randn(m, in_f, device=dev, dtype=bf)
                y = torch.randn(m, out_f, device=dev, dtype=bf)
                dy = torch.randn(m, out_f, device=dev, dtype=bf)
                dx = torch.randn(m, in_f, device=dev, dtype=bf)
                flops = 2 * m * out_f * in_f
                cases = {
                    "fwd_mm": lambda: torch.mm(x, w.t(), out=y),
                    "fwd_addmm_into": lambda: y.addmm_(x, w.t()),
                    "bwd_mm": lambda: torch.mm(dy, w, out=dx),
                    "bwd_addmm_into": lambda: dx.addmm_(dy, w),
                }
                wide = {"q_or_k_or_v_or_o": 3 * hidden, "gate_or_up": 2 * inter}.get(name)
                if wide:
                    # The split products as the engine runs them (frozen.FrozenWeights): each
                    # projection writes its own column block of the fused output, and its backward
                    # reads its column block of the fused output's gradient.
                    yw = torch.randn(m, wide, device=dev, dtype=bf)
                    dyw = torch.randn(m, wide, device=dev, dtype=bf)
                    cases["fwd_mm_columns"] = lambda: torch.mm(x, w.t(), out=yw[:, :out_f])
                    cases["bwd_mm_columns"] = lambda: torch.mm(dyw[:, :out_f], w, out=dx)
                    cases["bwd_addmm_columns"] = lambda: dx.addmm_(dyw[:, :out_f], w)
                for case, fn in cases.items():
                    ms = timed(fn)
                    key = f"{backend}/{m}/{name}/{case}"
                    result["cases"][key] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
                    print(key, result["cases"][key], flush=True)
            # the LoRA update's own products at this size (inner size the rank)
            xa = torch.randn(m, rank, device=dev, dtype=bf)
            bt = torch.randn(rank, inter, device=dev, dtype=bf)
            y = torch.empty(m, inter, device=dev, dtype=bf)
            ms = timed(lambda: y.addmm_(xa, bt, beta=0, alpha=2.0))
            key = f"{backend}/{m}/lora_update_gate_bz"
            result["cases"][key] = {"ms": round(ms, 4), "gb_per_s": round(m * inter * 2 / ms / 1e6, 1)}
            print(key, result["cases"][key], flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


@contextmanager
def card_samples(every_ms: int = 100):
    """The SM clock (MHz) and power draw (W) nvidia-smi reads every ``every_ms`` while the block
    runs: a list of (clock, watts), filled on the way out (empty without nvidia-smi)."""
    samples: list[tuple[float, float]] = []
    try:
        proc = subprocess.Popen(["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", f"-lms={every_ms}"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        yield samples
        return
    try:
        yield samples
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                samples.append((float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue


def summary(samples: list[tuple[float, float]]) -> dict:
    """Median and range of the clock and the power draw (the first and last samples, taken while
    the loop starts and ends, are left out)."""
    body = samples[1:-1] or samples
    if not body:
        return {}
    clocks, watts = sorted(c for c, _ in body), sorted(w for _, w in body)
    return {"samples": len(body), "sm_clock_mhz_median": clocks[len(clocks) // 2],
            "sm_clock_mhz_range": [clocks[0], clocks[-1]], "power_w_median": watts[len(watts) // 2],
            "power_w_max": watts[-1]}


if __name__ == "__main__":
    raise SystemExit(main())
