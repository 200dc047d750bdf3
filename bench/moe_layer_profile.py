"""Where one mixture-of-experts layer's training time goes on the fast path (issue 42), phase by phase,
against what the bytes and FLOPs allow and against transformers' own layer.

One sparse layer of a real shape (bench/moe_shapes.py: Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B,
OLMoE-1B-7B) is built alone (a one-layer model of that shape, a 1,024-id vocabulary: the layer's
cost does not depend on it) with random weights (normal, std 0.02), its experts stored as the engine
stores them: NF4 with double-quantized scales by engine/quantized_experts.py's ``quantize_experts``,
or, for gpt-oss (``--storage auto``), random MXFP4 blocks kept by engine/mxfp4.py's ``attach``, as
the checkpoint ships them. PEFT's LoRA (r ``--rank``, alpha 2r, adapters in fp32 as Studio trains
them) on the attention projections, and in the ``experts`` variant on the experts too (PEFT's
``target_parameters``); engine/fast/build.py's ``prepare`` builds the fast layer. Each variant measures:

- ``engine_block``: the engine's MoE block (``SparseMlp``) on ``--tokens`` tokens of a normed
  stream that needs its gradient, as a training step runs it: the adapters built outside the
  checkpoint, the block under ``torch.utils.checkpoint`` (the forward saves nothing but its routing;
  the backward recomputes the rest, down's product and the combine excepted), then the backward. CUDA events time the step, the forward alone (the backward and
  its recomputation are the difference); peak memory of a step above what was allocated before
  it. torch.profiler splits ``--profile-steps`` eager steps by pass (forward,
  recompute, backward) and phase (bench/moe_phases.py: router and top-k, the sort by expert, the
  permutation, each projection's dequantization of every expert, its grouped products and LoRA
  terms, the activation, the combine), with each phase's kernels, calls per step and host waits.
  Beside each phase: the bytes and FLOPs it must move (bench/moe_phases.py's ``traffic``), so the
  achieved GB/s and TFLOP/s; the dequantization's bytes per step, all experts against only those
  with tokens; and the ideal step (the stored 4-bit weights read once, the FLOPs of the experts with
  tokens at the GPU's peak) and the floor of the engine's structure with dequantization fused.
  On CUDA, ``engine_block.graphed``: the same step captured as a CUDA graph (no host cost: the eager
  step's excess over it is the host's).
- ``engine_block_skewed``: the block on a stream whose routing leaves experts without tokens, as the
  one-layer model's own stream does (``skewed_block``): the grouped products against the per-expert
  loop on the same rows, the routing, the step's time.
- ``engine_layer``: the whole one-layer model's training step through ``FastModel.loss`` and its
  backward (attention, embedding, the head included), ``eager`` and, on CUDA, ``graphed`` with the
  CUDA graphs a run captures: what share of a layer's step the MoE block is; the routing of its
  last forward.
- ``hf_block``: the same block through transformers' own module (bf16 experts, transformers'
  experts implementation, bf16 autocast: the HF loop's path), checkpointed the same way: time,
  memory, and its kernels by pass; ``hf_layer``: the one-layer model's step through transformers'
  forward with gradient checkpointing (the HF loop's step, its attention in bf16 here).

Each section builds its model anew. On the GPU the sections run in child processes
(bench/isolated.py), a model's variant in one: a CUDA fault (an illegal memory access is sticky, and
it aborts the process at the latest when tensors are freed) is recorded as that section's error,
with how its process ended and its last stderr, and the sections after it run in a fresh process;
``--launch-blocking SECTION`` runs a section alone with ``CUDA_LAUNCH_BLOCKING=1``, so that its
traceback names the operation that faulted, not the next one that waited for the GPU. The JSON (``--out``) holds the command, commit, GPU, versions, the peaks
used (the GPU's datasheet and measured: a bf16 matmul and a copy), and each model and variant; it is
written after every section. ``--tiny`` runs the whole pipeline on the CPU on each family's tiny
shape, in one process (fp32; the timings there only prove the path).

    # the GPU box, from the repository root: Qwen3-30B-A3B's layer, both variants (about two minutes)
    python3 bench/moe_layer_profile.py --commit <sha> --out $OUT/moe_layer_profile_qwen3.json
    # where a section failed: the sections in question alone, that one with each launch waited for
    python3 bench/moe_layer_profile.py --variants attn --only engine_block_skewed,engine_layer_eager
        --launch-blocking engine_layer_eager --commit <sha> --out $OUT/moe_layer_diag.json  # (one line)
    # every model, as far as the budget goes (about 4 minutes)
    python3 bench/moe_layer_profile.py --model all --budget-s 480 --commit <sha> --out $OUT/moe_layer_profile.json
    # here, on the CPU
    python3 bench/moe_layer_profile.py --tiny --model all --tokens 64 --out /tmp/moe_layer_profile.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.families import _commit, _versions  # noqa: E402
from bench.make_random_model import hf_config  # noqa: E402
from bench.moe_phases import ADAPTERS, BLOCK, PASSES, PHASES, Dims, attribute, ideal, phase_ranges, traffic  # noqa: E402
from bench.moe_shapes import MOE_MODELS, layer_subset, tiny  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VARIANTS = {"attn": False, "experts": True}
"""Variant -> whether the experts get LoRA adapters too (the attention projections always do)."""
VOCAB = 1024
INIT_STD = 0.02
MXFP4_EXPONENT = -7
"""Random MXFP4 weights' block scale (2^-7): FP4 codes drawn uniformly then have a std of about
0.023, the normal init's 0.02."""

