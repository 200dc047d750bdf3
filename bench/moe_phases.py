"""The phases of Studio's mixture-of-experts block (studio/engine/fast/moe.py) as bench/moe_layer_profile.py
finds them in a torch.profiler trace, and the bytes and FLOPs each phase has to move and compute.

A training step runs the block three times: the forward (under checkpointing: nothing saved), its
recomputation inside the backward, and the backward. Each profiled event is put in one of those
passes by where it sits: under a ``moe.block`` range (the profile script opens one around each call
of the engine's ``SparseMlp``) with an autograd ``evaluate_function`` above it: the recomputation;
without one: the forward; under an ``evaluate_function`` only: the backward. The experts' adapters,
rebuilt each step before the checkpointed block (a ``moe.adapters`` range), count in the forward.

The phases follow the engine's code. While a profile runs, :func:`phase_ranges` wraps the engine's
own methods (in this process only; nothing in studio/ changes) in ``record_function`` ranges:
``SparseMlp.route`` (router and top-k), ``SparseMlp.sort`` (the sort by expert), ``SparseMlp.activated`` (the activation times the routing
weight: engine/fast/expert_activation.py's kernel, or torch's operations), ``ExpertProduct``'s forward and
backward (one projection: gate/up or down), inside them ``ExpertWeights.stacked`` (the dequantization
of every expert's weight into the workspace) and ``Groups.mm`` / ``Groups.outer`` (the grouped
products: the frozen weight's, or the LoRA terms'). The rest of ``SparseMlp.__call__`` is inline
code, put in a phase by where it runs: before the gate/up product the rest of the routing (the
logged counts, the rows from the order, where each copy sits) and the permutation
(engine/fast/expert_copies.py's ``Gather`` s: ``x2[rows]`` the big one, :data:`GATHERS`); between
the two products nothing (gpt-oss' gate/up bias is added inside ``SparseMlp.activated``); after
the down product the combine (``Combine``: each token's copies summed by expert_copies.py's kernel,
or torch's ``index_add_``, with gpt-oss' down bias times the routing weight in the same sum). The
recomputation runs neither down's product nor the combine where nothing reads its value (moe.py's
``read``). The backward's inline work is named by its autograd node (``CombineBackward`` is the
combine's, ``GatherBackward`` the permutation's sum of each token's copies' gradients, and so on:
:data:`BACKWARD_NODES`).

On CUDA a kernel is linked to the innermost operator that launched it, and a Triton launch is no
operator: a Triton kernel rides on the operator around it, never on the ranges between (an
``ExpertProduct``'s dequantization kernel on the autograd Function's own record, outside its
``moe.dequant`` range). The kernels an ``ExpertProduct`` record (forward or backward) launches
itself are the dequantization of its projection's experts (:func:`wrapper_phase`); elsewhere a
Triton kernel sits inside a Function of its own (the activation's), whose record is in its phase's
range (forward) or is its phase's autograd node (backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PASSES = ("forward", "recompute", "backward", "outside")
"""Where an event runs (``outside``: the bench's own glue, around the block)."""

PHASES = ("adapters", "router", "sort", "permute", "dequant.gate_up", "products.gate_up", "lora.gate_up",
          "activation", "dequant.down", "products.down", "lora.down", "combine", "other")
"""The block's phases in the order the forward runs them."""

BLOCK = "moe.block"
ADAPTERS = "moe.adapters"
EVALUATE = "autograd::engine::evaluate_function: "
LABELS = {"moe.route": "router", "moe.sort": "sort", "moe.activation": "activation", ADAPTERS: "adapters"}
"""Ranges that name a phase by themselves."""
PROJECTIONS = ("moe.gate_up", "moe.down")
INNER = {"moe.dequant": "dequant", "moe.mm.base": "products", "moe.mm.lora": "lora"}
"""Ranges inside a projection's: the phase is this, dot the projection. Elsewhere inside a
projection, the LoRA terms' in-place additions (``aten::add_``) are ``lora``, the rest ``products``."""

BACKWARD_NODES = {
    "combine": ("CombineBackward", "IndexAddBackward"),
    "permute": ("GatherBackward", "IndexBackward"),
    "activation": ("RoutedActivationBackward", "MulBackward", "SiluBackward", "SigmoidBackward", "ClampBackward", "ClampMaxBackward",
                   "ClampMinBackward", "SplitBackward", "SliceBackward", "AddBackward", "SubBackward", "NegBackward"),
    "router": ("TopkBackward", "SoftmaxBackward", "DivBackward", "SumBackward", "MmBackward", "AddmmBackward",
               "LinearBackward", "TBackward"),
}
"""The backward's autograd nodes outside the labelled ranges, by phase (prefixes of the node's name);
any other node (views, casts, gradient accumulation) is ``other``."""

GATHERS = ("Gather", "aten::index", "aten::index_select")
"""What moves rows into expert order before the products (expert_copies.py's ``Gather`` and the
indexing inside it): the permutation; the rest of that code is the sort's."""

SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""Events that make the host wait for the device (``.item()``, ``.tolist()``, synchronizations)."""


def pass_of(stack: list[str]) -> str:
    """The pass an event runs in, from its ranges and operators innermost first (:data:`PASSES`);
    the experts' adapters, built before the checkpointed block, count in the forward."""
    if ADAPTERS in stack:
        return "forward"
    if BLOCK in stack:
        at = stack.index(BLOCK)
        return "recompute" if any(n.startswith(EVALUATE) for n in stack[at + 1:]) else "forward"
    return "backward" if any(n.startswith(EVALUATE) for n in stack) else "outside"


def phase_of(stack: list[str], region: str | None = None) -> str:
    """The phase of an event (:data:`PHASES`), from its ranges and operators innermost first.
    ``region``: where an unlabelled event of a forward or recomputation runs, relative to the
    products (:func:`region_of`): ``dispatch``, ``between`` or ``combine``."""
    inner = None
    for name in stack:
        if name in LABELS:
            return LABELS[name]
        if name in INNER and inner is None:
            inner = INNER[name]
        elif name in PROJECTIONS:
            return f"{inner or ('lora' if 'aten::add_' in stack else 'products')}.{name.removeprefix('moe.')}"
        elif name == BLOCK:
            if region == "dispatch":
                return "permute" if any(n in GATHERS for n in stack) else "sort"
            return {"between": "activation", "combine": "combine"}.get(region or "", "other")
        elif name.startswith(EVALUATE):
            node = name.removeprefix(EVALUATE)
            for phase, prefixes in BACKWARD_NODES.items():
                if node.startswith(prefixes):
                    return phase
            return "other"
    return "other"


def region_of(start: float, gate_up: tuple[float, float] | None, down: tuple[float, float] | None) -> str:
    """Where an unlabelled forward event starting at ``start`` runs: before gate/up's product
    (``dispatch``), after down's (``combine``), or between them; ``gate_up`` and ``down`` are the
    (start, end) of that block call's projection ranges."""
    if gate_up is not None and start < gate_up[0]:
        return "dispatch"
    if down is not None and start >= down[1]:
        return "combine"
    return "between"


def stack_of(event) -> list[str]:
    """A profiler FunctionEvent's name and its parents', innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


WRAPPERS = ("ExpertProduct", "ExpertProductBackward")
"""The autograd Function's own records around the projection ranges (its work is theirs)."""


def wrapper_phase(event) -> str | None:
    """The phase of the kernels an ``ExpertProduct`` record (:data:`WRAPPERS`) launched itself: the
    dequantization of the projection whose range it holds (Triton's NF4 or MXFP4 kernel, which no
    operator of the range owns); None for any other event."""
    if event.name not in WRAPPERS:
        return None
    for child in getattr(event, "cpu_children", ()):
        if child.name in PROJECTIONS:
            return f"dequant.{child.name.removeprefix('moe.')}"
    return None


def own_time_us(event, cuda: bool) -> float:
    """The device time an event accounts for itself (us): on CUDA its kernels' (not the span a
    range's GPU-side annotation of the same name draws), on the CPU its operator's self time."""
    if cuda:
        return sum(k.duration for k in event.kernels if k.name != event.name)
    return 0.0 if event.is_user_annotation or event.name in WRAPPERS else float(event.self_cpu_time_total)


def _block_spans(events) -> dict[int, dict[str, tuple[float, float]]]:
    """Each ``moe.block`` event's (by id) first gate/up and down projection ranges (start, end)."""
    spans: dict[int, dict[str, tuple[float, float]]] = {}
    for event in events:
        if event.name not in PROJECTIONS:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != BLOCK:
            parent = parent.cpu_parent
        if parent is not None:
            spans.setdefault(id(parent), {}).setdefault(event.name, (event.time_range.start, event.time_range.end))
    return spans


def attribute(events, cuda: bool, steps: int) -> dict:
    """The profiled steps' device time by pass and phase, per step: ``{pass: {phase: {"ms",
    "kernels"}}}`` (kernels: launches, CUDA only); the labelled ranges' calls per step by pass and
    phase (``dequant.gate_up``: one dequantization of every expert of gate/up; ``moe.gate_up``: one
    ExpertProduct forward or backward); the host waits (:data:`SYNCS`) by pass; the top kernels
    (each with the passes and phases it ran in); on CUDA the device time no operator launched as far as the profiler linked it
    (``unattributed_ms``: a kernel it could not link is missing from the phases, not hidden)."""
    from torch.autograd import DeviceType

    ranges = {BLOCK, *LABELS, *PROJECTIONS, *INNER}
    # every kernel, copy and memset the device ran, linked to a launching operator or not
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU and not e.is_user_annotation and e.name not in ranges:
            kernels.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    events = [e for e in events if e.device_type == DeviceType.CPU]  # kernels ride on their launching operator
    spans = _block_spans(events)
    table = {p: {} for p in PASSES}
    calls = {p: {} for p in PASSES}
    syncs = dict.fromkeys(PASSES, 0)
    phases_of: dict[str, set[str]] = {}
    for event in events:
        stack = stack_of(event)
        where = pass_of(stack)
        if event.name in (*LABELS, *PROJECTIONS, *INNER):
            key = event.name if event.name in PROJECTIONS else phase_of(stack)
            calls[where][key] = calls[where].get(key, 0) + 1
        if event.name in SYNCS or "Synchronize" in event.name:
            syncs[where] += 1
        spent = own_time_us(event, cuda)
        if spent <= 0:
            continue
        region = None
        if where in ("forward", "recompute"):
            block = event
            while block is not None and block.name != BLOCK:
                block = block.cpu_parent
            found = spans.get(id(block), {})
            region = region_of(event.time_range.start, found.get("moe.gate_up"), found.get("moe.down"))
        phase = wrapper_phase(event) or phase_of(stack, region) if where != "outside" else "other"
        row = table[where].setdefault(phase, {"ms": 0.0, "kernels": 0})
        row["ms"] += spent / 1e3 / steps
        if cuda:
            own = [k for k in event.kernels if k.name != event.name]
            row["kernels"] += len(own) / steps
            for k in own:
                phases_of.setdefault(k.name, set()).add(f"{where}:{phase}")
    ordered = {p: {ph: {"ms": round(v["ms"], 4), "kernels": round(v["kernels"], 1)}
                   for ph in PHASES if (v := table[p].get(ph))} for p in PASSES}
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:20]
    attributed = sum(v["ms"] for rows in table.values() for v in rows.values())
    device_ms = sum(sum(d) for d in kernels.values()) / 1e3 / steps
    return {"by_pass": {p: v for p, v in ordered.items() if v},
            "unattributed_ms": round(device_ms - attributed, 4) if cuda else None,
            "calls_per_step": {p: {n: c / steps for n, c in v.items()} for p, v in calls.items() if v},
            "host_syncs_per_step": {p: n / steps for p, n in syncs.items() if n},
            "top_kernels": [{"name": name[:90], "calls_per_step": len(d) / steps,
                             "ms_per_step": round(sum(d) / 1e3 / steps, 4),
                             "where": sorted(phases_of.get(name, {"unlinked"}))} for name, d in top]}


