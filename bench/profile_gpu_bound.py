"""Where a GPU-bound step's time goes, and how fast its products could ever run.

Issue 13's micro-batch 16 and sequence 4096 rows are GPU-bound: the host's cost is hidden behind
8192 or 4096 tokens of work a step. This script answers two questions about them on one GPU, in one
process, on the Llama-2-7B shape (random weights, NF4, LoRA r16 on all 7 projections, seq x mb
tokens of fixed-length rows, checkpointing):

1. **Where the time goes.** Studio's fast path (``studio.engine.fast``, the loop of bench/speed.py)
   trains ``--steps`` steps per variant (the defaults, and each ``--levers`` entry: a
   bench/speed.py lever switched off, e.g. ``keep_last_product``); two steps of the defaults are
   profiled and every GPU kernel is put in a category (matrix products, 4-bit dequantization,
   attention, liger's Triton kernels, elementwise, copies, optimizer), with the GPU's busy share.
2. **The ceiling.** The same step's matrix products and attention kernels alone, with bf16 weights
   already in memory (no dequantization, no LoRA, no norms, no loss), timed: forward, the
   checkpointed recomputation (without and with the last product of each layer) and the input
   gradients. No implementation that recomputes each layer and uses these kernels runs faster.

Writes ``--out`` (JSON: the command, GPU, versions, per-workload tokens/s, the kernel table and the
ceilings). Usage: ``python bench/profile_gpu_bound.py --out bench/results/current/x.json --workloads 512x16,4096x1``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "sm90_", "sm80_")),
    ("4-bit dequantization", ("dequant",)),
    ("liger (norm, rope, swiglu, loss)", ("rms_norm", "swiglu", "rope", "liger", "cross_entropy", "_triton")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("elementwise and reductions", ("elementwise", "reduce", "vectorized", "unrolled", "copy", "fill", "cat",
                                    "index", "masked", "where", "scatter", "gather")),
)


def category(name: str, cat: str) -> str:
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies and memsets"
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other"


def launching_ops(events: list[dict]) -> dict[int, str]:
    """For each launch's correlation id, the operators it was launched from (innermost last,
    three deep): where a kernel comes from in the code."""
    by_thread: dict[tuple, list] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "cuda_runtime", "user_annotation"):
            continue
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: dict[int, str] = {}
    for items in by_thread.values():
        # ops before launches at the same instant, longer (outer) ops first
        items.sort(key=lambda e: (float(e["ts"]), e["cat"] == "cuda_runtime", -float(e.get("dur", 0))))
        stack: list[dict] = []
        for e in items:
            ts = float(e["ts"])
            while stack and float(stack[-1]["ts"]) + float(stack[-1].get("dur", 0)) < ts:
                stack.pop()
            if e["cat"] == "cuda_runtime":
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    out[corr] = " > ".join(op["name"][:40] for op in stack[-3:])
            else:
                stack.append(e)
    return out


def kernel_table(trace_path: Path, wall_s: float) -> dict:
    """The profiled steps' GPU kernels by category (ms), the top kernels (with the operators
    that launched them), and the busy share."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    origin = launching_ops(events)
    spans, by_cat, by_name = [], {}, {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        dur = float(e.get("dur", 0)) / 1e3
        spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        c = category(e.get("name", ""), e["cat"])
        by_cat[c] = by_cat.get(c, 0.0) + dur
        key = e.get("name", "")[:70] + " @ " + origin.get((e.get("args") or {}).get("correlation"), "?")
        count, total = by_name.get(key, (0, 0.0))
        by_name[key] = (count + 1, total + dur)
    spans.sort()
    busy, end = 0.0, -1.0
    for a, b in spans:  # union of the kernels' intervals, all streams
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    return {"wall_ms": round(wall_s * 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "busy_share": round(busy / 1e3 / (wall_s * 1e3), 4) if wall_s else None,
            "by_category_ms": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": k, "count": n, "ms": round(t, 2)} for k, (n, t) in top]}


def compute_stream_gaps(trace_path: Path, steps: int) -> dict:
    """Where the compute stream (the one with the most kernel time) waits, per step: its gaps between
    consecutive kernels, copies on other streams or not, by size, and by the operator that launched
    the kernel after each gap (what the stream was waiting to start)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    origin = launching_ops(events)
    by_stream: dict[object, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            by_stream.setdefault((e.get("args") or {}).get("stream", e.get("tid")), []).append(e)
    if not by_stream:
        return {}
    stream = max(by_stream, key=lambda k: sum(float(e.get("dur", 0)) for e in by_stream[k] if e["cat"] == "kernel"))
    items = sorted(by_stream[stream], key=lambda e: float(e["ts"]))
    # When the host asked for each kernel: a gap the launch call ended after is the host's (the GPU
    # had nothing queued); one it ended before is the device's (the kernel waited on an event: a
    # copy, another stream).
    launched = {(e.get("args") or {}).get("correlation"): float(e["ts"]) + float(e.get("dur", 0))
                for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    sizes = {"under 10 us": 0.0, "10-100 us": 0.0, "0.1-1 ms": 0.0, "over 1 ms": 0.0}
    counts = dict.fromkeys(sizes, 0)
    by_next: dict[str, list[float]] = {}
    whose = {"host (launched late)": 0.0, "device (queued, waiting)": 0.0, "unknown": 0.0}
    end, previous = None, ""
    for e in items:
        ts = float(e["ts"])
        if end is not None and ts > end:
            gap = ts - end
            key = "under 10 us" if gap < 10 else "10-100 us" if gap < 100 else "0.1-1 ms" if gap < 1000 else "over 1 ms"
            sizes[key] += gap
            counts[key] += 1
            if gap >= 10:
                corr = (e.get("args") or {}).get("correlation")
                name = e.get("name", "")[:40] + " @ " + origin.get(corr, "?") + " | after " + previous[:40]
                by_next.setdefault(name, []).append(gap)
                at = launched.get(corr)
                whose["unknown" if at is None else "host (launched late)" if at > end else "device (queued, waiting)"] += gap
        end = max(end or 0.0, ts + float(e.get("dur", 0)))
        previous = e.get("name", "")
    busy = sum(float(e.get("dur", 0)) for e in items)
    top = sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {"stream": str(stream), "busy_ms_per_step": round(busy / 1e3 / steps, 2),
            "idle_ms_per_step": round(sum(sizes.values()) / 1e3 / steps, 2),
            "idle_by_size_ms_per_step": {k: round(v / 1e3 / steps, 2) for k, v in sizes.items()},
            "gaps_by_size_per_step": {k: round(v / steps, 1) for k, v in counts.items()},
            "idle_10us_up_by_cause_ms_per_step": {k: round(v / 1e3 / steps, 2) for k, v in whose.items()},
            "idle_before_ms_per_step": [{"next": k, "gaps": len(v) // steps, "ms": round(sum(v) / 1e3 / steps, 2)}
                                        for k, v in top]}


def idle_by_phase(trace_path: Path, steps: int) -> dict:
    """The GPU's idle time between its first and last kernel (no kernel, copy or memset on any
    stream), per step, put under the host's ``studio.*`` ranges (engine/train.py's ``phase``)
    running meanwhile; what no range covers is "unlabelled"."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    labels = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
              if e.get("ph") == "X" and e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("studio.")]
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    by_phase: dict[str, float] = {}
    largest = []
    for a, b in gaps:
        covered = 0.0
        for la, lb, name in labels:
            overlap = min(b, lb) - max(a, la)
            if overlap > 0:
                by_phase[name] = by_phase.get(name, 0.0) + overlap
                covered += overlap
        if b - a > covered:
            by_phase["unlabelled"] = by_phase.get("unlabelled", 0.0) + (b - a - covered)
        under = [(min(b, lb) - max(a, la), n) for la, lb, n in labels if min(b, lb) > max(a, la)]
        largest.append((b - a, max(under)[1] if under else "unlabelled"))
    largest.sort(reverse=True)
    total = sum(b - a for a, b in gaps)
    return {"idle_ms_per_step": round(total / 1e3 / steps, 2),
            "idle_by_phase_ms_per_step": {k: round(v / 1e3 / steps, 2)
                                          for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])},
            "largest_gaps_ms": [(round(d / 1e3, 2), n) for d, n in largest[:8]]}