SPECS = (("H200", 989e12, 4.8e12), ("H100 NVL", 835e12, 3.9e12), ("H100 PCIe", 756e12, 2.0e12),
         ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12))
"""Datasheet bf16 dense tensor-core FLOP/s and memory bytes/s by a name the device's contains,
most specific first (NVIDIA's H200, H100 SXM / NVL / PCIe and A100 80 GB SXM sheets)."""


# ---------------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object], cuda: bool, loops: int, repeats: int) -> dict:
    """Milliseconds a call of ``fn`` takes after one untimed call: CUDA events around ``repeats``
    loops of ``loops`` calls (the host clock on the CPU); the median and the fastest loop."""
    from bench.gpu_timing import loop_ms

    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            times.append(loop_ms(fn, loops))
        else:
            start = time.perf_counter()
            for _ in range(loops):
                fn()
            times.append((time.perf_counter() - start) * 1e3 / loops)
    return {"median_ms": round(statistics.median(times), 4), "min_ms": round(min(times), 4)}


def step_peak_mib(step: Callable[[], object], cuda: bool) -> float | None:
    """MiB a call of ``step`` allocates at its peak above what was allocated before it (CUDA only)."""
    import torch

    if not cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def peaks(cuda: bool) -> dict:
    """The GPU's peak bf16 FLOP/s and memory bytes/s: its datasheet's where the name is known, and
    measured here (an 8192^3 bf16 product; a 1 GiB copy, read and write counted); ``used`` is the
    datasheet's where there is one. On the CPU, measured on small sizes (the tiny run only)."""
    import torch

    device = "cuda" if cuda else "cpu"
    n, copy_bytes = (8192, 2**30) if cuda else (512, 2**26)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    loops = 10 if cuda else 2
    mm = timed(lambda: a @ a, cuda, loops, 3)["min_ms"]
    copy = timed(lambda: dst.copy_(src), cuda, loops, 3)["min_ms"]
    measured = {"flops": 2 * n**3 / (mm / 1e3), "bytes": 2 * copy_bytes / (copy / 1e3)}
    name = torch.cuda.get_device_name() if cuda else "cpu"
    spec = next(({"name": key, "flops": f, "bytes": b} for key, f, b in SPECS if key in name), None)
    used = spec or measured
    return {"device": name, "spec": spec, "measured": {k: round(v / 1e12, 3) for k, v in measured.items()},
            "used": {"flops": used["flops"], "bytes": used["bytes"], "from": "spec" if spec else "measured"},
            "units": "measured: TFLOP/s and TB/s; used: FLOP/s and B/s"}


def free(cuda: bool) -> None:
    """Between sections in one process: what the last one left in reference cycles (a CUDA graph
    and its private pool, a PEFT model) collected, and the allocator's cache given back."""
    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- build


def storage_for(name: str, asked: str) -> str:
    """How a model's experts are stored: ``asked``, or with ``auto`` MXFP4 for gpt-oss (as it
    ships) and NF4 for the rest. SystemExit for MXFP4 asked of a model that does not ship it."""
    gpt_oss = MOE_MODELS[name]["model_type"] == "gpt_oss"
    if asked == "auto":
        return "mxfp4" if gpt_oss else "nf4"
    if asked == "mxfp4" and not gpt_oss:
        raise SystemExit(f"--storage mxfp4: {name} does not ship MXFP4 experts (only gpt-oss-20b does); "
                         "use --storage nf4 or auto")
    return asked