@contextlib.contextmanager
def phase_ranges(gate_up_weights: object, down_weights: object) -> Iterator[None]:
    """The engine's MoE methods wrapped in :data:`LABELS`, :data:`PROJECTIONS` and :data:`INNER`
    ranges while open (class attributes, put back on exit); ``gate_up_weights`` and ``down_weights``
    are the block's two ``ExpertWeights``, which name a product's projection."""
    from torch.profiler import record_function

    from studio.engine.fast import moe

    names = {id(gate_up_weights): "moe.gate_up", id(down_weights): "moe.down"}
    stacked_ptr: list[int] = [0]  # the data the last dequantization wrote: a product reading it is the base's

    def ranged(label: str | Callable[..., str], fn: Callable) -> Callable:
        def run(*args, **kwargs):
            with record_function(label(*args) if callable(label) else label):
                return fn(*args, **kwargs)
        return run

    def stacked(fn: Callable) -> Callable:
        def run(self, *args):  # (part: gate/up is read in halves)
            with record_function("moe.dequant"):
                out = fn(self, *args)
            stacked_ptr[0] = out.data_ptr()
            return out
        return run

    def product_label(_self, _x, w) -> str:
        return "moe.mm.base" if w.data_ptr() == stacked_ptr[0] else "moe.mm.lora"

    originals = {
        (moe.SparseMlp, "route"): moe.SparseMlp.route,
        (moe.SparseMlp, "sort"): moe.SparseMlp.sort,
        (moe.SparseMlp, "activated"): moe.SparseMlp.activated,
        (moe.ExpertWeights, "stacked"): moe.ExpertWeights.stacked,
        (moe.Groups, "mm"): moe.Groups.mm,
        (moe.Groups, "outer"): moe.Groups.outer,
        (moe.ExpertProduct, "forward"): moe.ExpertProduct.forward,
        (moe.ExpertProduct, "backward"): moe.ExpertProduct.backward,
    }
    wrapped = {
        (moe.SparseMlp, "route"): ranged("moe.route", moe.SparseMlp.route),
        (moe.SparseMlp, "sort"): ranged("moe.sort", moe.SparseMlp.sort),
        (moe.SparseMlp, "activated"): ranged("moe.activation", moe.SparseMlp.activated),
        (moe.ExpertWeights, "stacked"): stacked(moe.ExpertWeights.stacked),
        (moe.Groups, "mm"): ranged(product_label, moe.Groups.mm),
        (moe.Groups, "outer"): ranged("moe.mm.lora", moe.Groups.outer),
        (moe.ExpertProduct, "forward"): staticmethod(ranged(lambda _ctx, _x, w, *_: names.get(id(w), "moe.gate_up"),
                                                            moe.ExpertProduct.forward)),
        (moe.ExpertProduct, "backward"): staticmethod(ranged(lambda ctx, *_: names.get(id(ctx.weights), "moe.gate_up"),
                                                             moe.ExpertProduct.backward)),
    }
    try:
        for (cls, name), fn in wrapped.items():
            setattr(cls, name, fn)
        yield
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, staticmethod(fn) if cls is moe.ExpertProduct else fn)