def ceiling(tokens: int, seq: int, mb: int, layers: int = 32, hidden: int = 4096, inter: int = 11008,
            vocab: int = 32000, heads: int = 32, repeats: int = 3) -> dict:
    """The step's products and attention alone (bf16 weights resident), timed on the GPU."""
    import torch
    import torch.nn.functional as F

    from bench.gpu_timing import best_ms

    dev = torch.device("cuda")
    bf = torch.bfloat16
    # one layer's weights (out, in), reused by every layer: the products' shapes are what matter
    shapes = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    w = {k: torch.randn(s, device=dev, dtype=bf) * 0.02 for k, s in shapes.items()}
    head = torch.randn(vocab, hidden, device=dev, dtype=bf) * 0.02
    x = torch.randn(tokens, hidden, device=dev, dtype=bf)
    xi = torch.randn(tokens, inter, device=dev, dtype=bf)
    dys = {k: torch.randn(tokens, s[0], device=dev, dtype=bf) for k, s in shapes.items()}
    head_chunk = min(tokens, 4096)  # the fused loss goes through the tokens in chunks
    dlogits = torch.randn(head_chunk, vocab, device=dev, dtype=bf)
    q = torch.randn(mb, heads, seq, hidden // heads, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)

    def forward(skip_down: bool) -> None:
        for name, weight in w.items():
            if name == "down":
                if not skip_down:
                    torch.mm(xi, weight.t())
            else:
                torch.mm(x, weight.t())

    def backward() -> None:
        for name, weight in w.items():
            torch.mm(dys[name], weight)

    def attention_fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def timed(fn) -> float:
        return best_ms(fn, loops=1, repeats=repeats, warm=False)  # the caller warms up where it matters

    def layers_products(skip_down: bool) -> None:
        for _ in range(layers):
            forward(False)       # the forward
            forward(skip_down)   # the checkpointed recomputation
            backward()           # the input gradients (the base weights are frozen)

    def head_products() -> None:
        for start in range(0, tokens, head_chunk):
            n = min(head_chunk, tokens - start)
            torch.mm(x[:n], head.t())
            torch.mm(dlogits[:n], head)

    out = attention_fwd()
    grad = torch.randn_like(out)

    def attention_all() -> None:
        for _ in range(layers):
            with torch.no_grad():
                attention_fwd()  # the forward
            o = attention_fwd()  # the recomputation, whose backward follows
            torch.autograd.grad(o, (q, k, v), grad)

    timed(lambda: layers_products(False))  # warm-up (cuBLAS heuristics, clocks)
    full = timed(lambda: layers_products(False))
    skipped = timed(lambda: layers_products(True))
    head_ms = timed(head_products)
    attn_ms = timed(attention_all)
    flops_layer = sum(2 * tokens * a * b for a, b in shapes.values())
    gemm_flops = layers * 3 * flops_layer + 2 * 2 * tokens * hidden * vocab
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=bf)
    square = timed(lambda: torch.mm(a, a))
    # The same product for ~2 s: under its power limit the card lowers its clock (an H100 SXM ran at
    # a median 1410 of its 1980 MHz, bench/results/archive/h100_v18_product_shapes.json), and a training
    # step's products run at this rate, not at the short loop's.
    sustained = best_ms(lambda: torch.mm(a, a), loops=1500, repeats=1, warm=False)
    return {"tokens": tokens, "products_ms": round(full + head_ms, 2),
            "products_skip_last_ms": round(skipped + head_ms, 2), "attention_ms": round(attn_ms, 2),
            "products_tflops": round(gemm_flops / ((full + head_ms) / 1e3) / 1e12, 1),
            "matmul_8192_tflops": round(2 * n ** 3 / (square / 1e3) / 1e12, 1),
            "matmul_8192_sustained_tflops": round(2 * n ** 3 / (sustained / 1e3) / 1e12, 1),
            "ceiling_tokens_per_s": round(tokens / ((full + head_ms + attn_ms) / 1e3)),
            "ceiling_skip_last_tokens_per_s": round(tokens / ((skipped + head_ms + attn_ms) / 1e3))}