def build(name: str, is_tiny: bool, storage: str, expert_lora: bool, rank: int, device: str, dtype, seed: int = 0):
    """A one-layer PEFT model of ``name``'s shape (its tiny one with ``is_tiny``), random weights,
    the experts stored as ``storage`` says (``nf4``, ``mxfp4``, or ``bf16``: left as built), LoRA on
    the attention and, with ``expert_lora``, on the experts; frozen base, fp32 adapters (as Studio's
    engine/model.py attaches them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from studio.engine.mxfp4 import BLOCK as MX_BLOCK
    from studio.engine.mxfp4 import SCALE_BIAS, attach
    from studio.engine.quantized_experts import quantize_experts

    shape = tiny(MOE_MODELS[name]) if is_tiny else MOE_MODELS[name]
    shape = dict(layer_subset(shape, 1), vocab_size=VOCAB)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=dtype)
    mlp = model.model.layers[0].mlp
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0.0, INIT_STD, generator=gen)
    if storage == "nf4":
        assert quantize_experts(model, "nf4", double_quant=True) == 1
    elif storage == "mxfp4":
        experts = mlp.experts
        tensors = {}
        for pname in ("gate_up_proj", "down_proj"):
            e, fin, fout = getattr(experts, pname).shape  # gpt-oss stores [experts, in, out]
            blocks = torch.randint(0, 256, (e, fout, fin // MX_BLOCK, MX_BLOCK // 2), generator=gen,
                                   device=device, dtype=torch.uint8)
            scales = torch.full((e, fout, fin // MX_BLOCK), SCALE_BIAS + MXFP4_EXPONENT, device=device,
                                dtype=torch.uint8)
            tensors[pname] = (blocks, scales)
        attach(experts, tensors)
    for param in model.parameters():
        param.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=ATTENTION, bias="none", task_type="CAUSAL_LM",
                                             target_parameters=EXPERTS if expert_lora else None))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


def dims_of(fm, tokens: int, active: int) -> Dims:
    """The traffic model's sizes of the fast model's first (sparse) layer on ``tokens`` tokens, of
    which ``active`` experts got some."""
    layer = fm.layers[0]
    spec, gate_up, down = layer.moe.spec, layer.gate_up.weights, layer.down.weights
    rank = int(layer.gate_up.a[0].shape[0]) // spec.experts if layer.gate_up.a else 0
    return Dims(tokens=tokens, hidden=gate_up.in_features, width=spec.intermediate, experts=spec.experts,
                top_k=spec.top_k, active=active, value_bytes=gate_up.dtype.itemsize,
                stored={"gate_up": gate_up.packed.nbytes(), "down": down.packed.nbytes()}, rank=rank,
                bias=spec.expert_bias)


# ------------------------------------------------------------------------------------- the block


def _block(mlp, x, gate_up, down, routing, read):
    from torch.profiler import record_function

    with record_function(BLOCK):
        return mlp(x, gate_up, down, routing, read)


def run_block(layer, x):
    """The engine's MoE block on the normed stream ``x`` as the stack runs a layer: the experts'
    adapters built outside the checkpoint, the block checkpointed, its routing kept for the
    recomputation, whose value only the layer's post-norm (none in these families) would read."""
    from torch.profiler import record_function
    from torch.utils.checkpoint import checkpoint

    from studio.engine.fast.routing import KeptRouting

    with record_function(ADAPTERS):
        gate_up, down = layer.gate_up.adapters(), layer.down.adapters()
    read = not layer._fused_residual(layer.mlp_out)
    return checkpoint(_block, layer.moe, x, gate_up, down, KeptRouting(), read, use_reentrant=False,
                      preserve_rng_state=False)


def routing(fm) -> dict:
    """The last forward's token copies per expert (the router log's first layer)."""
    counts = fm.router.counts[0].tolist()
    used = [c for c in counts if c]
    return {"experts": len(counts), "experts_with_tokens": len(used), "rows": sum(counts),
            "rows_per_expert": {"min": min(counts), "max": max(counts), "mean": round(sum(counts) / len(counts), 1)}}


def engine_block(fm, tokens: int, args, cuda: bool, used_peaks: dict) -> dict:
    """The engine's MoE block: eager step and forward times, step memory, the profile by pass and
    phase, the traffic model and the ideal (the module docstring)."""
    import torch

    layer = fm.layers[0]
    mlp = layer.moe
    device = mlp.router.device
    dtype = layer.gate_up.weights.dtype
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, tokens, layer.gate_up.weights.in_features, generator=gen, device=device, dtype=dtype)
    x.requires_grad_(True)
    grad = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
    fm.router.begin(tokens)

    def step():
        x.grad = None
        run_block(layer, x).backward(grad)

    def forward():
        run_block(layer, x)

    for _ in range(args.warmup):
        step()
    out: dict = {"eager": {"step": timed(step, cuda, args.loops, args.repeats),
                           "forward": timed(forward, cuda, args.loops, args.repeats),
                           "step_peak_mib": step_peak_mib(step, cuda)}}
    eager = out["eager"]
    eager["backward_with_recompute_ms"] = round(eager["step"]["median_ms"] - eager["forward"]["median_ms"], 4)
    out["routing"] = routing(fm)
    weights = (layer.gate_up.weights, layer.down.weights)
    out["storage"] = {"stored_bytes": {n: w.packed.nbytes() for n, w in zip(("gate_up", "down"), weights, strict=True)},
                      "dequantized_bytes": {n: w.experts * w.in_features * w.out_features * x.element_size()
                                            for n, w in zip(("gate_up", "down"), weights, strict=True)},
                      "format": type(weights[0].packed).__name__, "nf4_kernel": weights[0].kernel is not None,
                      "workspace_bytes": weights[0].workspace.numel * x.element_size(),
                      "grouped_kernel": mlp_kernel_name()}
    if "profile" not in args.skip:
        out["profile"] = profile_block(step, mlp, cuda, args.profile_steps)
    d = dims_of(fm, tokens, out["routing"]["experts_with_tokens"])
    out["model"] = model_figures(d, out.get("profile"), used_peaks, eager["step"]["median_ms"])
    return out