@dataclass(frozen=True)
class Dims:
    """One sparse layer's sizes and storage, as the traffic model reads them."""

    tokens: int
    hidden: int
    width: int
    """One expert's gate (and up) width."""
    experts: int
    top_k: int
    active: int
    """Experts that got at least one token (the routing's, measured)."""
    value_bytes: int
    """Bytes of one value in the compute dtype."""
    stored: dict
    """Bytes each projection's stored experts take (``gate_up``, ``down``: packed values and scales)."""
    rank: int = 0
    """The experts' LoRA rank (0: no adapter on them)."""
    bias: bool = False
    """The experts add biases (gpt-oss)."""

    def geometry(self) -> dict[str, tuple[int, int]]:
        """Each projection's (in, out) features."""
        return {"gate_up": (self.hidden, 2 * self.width), "down": (self.width, self.hidden)}


def traffic(d: Dims) -> dict[str, dict[str, dict[str, float]]]:
    """The least each phase must move and compute as the engine structures it, for one forward
    (the recomputation is the same) and one backward: ``{pass: {phase: {"bytes", "flops"}}}``.
    Every phase reads its inputs and writes its outputs once; a product reads the weights of the
    experts with tokens once. Indices are int64."""
    t, h, i, e, b, r = d.tokens, d.hidden, d.width, d.experts, d.value_bytes, d.rank
    rows = t * d.top_k
    fwd: dict[str, dict[str, float]] = {
        # the router's product, the logits, the fp32 softmax, the top-k values and indices
        "router": {"bytes": t * h * b + e * h * b + t * e * (2 * b + 8) + rows * (4 + 8) * 2,
                   "flops": 2.0 * t * h * e},
        # the one-byte keys, their sort, the offsets, rows = order // k, the logged counts: a few passes over the indices
        "sort": {"bytes": rows * 8 * 8, "flops": 0.0},
        # x2[rows] and the routing weights in sorted order (and where each copy sits, int32)
        "permute": {"bytes": 2 * rows * h * b + rows * (8 + 2 * b + 3 * 4), "flops": 0.0},
        # gate/up's output in, the activation times the routing weight out (and the biases' gathers)
        "activation": {"bytes": rows * (2 * i + i + 1) * b + (3 * rows * 2 * i * b if d.bias else 0),
                       "flops": 5.0 * rows * i},
        # each token's copies' rows read by where they sit (int32), its sum written once
        "combine": {"bytes": rows * h * b + t * h * b + rows * 4, "flops": float(rows * h)},
    }
    bwd: dict[str, dict[str, float]] = {
        "combine": {"bytes": 2 * rows * h * b + rows * 8, "flops": 0.0},
        "activation": {"bytes": rows * (i + 2 * i + 2 * i + 2) * b, "flops": 8.0 * rows * i},
        # each token's copies' gradients summed into its own, the routing weights' gathered back
        "permute": {"bytes": rows * h * b + t * h * b + rows * (4 + 2 * b) * 2, "flops": float(rows * h)},
        "router": {"bytes": t * e * (2 * b + 8) + e * h * b + t * h * b, "flops": 2.0 * t * h * e},
    }
    for name, (fin, fout) in d.geometry().items():
        weights = d.active * fin * fout * b
        dequant = {"bytes": d.stored[name] + e * fin * fout * b, "flops": 0.0}
        fwd[f"dequant.{name}"] = dict(dequant)
        bwd[f"dequant.{name}"] = dict(dequant)
        fwd[f"products.{name}"] = {"bytes": rows * (fin + fout) * b + weights, "flops": 2.0 * rows * fin * fout}
        bwd[f"products.{name}"] = {"bytes": rows * (fin + fout) * b + weights, "flops": 2.0 * rows * fin * fout}
        if r:
            a_bytes, b_bytes = e * r * fin * b, e * fout * r * b
            # x @ A, (x A) @ B, added into the output
            fwd[f"lora.{name}"] = {"bytes": rows * (fin + 2 * r + 4 * fout) * b + a_bytes + b_bytes,
                                   "flops": 2.0 * rows * r * (fin + fout) + rows * fout}
            # dy @ B, (dy B) @ A added into dx, and the two weight gradients
            bwd[f"lora.{name}"] = {"bytes": rows * (2 * fout + 4 * r + 4 * fin) * b + 2 * (a_bytes + b_bytes),
                                   "flops": 4.0 * rows * r * (fin + fout)}
    return {"forward": fwd, "backward": bwd}


