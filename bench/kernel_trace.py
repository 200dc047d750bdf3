"""A profiled training step's device time by what it computes, read off a torch.profiler chrome trace.

bench/profile_gpu_bound.py (and bench/speed.py's Trainer profile) export the trace of two steps;
this module puts each kernel, copy and memset in a category and measures how busy the GPU was.
A kernel's category comes first from the code that launched it (the operators and ranges open on
the host when it was launched, innermost first: :data:`CONTEXTS`), then from its own name
(:data:`NAMES`). Kernels replayed from a CUDA graph were launched by the graph as a whole, so their
names alone place them: Studio's Triton kernels are named after their functions
(``attention_forward``, ``gated_backward``, ``nf4_dequantize``...), liger-kernel's after its
(``_geglu_tanh_forward_kernel``, ``liger_cross_entropy_kernel``...).

On a machine without a GPU the trace has no kernels; the operators that call no other operator
(``aten::mm``, ``aten::gelu``...) stand for them, with their CPU time, so the same table can be
read (less finely: a norm in plain torch is a few elementwise operators there).
"""

from __future__ import annotations

import json
from pathlib import Path

LOSS = "loss: head products, cross-entropy, soft-cap"
EMBEDDING = "embedding"
OPTIMIZER = "optimizer"

CONTEXTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (LOSS, ("bench.loss", "linearcrossentropy", "headcrossentropy", "tokenlogps")),
    (EMBEDDING, ("bench.embedding",)),
    ("attention: plain torch", ("eagerattention",)),
    (OPTIMIZER, ("optimizer.step", "clip_grad")),
)
"""A category by the host code a kernel was launched from: a needle in the name (lowercased) of an
operator or range open at the launch. ``bench.loss`` and ``bench.embedding`` are the ranges
bench/profile_gpu_bound.py opens around the fast path's loss and embedding; the autograd Functions'
own records (Studio's and liger's fused cross-entropy, Studio's EagerAttention) name the rest."""

NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention: Studio's fused kernels", ("attention_forward", "attention_delta", "attention_backward")),
    ("attention: flash / SDPA", ("flash", "fmha", "cudnn", "scaled_dot_product", "sdpa")),
    (LOSS, ("cross_entropy", "element_mul", "nll_loss", "log_softmax")),
    ("gated activation: Studio's kernel (SwiGLU or GeGLU, the LoRA update inside)", ("gated_forward",
                                                                                     "gated_backward")),
    ("GELU (GeGLU)", ("geglu", "gelu")),
    ("SwiGLU", ("swiglu", "silu")),
    ("norms", ("rms_norm", "rmsnorm", "layer_norm")),
    ("RoPE", ("rope",)),
    ("LoRA update and residual", ("residual_update",)),
    ("4-bit dequantization", ("dequant",)),
    (EMBEDDING, ("indexselect", "index_select", "embedding")),
    (OPTIMIZER, ("multi_tensor", "adam")),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "sm90_", "sm80_", "aten::mm",
                         "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("elementwise and reductions", ("elementwise", "reduce", "vectorized", "unrolled", "copy", "fill", "cat",
                                    "index", "masked", "where", "scatter", "gather", "aten::")),
)
"""A category by a kernel's own name (lowercased), the first that matches: the specific ones
before the catch-alls (a GEMM in the loss is the loss's by its context, not here)."""

HOST_COPIES = "host copies (offload, side stream)"
DEVICE_COPIES = "device copies and memsets"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str, cat: str = "kernel", stack: tuple[str, ...] = ()) -> str:
    """The category of a kernel (``cat`` "kernel"), copy ("gpu_memcpy") or memset ("gpu_memset")
    named ``name``, launched with the operators and ranges ``stack`` open (outermost first)."""
    if cat == "gpu_memcpy" and ("pinned" in name.lower() or "pageable" in name.lower()):
        return HOST_COPIES
    if cat in ("gpu_memcpy", "gpu_memset"):
        return DEVICE_COPIES
    for frame in reversed(stack):
        low = frame.lower()
        for label, needles in CONTEXTS:
            if any(n in low for n in needles):
                return label
    low = name.lower()
    for label, needles in NAMES:
        if any(n in low for n in needles):
            return label
    return "other"


def _span(e: dict) -> tuple[float, float]:
    start = float(e["ts"])
    return start, start + float(e.get("dur", 0))