def mlp_kernel_name() -> str:
    """Which grouped product the engine's moe.py calls (torch's, by name), or none."""
    from studio.engine.fast import moe

    kernel = moe._KERNEL
    return f"{kernel.__module__}.{kernel.__name__}" if kernel is not None else "none: a loop over experts"


def profile_block(step: Callable[[], object], mlp, cuda: bool, steps: int) -> dict:
    """``steps`` eager steps under torch.profiler with the engine's methods in phase ranges:
    bench/moe_phases.py's ``attribute``, and each phase's totals over the passes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with phase_ranges(mlp.gate_up.weights, mlp.down.weights):
        step()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            if cuda:
                torch.cuda.synchronize()
    found = attribute(prof.events(), cuda, steps)
    by_phase = {}
    for phase in PHASES:
        row = {p: ms for p in PASSES if (ms := found["by_pass"].get(p, {}).get(phase, {}).get("ms"))}
        if row:
            row["total"] = round(sum(row.values()), 4)
            by_phase[phase] = row
    found["by_phase_ms"] = by_phase
    found["kernel_ms_per_step"] = round(sum(r["total"] for r in by_phase.values()), 4)
    found["measure"] = "CUDA kernel time" if cuda else "CPU operators' self time"
    return found


def model_figures(d: Dims, profile: dict | None, used_peaks: dict, step_ms: float) -> dict:
    """The traffic model beside the profile: each pass's phases' bytes and FLOPs and, where profiled,
    the achieved rates; the dequantization's bytes per step (every expert, as the engine does, and
    only those with tokens); the ideal step and the fused floor."""
    moved = traffic(d)
    per_pass = {}
    for where in ("forward", "recompute", "backward"):
        rows = {}
        for phase, figures in moved["backward" if where == "backward" else "forward"].items():
            row = {"mb": round(figures["bytes"] / 1e6, 3), "gflop": round(figures["flops"] / 1e9, 3)}
            ms = (profile or {}).get("by_pass", {}).get(where, {}).get(phase, {}).get("ms")
            if ms:
                row["ms"] = ms
                row["achieved_gb_s"] = round(figures["bytes"] / (ms / 1e3) / 1e9, 1)
                if figures["flops"]:
                    row["achieved_tflop_s"] = round(figures["flops"] / (ms / 1e3) / 1e12, 2)
            rows[phase] = row
        per_pass[where] = rows
    calls = (profile or {}).get("calls_per_step", {})
    dequant = {"experts_per_call": d.experts, "experts_with_tokens": d.active}
    written = 0.0
    for where in ("forward", "recompute", "backward"):
        for proj in ("gate_up", "down"):
            n = calls.get(where, {}).get(f"dequant.{proj}", 0)
            dequant[f"{where}.{proj}_calls"] = n
            written += n * moved["forward"][f"dequant.{proj}"]["bytes"]
    dequant["bytes_per_step"] = written
    dequant["bytes_per_step_active_only"] = written * d.active / d.experts
    best = ideal(d, used_peaks["flops"], used_peaks["bytes"])
    best["step_over_ideal"] = round(step_ms / best["ideal_ms"], 2) if best["ideal_ms"] else None
    best["step_over_fused_floor"] = round(step_ms / best["fused_floor_ms"], 2) if best["fused_floor_ms"] else None
    return {"dims": d.__dict__, "per_pass": per_pass, "dequantization": dequant, "ideal": best}


def graphed_block(fm, tokens: int, args) -> dict:
    """The block's step captured as a CUDA graph (``torch.cuda.make_graphed_callables`` around the
    same checkpointed call, the experts' adapters as the module's parameters), replayed and timed;
    the memory the capture reserved (its private pool) beside it."""
    import torch
    from torch import nn

    from studio.engine.fast.graphs import without_collection

    layer = fm.layers[0]
    dtype = layer.gate_up.weights.dtype
    x = torch.randn(1, tokens, layer.gate_up.weights.in_features, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    params = [*layer.gate_up.a, *layer.gate_up.b, *layer.down.a, *layer.down.b]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.adapters = nn.ParameterList(params)

        def forward(self, h):
            return run_block(layer, h)

    # make_graphed_callables warms up on a side stream and keeps that warm-up's autograd graph
    # alive through the capture, so the accumulators it made for x and the adapters belong to that
    # stream, and autograd warns once that a replay's gradient comes from another one (it syncs the
    # two: correct, as engine/fast/graphs.py says of the same warning). Each step below hands the
    # graph a fresh leaf over x's memory (no copy), whose accumulator is the default stream's.
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)
    fm.router.begin(tokens)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    with without_collection():
        graphed = torch.cuda.make_graphed_callables(Block(), (x,), num_warmup_iters=3)

    def step():
        graphed(x.detach().requires_grad_()).backward(grad)

    step()
    torch.cuda.synchronize()
    # The graphs and their private pool stay alive in reference cycles (make_graphed_callables'
    # autograd classes) until a garbage collection: the driver's, right after this section (free).
    return {"step": timed(step, True, args.loops, args.repeats),
            "capture_reserved_mib": round((torch.cuda.memory_reserved() - before) / 2**20, 1)}


SKEW_NOISE = 0.25
"""The per-token noise beside the shared direction of :func:`skewed_block`'s stream: the router
then sends most tokens to the same few experts and leaves others without any."""


def skewed_block(fm, tokens: int, args, cuda: bool) -> dict:
    """The engine's block on a stream whose routing leaves experts without tokens and gives a few of
    them most rows, as the one-layer model's own stream does (in a random one-layer model, the
    attention's output, an average over the earlier tokens, dominates the embeddings: this script's
    Qwen3-30B-A3B layer, in fp32 on the CPU, routes the 16,384 rows of 2,048 tokens to 126 of 128
    experts, up to 1,242 to one, where a random stream gives every expert 93-171). One shared direction plus
    :data:`SKEW_NOISE` of per-token noise. Its routing, its eager step's time, and the grouped
    products against the per-expert loop (``SparseMlp.loop``) on the same rows: the output's, the
    input gradient's and the expert adapters' gradients' largest differences."""
    import torch

    layer = fm.layers[0]
    mlp = layer.moe
    device = mlp.router.device
    dtype = layer.gate_up.weights.dtype
    gen = torch.Generator(device=device).manual_seed(3)
    hidden = layer.gate_up.weights.in_features
    shared = torch.randn(hidden, generator=gen, device=device)
    noise = torch.randn(1, tokens, hidden, generator=gen, device=device)
    x = (shared + SKEW_NOISE * noise).to(dtype).requires_grad_(True)
    grad = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
    params = [*layer.gate_up.a, *layer.gate_up.b, *layer.down.a, *layer.down.b]
    fm.router.begin(tokens)

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        out = run_block(layer, x)
        out.backward(grad)
        return out

    found = {}
    for loop in (False, True):  # the grouped products first: the ones in question
        mlp.loop = loop
        out = step()
        if cuda:
            torch.cuda.synchronize()
        found[loop] = [out.detach().float(), x.grad.float(), *(p.grad.float() for p in params)]
        if not loop:
            taken = routing(fm)
    mlp.loop = False

    def largest(tensors: list) -> float:
        return round(max(float(t.abs().max()) for t in tensors), 6) if tensors else 0.0

    compared = {}
    for key, picked in (("output", slice(0, 1)), ("input_grad", slice(1, 2)), ("adapter_grads", slice(2, None))):
        grouped, looped = found[False][picked], found[True][picked]
        if grouped:
            compared[f"{key}_max_abs_diff"] = largest([g - lp for g, lp in zip(grouped, looped, strict=True)])
            compared[f"{key}_max_abs"] = largest(looped)
    for _ in range(args.warmup):
        step()
    return {"noise": SKEW_NOISE, "routing": taken, "grouped_vs_loop": compared,
            "eager": {"step": timed(step, cuda, args.loops, args.repeats)}}