def ideal(d: Dims, flops_peak: float, bytes_peak: float) -> dict:
    """What a step of the block could take at the GPU's peaks (``flops_peak`` FLOP/s,
    ``bytes_peak`` B/s): the experts with tokens' stored weights read once and their FLOPs (the
    forward, its recomputation and the backward's input gradients, LoRA terms included), the slower
    of the two; and the floor of the engine's structure with each pass's dequantization fused into
    its products (each pass reads the stored weights once, the other phases move what
    :func:`traffic` says)."""
    moved = traffic(d)
    flops = sum(2 * v["flops"] for v in moved["forward"].values()) + sum(v["flops"] for v in moved["backward"].values())
    stored_once = sum(d.stored.values()) * d.active / d.experts
    other = sum(2 * v["bytes"] for k, v in moved["forward"].items() if not k.startswith(("dequant", "products")))
    other += sum(v["bytes"] for k, v in moved["backward"].items() if not k.startswith(("dequant", "products")))
    rows = d.tokens * d.top_k
    product_io = sum(rows * (fin + fout) * d.value_bytes for fin, fout in d.geometry().values())
    fused_bytes = 3 * (stored_once + product_io) + other
    return {"flops_per_step": flops, "stored_bytes_once": stored_once,
            "flops_ms": flops / flops_peak * 1e3, "stored_once_ms": stored_once / bytes_peak * 1e3,
            "ideal_ms": max(flops / flops_peak, stored_once / bytes_peak) * 1e3,
            "fused_floor_bytes": fused_bytes,
            "fused_floor_ms": max(flops / flops_peak, fused_bytes / bytes_peak) * 1e3}