def host_stacks(events: list[dict]) -> tuple[dict[int, tuple[str, ...]], list[tuple[dict, tuple[str, ...], float]]]:
    """The host side of a trace: for each launch's correlation id, the operators and ranges open
    when it was made (outermost first); and each operator with those open around it and its own
    time (us: its span less the operators it opened), what it ran itself on a CPU."""
    by_thread: dict[tuple, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    launches: dict[int, tuple[str, ...]] = {}
    ops: list[tuple[dict, tuple[str, ...], float]] = []
    for items in by_thread.values():
        # containers before what they contain: the earlier start, then the launch last, then the longer
        items.sort(key=lambda e: (float(e["ts"]), e["cat"] == "cuda_runtime", -float(e.get("dur", 0))))
        stack: list[list] = []  # per open operator or range: [event, the names open around it, its children's time]

        def close() -> None:
            event, names, inner = stack.pop()
            if event["cat"] == "cpu_op":
                ops.append((event, names, max(0.0, float(event.get("dur", 0)) - inner)))

        for e in items:
            ts = float(e["ts"])
            while stack and _span(stack[-1][0])[1] <= ts:
                close()
            names = tuple(frame[0]["name"] for frame in stack)
            if e["cat"] == "cuda_runtime":
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    launches[corr] = names
                continue
            if stack:
                stack[-1][2] += float(e.get("dur", 0))
            stack.append([e, names, 0.0])
        while stack:
            close()
    return launches, ops


def device_work(events: list[dict]) -> tuple[list[dict], str]:
    """The trace's units of device work, each ``{name, cat, start, dur, stack, stream}`` (us): its
    kernels, copies and memsets with the host stack of their launch; without any (a CPU-only
    trace), its operators with their own CPU time. The second value says which (``gpu`` or ``cpu ops``)."""
    launches, ops = host_stacks(events)
    work = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK:
            corr = (e.get("args") or {}).get("correlation")
            work.append({"name": e.get("name", ""), "cat": e["cat"], "start": float(e["ts"]),
                         "dur": float(e.get("dur", 0)), "stack": launches.get(corr, ()),
                         "stream": (e.get("args") or {}).get("stream", e.get("tid"))})
    if work:
        return work, "gpu"
    for e, stack, own in ops:
        work.append({"name": e.get("name", ""), "cat": "kernel", "start": float(e["ts"]), "dur": own, "stack": stack,
                     "stream": e.get("tid")})
    return work, "cpu ops"


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals ``spans``."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is not None and b <= end:
            continue
        total += b - (a if end is None else max(a, end))
        end = b
    return total


def kernel_table(trace_path: Path, wall_s: float, steps: int = 2) -> dict:
    """The profiled steps' device work by category (ms, in all and per step), the top kernels (with
    the operators that launched them and their category), and the busy share of the wall time
    (``wall_s``): the union of all streams' work, and the compute stream's alone (the one with the
    most kernel time: the side stream's host copies overlap it)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    work, source = device_work(events)
    by_cat: dict[str, float] = {}
    by_name: dict[str, list] = {}
    per_stream: dict[object, float] = {}
    for w in work:
        dur = w["dur"] / 1e3
        label = category(w["name"], w["cat"], w["stack"])
        by_cat[label] = by_cat.get(label, 0.0) + dur
        key = w["name"][:70] + " @ " + (" > ".join(f[:40] for f in w["stack"][-3:]) or "?")
        row = by_name.setdefault(key, [0, 0.0, label])
        row[0] += 1
        row[1] += dur
        if w["cat"] == "kernel":
            per_stream[w["stream"]] = per_stream.get(w["stream"], 0.0) + dur
    compute = max(per_stream, key=per_stream.get) if per_stream else None
    if source == "gpu":  # the union of the streams' work (they overlap)
        busy = busy_us([(w["start"], w["start"] + w["dur"]) for w in work]) / 1e3
        compute_busy = busy_us([(w["start"], w["start"] + w["dur"]) for w in work if w["stream"] == compute]) / 1e3
    else:  # operators' own times on a thread never overlap
        busy = sum(w["dur"] for w in work) / 1e3
        compute_busy = sum(w["dur"] for w in work if w["stream"] == compute) / 1e3
    wall_ms = wall_s * 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    ordered = sorted(by_cat.items(), key=lambda kv: -kv[1])
    return {"kernels_from": source, "steps": steps, "wall_ms": round(wall_ms, 2), "gpu_busy_ms": round(busy, 2),
            "busy_share": round(busy / wall_ms, 4) if wall_ms else None,
            "compute_stream_busy_share": round(compute_busy / wall_ms, 4) if wall_ms else None,
            "by_category_ms": {k: round(v, 2) for k, v in ordered},
            "by_category_ms_per_step": {k: round(v / steps, 2) for k, v in ordered},
            "top_kernels": [{"name": k, "category": label, "count": n, "ms": round(t, 2)}
                            for k, (n, t, label) in top]}


def compute_stream_gaps(trace_path: Path, steps: int) -> dict:
    """Where the compute stream (the one with the most kernel time) waits, per step: its gaps between
    consecutive kernels, copies on other streams or not, by size, and by the operator that launched
    the kernel after each gap (what the stream was waiting to start)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    launches, _ = host_stacks(events)
    by_stream: dict[object, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK:
            by_stream.setdefault((e.get("args") or {}).get("stream", e.get("tid")), []).append(e)
    if not by_stream:
        return {}
    stream = max(by_stream, key=lambda k: sum(float(e.get("dur", 0)) for e in by_stream[k] if e["cat"] == "kernel"))
    items = sorted(by_stream[stream], key=lambda e: float(e["ts"]))
    # When the host asked for each kernel: a gap the launch call ended after is the host's (the GPU
    # had nothing queued); one it ended before is the device's (the kernel waited on an event: a
    # copy, another stream).
    launched = {(e.get("args") or {}).get("correlation"): _span(e)[1]
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
                origin = " > ".join(f[:40] for f in launches.get(corr, ())[-3:]) or "?"
                by_next.setdefault(e.get("name", "")[:40] + " @ " + origin + " | after " + previous[:40], []).append(gap)
                at = launched.get(corr)
                whose["unknown" if at is None else "host (launched late)" if at > end else "device (queued, waiting)"] += gap
        end = max(end or 0.0, _span(e)[1])
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
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    spans = sorted(_span(e) for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_WORK)
    labels = [(*_span(e), e["name"]) for e in events
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