def layer_step(model, tokens: int, args, cuda: bool, graphed: bool, progress: dict) -> dict:
    """The one-layer model's training step (``FastModel.loss`` and its backward), eager or, on
    CUDA, with the CUDA graphs a run captures (``trainer.fast_path`` defaults otherwise), and the
    routing of its last forward; with ``--loop-experts`` the sparse layer takes the per-expert
    loop instead of the grouped products. ``progress`` counts the steps done (an error's record)."""
    import torch

    from studio.core.config import FastPathConfig
    from studio.engine import fast

    device = "cuda" if cuda else "cpu"
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(2)).to(device)
    fm, why = fast.prepare(model, FastPathConfig() if graphed else FastPathConfig(cuda_graphs=False))
    if fm is None:
        return {"error": f"the fast path refused the model: {why}"}
    if args.loop_experts:
        for layer in fm.layers:
            if layer.moe is not None:
                layer.moe.loop = True
    progress["steps_done"] = 0

    def step():
        fm.loss(ids, ids).backward()
        progress["steps_done"] += 1

    try:
        for _ in range(args.warmup):
            step()
        return {"step": timed(step, cuda, args.loops, args.repeats), "graphs_failed": fm.graphs_failed,
                "routing": routing(fm), "expert_products": "loop" if args.loop_experts else "grouped"}
    finally:
        fm.release_graphs()


# ------------------------------------------------------------------------------------ transformers