def schedule(levers: list[str], repeats: int) -> list[tuple[int, str]]:
    """The runs of one workload, in order, as (repeat, lever): each repeat runs every lever once
    (interleaved, so a drift of the machine's speed reaches all of them alike). With repeats, a first
    run of the first lever comes before them and is not kept (repeat -1): the sixteenth session's
    first run of a process was up to 7% slower than the rest (``h100_v16_lever_handoff.json``)."""
    runs = [(r, x) for r in range(repeats) for x in levers]
    return [(-1, levers[0]), *runs] if repeats > 1 else runs


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name.replace("_", "-"))
    except PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="512x16,4096x1", help="SEQxMB, comma-separated")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--levers", default="no_offload", help="bench/speed.py levers to time too")
    parser.add_argument("--models-dir", default="/tmp/models")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the variants this many times, interleaved (all, lever, all, lever, ...), "
                             "after one warm-up run that is not kept: each variant's rates and their median, "
                             "for levers of about the run-to-run spread")
    args = parser.parse_args()

    import torch
    import transformers

    from bench.speed import LEVERS, fast_facts, random_7b, studio_train
    from studio.core.config import FastPathConfig
    from studio.engine import fast

    t0 = time.perf_counter()
    model = random_7b(args.models_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           **{name: _version(name) for name in ("peft", "bitsandbytes", "liger_kernel")}},
              "load_s": round(time.perf_counter() - t0, 1), "workloads": {}}
    out_path = Path(args.out)
    for spec in args.workloads.split(","):
        seq, mb = (int(x) for x in spec.split("x"))
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(4):
            ids = torch.randint(3, 32000, (mb, seq), generator=g)
            batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": None,
                            "position_ids": torch.arange(seq).expand(mb, seq).contiguous(), "tokens": mb * seq})
        row = {"variants": {}}
        levers = ["all", *[x for x in args.levers.split(",") if x]]
        for repeat, lever in schedule(levers, args.repeats):
            fm, why = fast.prepare(model, FastPathConfig(**LEVERS[lever]))
            if fm is None:
                row["variants"][lever] = {"error": why}
                continue
            torch.cuda.reset_peak_memory_stats()
            res = studio_train(fm, params, batches, args.steps, 2e-4, 3, 42)
            if repeat < 0:
                print(f"{spec} {lever} (warm-up run, not kept): {res['tokens_per_s']:.0f} tokens/s", flush=True)
            elif repeat == 0:
                row["variants"][lever] = {"tokens_per_s": round(res["tokens_per_s"]), "losses": res["losses"][:6],
                                          "peak_reserved_gib": round(res["peak_reserved"] / 2**30, 3),
                                          "fast_path": fast_facts(fm)}
            if args.repeats > 1 and repeat >= 0:
                variant = row["variants"][lever]
                variant.setdefault("repeats_tokens_per_s", []).append(round(res["tokens_per_s"]))
                variant["median_tokens_per_s"] = sorted(variant["repeats_tokens_per_s"])[
                    (len(variant["repeats_tokens_per_s"]) - 1) // 2]
            if repeat >= 0:
                print(f"{spec} {lever} (run {repeat + 1}): {res['tokens_per_s']:.0f} tokens/s", flush=True)
            if lever == "all" and repeat == 0 and not args.no_profile:
                trace = out_path.with_name(out_path.stem + f"_trace_{spec}.json")
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                torch.cuda.synchronize()
                w0 = time.perf_counter()
                with prof:
                    studio_train(fm, params, batches, 2, 2e-4, 0, 42)
                wall = time.perf_counter() - w0
                prof.export_chrome_trace(str(trace))
                row["profile_2_steps"] = kernel_table(trace, wall)
                row["profile_2_steps"]["compute_stream"] = compute_stream_gaps(trace, 2)
                print(json.dumps(row["profile_2_steps"]["compute_stream"]), flush=True)
                trace.unlink()
                print(json.dumps(row["profile_2_steps"]["by_category_ms"]), flush=True)
            fm.release_graphs()
            del fm
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        row["ceiling"] = ceiling(seq * mb, seq, mb)
        print(json.dumps(row["ceiling"]), flush=True)
        result["workloads"][spec] = row
        out_path.write_text(json.dumps(result, indent=1))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