def hf_block(model, tokens: int, args, cuda: bool, dtype) -> dict:
    """transformers' own MoE block (bf16 experts) checkpointed, under bf16 autocast on CUDA, on a
    stream in the model's ``dtype``: step and forward times, step memory, and its profiled kernel
    time by pass with its top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.checkpoint import checkpoint

    base = model.get_base_model()
    block = base.model.layers[0].mlp
    device = "cuda" if cuda else "cpu"
    x = torch.randn(1, tokens, base.config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def run(h):
        with record_function(BLOCK):
            out = block(h)
        return out[0] if isinstance(out, tuple) else out

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            return checkpoint(run, x, use_reentrant=False)

    def step():
        x.grad = None
        forward().backward(grad)

    for _ in range(args.warmup):
        step()
    out: dict = {"experts_implementation": getattr(base.config, "_experts_implementation", None),
                 "step": timed(step, cuda, args.loops, args.repeats),
                 "forward": timed(forward, cuda, args.loops, args.repeats), "step_peak_mib": step_peak_mib(step, cuda),
                 "expert_bytes": sum(p.numel() * p.element_size() for n, p in block.named_parameters() if "experts" in n
                                     and "lora" not in n)}
    if "profile" not in args.skip:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        found = attribute(prof.events(), cuda, args.profile_steps)
        out["profile"] = {"by_pass_ms": {p: round(sum(v["ms"] for v in rows.values()), 4)
                                         for p, rows in found["by_pass"].items()},
                          "host_syncs_per_step": found["host_syncs_per_step"], "top_kernels": found["top_kernels"]}
    return out


def hf_layer(model, tokens: int, args, cuda: bool) -> dict:
    """The one-layer model's training step through transformers' forward (the HF loop's: gradient
    checkpointing, bf16 autocast on CUDA; its attention weights in bf16 here, NF4 in bench/moe.py's
    loop)."""
    import torch

    device = "cuda" if cuda else "cpu"
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(2)).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    for _ in range(args.warmup):
        step()
    return {"step": timed(step, cuda, args.loops, args.repeats)}


# ----------------------------------------------------------------------------------------- driver


SECTIONS = {
    "peaks": "the GPU's peaks",
    "engine_block": "the engine's block",
    "engine_block_graphed": "the engine's block as a CUDA graph",
    "engine_block_skewed": "the engine's block, routing skewed",
    "engine_layer_eager": "the one-layer model's step",
    "engine_layer_graphed": "the one-layer model's step with CUDA graphs",
    "hf_block": "transformers' block",
    "hf_layer": "transformers' layer",
}
"""The sections a run measures, in order (``peaks`` once, the others for each model and variant)."""
SKIPS = {"profile": (), "graphs": ("engine_block_graphed", "engine_layer_graphed"), "skewed": ("engine_block_skewed",),
         "layer": ("engine_layer_eager", "engine_layer_graphed", "hf_layer"), "hf": ("hf_block", "hf_layer")}
"""What each ``--skip`` word leaves out (``profile``: engine_block's profile, inside its section)."""
CUDA_ONLY = ("engine_block_graphed", "engine_layer_graphed")


def guarded(fn: Callable[[], dict], progress: dict | None = None) -> dict:
    """``fn()``, or its error, the traceback's end and ``progress`` (one section's failure leaves
    the rest); ``cuda_error`` where the error leaves the process's CUDA context unusable."""
    from bench.isolated import is_cuda_error

    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the next section runs
        out = {"error": f"{type(exc).__name__}: {exc}"[:500], "traceback": traceback.format_exc()[-2000:],
               **(progress or {})}
        if is_cuda_error(exc):
            out["cuda_error"] = True
        return out


def run_section(section: str, name: str, variant: str, args, cuda: bool, used_peaks: dict | None) -> dict:
    """One section of model ``name``'s ``variant``, on a model built for it alone."""
    import torch

    from studio.core.config import FastPathConfig
    from studio.engine import fast

    if section == "peaks":
        return peaks(cuda)
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    storage = "bf16" if section.startswith("hf_") else storage_for(name, args.storage)
    model = build(name, args.tiny, storage, VARIANTS[variant], args.rank, device, dtype)
    if section == "hf_block":
        return hf_block(model, args.tokens, args, cuda, dtype)
    if section == "hf_layer":
        return hf_layer(model, args.tokens, args, cuda)
    if section.startswith("engine_layer_"):
        progress: dict = {}
        return guarded(lambda: layer_step(model, args.tokens, args, cuda, section.endswith("graphed"), progress),
                       progress)
    fm, why = fast.prepare(model, FastPathConfig(cuda_graphs=False))
    if fm is None:
        return {"error": f"the fast path refused the model: {why}"}
    if section == "engine_block":
        return engine_block(fm, args.tokens, args, cuda, used_peaks)
    if section == "engine_block_graphed":
        return graphed_block(fm, args.tokens, args)
    return skewed_block(fm, args.tokens, args, cuda)


def place(row: dict, section: str, result: dict) -> None:
    """Put a section's result where the JSON keeps it (a graphed block inside the block's entry,
    the layer's steps under ``engine_layer``)."""
    if section == "engine_block_graphed":
        row.setdefault("engine_block", {})["graphed"] = result
    elif section.startswith("engine_layer_"):
        row.setdefault("engine_layer", {})[section.removeprefix("engine_layer_")] = result
    else:
        row[section] = result


def child_command(args, name: str, variant: str, used_peaks: dict | None, deadline: float):
    """The command of a child process that measures sections of ``name``'s ``variant`` with this
    run's options (bench/isolated.py's ``run_sections`` gives it the sections and its log)."""
    def command(batch: list[str], log: Path) -> list[str]:
        argv = [sys.executable, str(Path(__file__).resolve()), "--sections", ",".join(batch), "--model", name,
                "--variants", variant, "--tokens", str(args.tokens), "--rank", str(args.rank), "--storage", args.storage,
                "--warmup", str(args.warmup), "--loops", str(args.loops), "--repeats", str(args.repeats),
                "--profile-steps", str(args.profile_steps), "--skip", ",".join(sorted(args.skip)),
                "--peaks-used", json.dumps(used_peaks), "--deadline", str(deadline), "--out", str(log)]
        return argv + (["--tiny"] if args.tiny else []) + (["--loop-experts"] if args.loop_experts else [])
    return command


def measure(sections: list[str], name: str, variant: str, args, cuda: bool, used_peaks: dict | None,
            deadline: float, log=None) -> dict[str, dict]:
    """``sections`` of ``name``'s ``variant`` in this process, in order, each logged to ``log``
    where given (an isolated child's ``SectionLog``); a section starting after ``deadline`` is
    skipped. Stops after a section whose CUDA error leaves the process's CUDA context unusable."""
    found: dict[str, dict] = {}
    for section in sections:
        if time.time() > deadline:
            result = {"skipped": "--budget-s spent"}
        else:
            if section != "peaks":
                print(f"{name} {variant}: {SECTIONS[section]}", flush=True)
            if log is not None:
                log.start(section)
            result = guarded(lambda section=section: run_section(section, name, variant, args, cuda, used_peaks))
            if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
                result["launch_blocking"] = True
        if log is not None:
            log.done(section, result)
        found[section] = result
        if result.get("cuda_error"):
            break
        free(cuda)
    return found


def summarize(variant: dict) -> dict:
    """One variant's headline figures: step times, ratios, and the three costliest phases."""
    block = variant.get("engine_block", {})
    eager = block.get("eager", {}).get("step", {}).get("median_ms")
    graphed = block.get("graphed", {}).get("step", {}).get("median_ms")
    hf = variant.get("hf_block", {}).get("step", {}).get("median_ms")
    out: dict = {"engine_eager_ms": eager, "engine_graphed_ms": graphed, "hf_ms": hf}
    fastest = graphed or eager
    if fastest and hf:
        out["engine_speedup_vs_hf"] = round(hf / fastest, 2)
    if eager and graphed:
        out["host_share_of_eager"] = round(1 - graphed / eager, 3)
    ideal_figures = block.get("model", {}).get("ideal", {})
    if fastest and ideal_figures.get("ideal_ms"):
        out["ideal_ms"] = round(ideal_figures["ideal_ms"], 4)
        out["fused_floor_ms"] = round(ideal_figures["fused_floor_ms"], 4)
        out["engine_over_ideal"] = round(fastest / ideal_figures["ideal_ms"], 2)
    phases = block.get("profile", {}).get("by_phase_ms", {})
    kernel_ms = block.get("profile", {}).get("kernel_ms_per_step")
    if phases and kernel_ms:
        top = sorted(phases.items(), key=lambda kv: -kv[1]["total"])[:3]
        out["top_phases"] = {k: {"ms": v["total"], "share": round(v["total"] / kernel_ms, 3)} for k, v in top}
    layer = variant.get("engine_layer", {})
    layer_ms = next((r["step"]["median_ms"] for r in (layer.get("graphed"), layer.get("eager"))
                     if isinstance(r, dict) and "step" in r), None)
    if layer_ms and fastest:
        out["block_share_of_layer_step"] = round(fastest / layer_ms, 3)
    hf_layer_ms = variant.get("hf_layer", {}).get("step", {}).get("median_ms")
    if layer_ms and hf_layer_ms:
        out["engine_layer_ms"], out["hf_layer_ms"] = layer_ms, hf_layer_ms
        out["layer_speedup_vs_hf"] = round(hf_layer_ms / layer_ms, 2)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: every mistake at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", help=f"one of {', '.join(MOE_MODELS)}, a comma list, or all")
    parser.add_argument("--variants", default="attn,experts", help="attn (LoRA on attention), experts (and on the experts)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the micro-batch (one row)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--storage", choices=("auto", "nf4", "mxfp4"), default="auto",
                        help="the experts' 4-bit format (auto: MXFP4 for gpt-oss as it ships, NF4 for the rest)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loops", type=int, default=5, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops (median and fastest reported)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--skip", default="", help=f"sections left out: any of {', '.join(SKIPS)}")
    parser.add_argument("--only", default="", help=f"only these sections (peaks always runs): any of "
                        f"{', '.join(s for s in SECTIONS if s != 'peaks')}")
    parser.add_argument("--budget-s", type=float, default=480.0, help="no new section starts after this")
    parser.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                        help="the sections in child processes (bench/isolated.py), so that a CUDA fault "
                             "costs its section only; auto: on the GPU, or with --launch-blocking")
    parser.add_argument("--launch-blocking", default="",
                        help="sections run with CUDA_LAUNCH_BLOCKING=1 (a comma list, or all): an error is "
                             "raised by the operation that caused it; slow, so not for timings")
    parser.add_argument("--section-timeout-s", type=float, default=300.0,
                        help="an isolated child in which no section began or ended for this long is killed, "
                             "and the section it was in recorded so")
    parser.add_argument("--loop-experts", action="store_true",
                        help="the one-layer model's sparse layer takes the per-expert loop instead of torch's "
                             "grouped products (a diagnostic: eager only, its graphed capture fails)")
    parser.add_argument("--tiny", action="store_true", help="each family's tiny shape on the CPU (fp32)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", required=True)
    # a child process of an isolated run: its sections, the peaks measured, the budget's end
    parser.add_argument("--sections", default="", help=argparse.SUPPRESS)
    parser.add_argument("--peaks-used", default="null", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.skip = {s for s in args.skip.split(",") if s}
    args.only = {s for s in args.only.split(",") if s}
    args.launch_blocking = set(SECTIONS) if args.launch_blocking == "all" else {
        s for s in args.launch_blocking.split(",") if s}
    args.models = list(MOE_MODELS) if args.model == "all" else args.model.split(",")
    args.variant_list = args.variants.split(",")
    problems = [f"--model {m}: not one of {', '.join(MOE_MODELS)}" for m in args.models if m not in MOE_MODELS]
    problems += [f"--variants {v}: not one of {', '.join(VARIANTS)}" for v in args.variant_list if v not in VARIANTS]
    problems += [f"--skip {s}: not one of {', '.join(SKIPS)}" for s in sorted(args.skip) if s not in SKIPS]
    problems += [f"--{flag} {s}: not one of {', '.join(SECTIONS)}" for flag, given in
                 (("only", args.only), ("launch-blocking", args.launch_blocking)) for s in sorted(given) if s not in SECTIONS]
    if args.isolate == "off" and args.launch_blocking:
        problems.append("--launch-blocking needs the sections in processes of their own: leave out --isolate off")
    if problems:
        raise SystemExit("\n".join(problems))
    for name in args.models:
        storage_for(name, args.storage)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from bench.isolated import SectionLog, run_sections

    cuda = torch.cuda.is_available() and not args.tiny
    if args.sections:  # a child of an isolated run (bench/isolated.py)
        log = SectionLog(Path(args.out))
        measure(args.sections.split(","), args.models[0], args.variant_list[0], args, cuda,
                json.loads(args.peaks_used), args.deadline, log)
        log.leave()
    isolate = args.isolate == "on" or (args.isolate == "auto" and (cuda or bool(args.launch_blocking)))
    sections = [s for s in SECTIONS if s != "peaks" and not (not cuda and s in CUDA_ONLY)
                and not any(s in SKIPS[w] for w in args.skip) and (not args.only or s in args.only)]
    start = time.perf_counter()
    deadline = time.time() + args.budget_s
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"what": "one MoE layer's training step on the fast path by phase (issue 42)",
                    "command": " ".join(sys.argv), "commit": _commit(args.commit), "versions": _versions(),
                    "gpu": None, "tiny": args.tiny, "tokens": args.tokens, "rank": args.rank,
                    "dtype": "bfloat16" if cuda else "float32", "isolated": isolate,
                    "launch_blocking": sorted(args.launch_blocking), "models": {}}
    dead = ""  # in one process: the section whose CUDA error left the context unusable

    def write() -> None:
        result["wall_s"] = round(time.perf_counter() - start, 1)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    def run(wanted: list[str], name: str, variant: str, used: dict | None, row: dict) -> None:
        nonlocal dead

        def report(section: str, found: dict) -> None:
            place(row, section, found)
            write()

        if time.time() > deadline:  # no process started for nothing
            for section in wanted:
                report(section, {"skipped": "--budget-s spent"})
        elif isolate:
            run_sections(child_command(args, name, variant, used, deadline), wanted, args.section_timeout_s,
                         args.launch_blocking, report)
        else:
            found = measure(wanted, name, variant, args, cuda, used, deadline) if not dead else {}
            for section in wanted:
                report(section, found[section] if section in found else {
                    "skipped": f"not run: {dead}'s CUDA error left this process's CUDA context unusable "
                               "(--isolate on starts a fresh process after one)"})
                if found.get(section, {}).get("cuda_error"):
                    dead = dead or section

    first: dict = {}
    run(["peaks"], args.models[0], args.variant_list[0], None, first)
    result["peaks"] = first["peaks"]
    result["gpu"] = result["peaks"].get("device", "unknown")
    used = result["peaks"].get("used")
    write()
    for name in args.models:
        entry = result["models"][name] = {"storage": storage_for(name, args.storage), "variants": {}}
        for variant in args.variant_list:
            row = entry["variants"][variant] = {}
            run(sections, name, variant, used, row)
            row["summary"] = summarize(row)
            print(f"{name} {variant}: {json.dumps(row['summary'])}", flush=True)
            write()
    if dead:  # leave without the teardown that would abort on the dead context (bench/isolated.py)
        sys.stdout.flush()
        os._exit(3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
