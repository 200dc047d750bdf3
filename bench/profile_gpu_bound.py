"""Where a training step's GPU time goes, for any family, and how fast its products could ever run.

On one GPU, in one process, for each model: the Llama-2-7B shape (the default, issue 13's rows) or
``--family`` shapes of bench/families.py (Gemma-2-9B, Llama-3-8B, Qwen3-8B...: the bundled
config.json, random weights, built under ``--models-dir`` on first use), NF4, LoRA r16 on every
linear projection of the layers, ``seq x mb`` tokens of full-length rows:

1. **Where the time goes.** Studio's fast path (``studio.engine.fast``, the loop of bench/speed.py)
   trains ``--steps`` steps per variant (the defaults, and each ``--levers`` entry: a
   bench/speed.py lever switched off, or an earlier way of the engine, :data:`EARLIER_WAYS`:
   liger's loss, liger's GeGLU); two steps of the defaults are profiled and every kernel is
   put in a category by bench/kernel_trace.py (matrix products, 4-bit dequantization, Studio's
   fused attention, flash attention, the loss with its head products and soft-cap, GELU, SwiGLU,
   norms, RoPE, the LoRA update kernels, the embedding, the optimizer, elementwise, device and
   host copies), with the GPU's busy share (all streams, and the compute stream alone).
2. **The ceiling** (``--no-ceiling`` skips it). The same step's matrix products and attention alone,
   with bf16 weights already in memory (no dequantization, no LoRA, no norms, no loss), timed:
   forward, the checkpointed recomputation (without and with the last product of each layer) and
   the input gradients; attention by torch's SDPA (flash attention: no soft-cap, so for Gemma 2 it
   is what its attention would cost if flash attention took the cap).

``--tiny``: the families at a tiny shape on the CPU in fp32 (no NF4, no CUDA graphs), the profile
read off the CPU's operators (the tests run it so). Writes ``--out`` (JSON: the command, commit,
GPU, versions; per model its config, build and load seconds, per workload the variants' tokens/s
and step ms, the kernel table per step, and the ceiling); after each model, so a call cut short
keeps what it measured.

    # Gemma-2-9B and its Llama-3-8B control at 2048 x 1 on one GPU, each with the loss and GeGLU as
    # they ran before (about 200 s on an H200 with the builds; --levers "" saves about 40 s)
    python bench/profile_gpu_bound.py --family gemma-2-9b,llama-3-8b --workloads 2048x1 --steps 6 \\
        --levers liger_loss,liger_geglu --models-dir /tmp/models --out $OUT/profile_gemma2_llama3.json
    # issue 13's rows, the Llama-2-7B shape
    python bench/profile_gpu_bound.py --out bench/results/current/x.json --workloads 512x16,4096x1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_trace import compute_stream_gaps, kernel_table  # noqa: E402

EARLIER_WAYS = {
    "liger_loss": "the loss through liger's fused cross-entropy (its thin chunks), not engine/fast/cross_entropy.py",
    "liger_geglu": "GeGLU as the product, then liger's GELU kernel (copies of gate and up), not Studio's gated kernel",
}
"""``--levers`` entries beside bench/speed.py's settings: an earlier way of the engine, patched in
this process only (nothing in studio/ changes: :func:`earlier_way`), so one call times both."""

LEGACY = "llama2-7b"
"""The default model: bench/speed.py's random Llama-2-7B (issue 13's rows)."""
PROFILED_STEPS = 2


@dataclass(frozen=True)
class Shape:
    """What sizes a step's products and attention (the ceiling's); the defaults are Llama-2-7B's."""

    layers: int = 32
    hidden: int = 4096
    inter: int = 11008
    vocab: int = 32000
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128

    @classmethod
    def of(cls, config: dict) -> Shape:
        """The shape of a decoder's config.json values."""
        heads = int(config["num_attention_heads"])
        return cls(layers=int(config["num_hidden_layers"]), hidden=int(config["hidden_size"]),
                   inter=int(config["intermediate_size"]), vocab=int(config["vocab_size"]), heads=heads,
                   kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads))


def ceiling(tokens: int, seq: int, mb: int, shape: Shape = Shape(), repeats: int = 3) -> dict:
    """The step's products and attention alone (bf16 weights resident), timed on the GPU."""
    import torch
    import torch.nn.functional as F

    from bench.gpu_timing import best_ms

    dev = torch.device("cuda")
    bf = torch.bfloat16
    s = shape
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # one layer's weights (out, in), reused by every layer: the products' shapes are what matter
    shapes = {"q": (q_width, s.hidden), "k": (kv_width, s.hidden), "v": (kv_width, s.hidden),
              "o": (s.hidden, q_width), "gate": (s.inter, s.hidden), "up": (s.inter, s.hidden),
              "down": (s.hidden, s.inter)}
    w = {k: torch.randn(d, device=dev, dtype=bf) * 0.02 for k, d in shapes.items()}
    head = torch.randn(s.vocab, s.hidden, device=dev, dtype=bf) * 0.02
    inputs = {width: torch.randn(tokens, width, device=dev, dtype=bf) for width in {s.hidden, q_width, s.inter}}
    dys = {k: torch.randn(tokens, d[0], device=dev, dtype=bf) for k, d in shapes.items()}
    head_chunk = min(tokens, 4096)  # the fused loss goes through the tokens in chunks
    dlogits = torch.randn(head_chunk, s.vocab, device=dev, dtype=bf)
    q = torch.randn(mb, s.heads, seq, s.head_dim, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(mb, s.kv_heads, seq, s.head_dim, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def forward(skip_down: bool) -> None:
        for name, weight in w.items():
            if not (skip_down and name == "down"):
                torch.mm(inputs[weight.shape[1]], weight.t())

    def backward() -> None:
        for name, weight in w.items():
            torch.mm(dys[name], weight)

    def attention_fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads)

    def timed(fn) -> float:
        return best_ms(fn, loops=1, repeats=repeats, warm=False)  # the caller warms up where it matters

    def layers_products(skip_down: bool) -> None:
        for _ in range(s.layers):
            forward(False)       # the forward
            forward(skip_down)   # the checkpointed recomputation
            backward()           # the input gradients (the base weights are frozen)

    def head_products() -> None:
        for start in range(0, tokens, head_chunk):
            n = min(head_chunk, tokens - start)
            torch.mm(inputs[s.hidden][:n], head.t())
            torch.mm(dlogits[:n], head)

    out = attention_fwd()
    grad = torch.randn_like(out)

    def attention_all() -> None:
        for _ in range(s.layers):
            with torch.no_grad():
                attention_fwd()  # the forward
            o = attention_fwd()  # the recomputation, whose backward follows
            torch.autograd.grad(o, (q, k, v), grad)

    timed(lambda: layers_products(False))  # warm-up (cuBLAS heuristics, clocks)
    full = timed(lambda: layers_products(False))
    skipped = timed(lambda: layers_products(True))
    head_ms = timed(head_products)
    timed(attention_all)
    attn_ms = timed(attention_all)
    flops_layer = sum(2 * tokens * a * b for a, b in shapes.values())
    gemm_flops = s.layers * 3 * flops_layer + 2 * 2 * tokens * s.hidden * s.vocab
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=bf)
    square = timed(lambda: torch.mm(a, a))
    # The same product for ~2 s: under its power limit the card lowers its clock (an H100 SXM ran at
    # a median 1410 of its 1980 MHz, bench/results/archive/h100_v18_product_shapes.json), and a training
    # step's products run at this rate, not at the short loop's.
    sustained = best_ms(lambda: torch.mm(a, a), loops=1500, repeats=1, warm=False)
    return {"tokens": tokens, "shape": asdict(s), "products_ms": round(full + head_ms, 2),
            "products_skip_last_ms": round(skipped + head_ms, 2), "head_products_ms": round(head_ms, 2),
            "attention_ms": round(attn_ms, 2),
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


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


def load_model(name: str, models_dir: str, tiny: bool) -> tuple[object, dict, dict]:
    """The PEFT model of ``name`` (:data:`LEGACY` or a bench/families.py family, built under
    ``models_dir`` on first use), its config.json values, and what loading took."""
    import torch

    from bench.families import build_model, lora_targets
    from bench.speed import random_7b, studio_load

    cuda = torch.cuda.is_available()
    info: dict = {}
    if name == LEGACY:
        t0 = time.perf_counter()
        model = random_7b(models_dir)
        info["load_s"] = round(time.perf_counter() - t0, 1)
        return model, model.config.to_dict(), info
    folder = Path(models_dir) / f"{name}{'-tiny' if tiny else ''}"
    if not (folder / "tokenizer.json").exists():
        t0 = time.perf_counter()
        build_model(name, folder, tiny)
        info["build_s"] = round(time.perf_counter() - t0, 1)
        _free(cuda)
    t0 = time.perf_counter()
    model = studio_load(str(folder), 0.0, 42, targets=lora_targets(folder))
    info["load_s"] = round(time.perf_counter() - t0, 1)
    return model, json.loads((folder / "config.json").read_text()), info


def random_batches(seq: int, mb: int, vocab: int, count: int = 4) -> list[dict]:
    """``count`` micro-batches of ``mb`` full rows of ``seq`` random token ids (each row one example)."""
    import torch

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (mb, seq), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": None,
                        "position_ids": torch.arange(seq).expand(mb, seq).contiguous(), "tokens": mb * seq})
    return batches


@contextlib.contextmanager
def earlier_way(lever: str) -> Iterator[None]:
    """The engine as it was before one of the changes :data:`EARLIER_WAYS` names, while a variant
    is built and trains (a lever that is not one of them changes nothing here)."""
    from studio.engine.fast import cross_entropy, update

    if lever == "liger_loss":
        saved, cross_entropy.available = cross_entropy.available, lambda device, dtype: False
        try:
            yield
        finally:
            cross_entropy.available = saved
    elif lever == "liger_geglu":
        saved, update.ACTIVATIONS = update.ACTIVATIONS, ("silu",)
        try:
            yield
        finally:
            update.ACTIVATIONS = saved
    else:
        yield


@contextlib.contextmanager
def labelled(fast_model) -> Iterator[None]:
    """The fast path's loss and embedding inside ``bench.loss`` and ``bench.embedding`` ranges while
    a profile runs (in this process only; nothing in studio/ changes): the kernels they launch
    (the loss' head products among them, which are GEMMs like any other) are theirs in the table."""
    from torch.profiler import record_function

    import studio.engine.fast.model as fast_module

    loss, embed = fast_module.cross_entropy, fast_model._embed

    def ranged_loss(*args, **kwargs):
        with record_function("bench.loss"):
            return loss(*args, **kwargs)

    def ranged_embed(ids):
        with record_function("bench.embedding"):
            return embed(ids)

    fast_module.cross_entropy, fast_model._embed = ranged_loss, ranged_embed
    try:
        yield
    finally:
        fast_module.cross_entropy = loss
        del fast_model._embed  # the method again


def profile(fast_model, params, batches, trace: Path) -> dict:
    """Two steps of ``fast_model`` under torch.profiler, their kernel table (bench/kernel_trace.py)
    and, on a GPU, where the compute stream waited."""
    import torch

    from bench.speed import studio_train

    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities)
    if cuda:
        torch.cuda.synchronize()
    w0 = time.perf_counter()
    with prof, labelled(fast_model):
        studio_train(fast_model, params, batches, PROFILED_STEPS, 2e-4, 0, 42)
    wall = time.perf_counter() - w0
    prof.export_chrome_trace(str(trace))
    table = kernel_table(trace, wall, PROFILED_STEPS)
    if cuda:
        table["compute_stream"] = compute_stream_gaps(trace, PROFILED_STEPS)
    trace.unlink()
    return table


def run_workload(model, spec: str, shape: Shape, args, trace: Path) -> dict:
    """One ``SEQxMB`` workload of a loaded model: its variants' runs, the profile, the ceiling."""
    import torch

    from bench.speed import LEVERS, fast_facts, studio_train
    from studio.core.config import FastPathConfig
    from studio.engine import fast

    cuda = torch.cuda.is_available()
    seq, mb = (int(x) for x in spec.split("x"))
    batches = random_batches(seq, mb, shape.vocab)
    params = [p for p in model.parameters() if p.requires_grad]
    row: dict = {"variants": {}}
    levers = ["all", *[x for x in args.levers.split(",") if x]]
    warmup = min(3, max(0, args.steps - 1))
    for repeat, lever in schedule(levers, args.repeats):
        with earlier_way(lever):
            fm, why = fast.prepare(model, FastPathConfig(**LEVERS.get(lever, {})))
            if fm is None:
                row["variants"][lever] = {"error": why}
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            res = studio_train(fm, params, batches, args.steps, 2e-4, warmup, 42)
        step_ms = round(statistics.median(res["step_s"][warmup:]) * 1e3, 2)
        if repeat < 0:
            print(f"{spec} {lever} (warm-up run, not kept): {res['tokens_per_s']:.0f} tokens/s", flush=True)
        elif repeat == 0:
            row["variants"][lever] = {
                "tokens_per_s": round(res["tokens_per_s"]), "step_ms": step_ms, "losses": res["losses"][:6],
                "peak_reserved_gib": round(res["peak_reserved"] / 2**30, 3) if cuda else None,
                "fast_path": fast_facts(fm)}
        if args.repeats > 1 and repeat >= 0:
            variant = row["variants"][lever]
            variant.setdefault("repeats_tokens_per_s", []).append(round(res["tokens_per_s"]))
            variant["median_tokens_per_s"] = sorted(variant["repeats_tokens_per_s"])[
                (len(variant["repeats_tokens_per_s"]) - 1) // 2]
        if repeat >= 0:
            print(f"{spec} {lever} (run {repeat + 1}): {res['tokens_per_s']:.0f} tokens/s, step {step_ms} ms",
                  flush=True)
        if lever == "all" and repeat == 0 and not args.no_profile:
            row["profile_2_steps"] = profile(fm, params, batches, trace)
            print(json.dumps(row["profile_2_steps"].get("compute_stream", {}))[:2000], flush=True)
            print(f"{spec} per step: busy {row['profile_2_steps']['busy_share']:.1%} of "
                  f"{row['profile_2_steps']['wall_ms'] / PROFILED_STEPS:.1f} ms (compute stream "
                  f"{row['profile_2_steps']['compute_stream_busy_share']:.1%}); "
                  + json.dumps(row["profile_2_steps"]["by_category_ms_per_step"]), flush=True)
        fm.release_graphs()
        del fm
        _free(cuda)
    if cuda and not args.no_ceiling:
        row["ceiling"] = ceiling(seq * mb, seq, mb, shape)
        print(json.dumps(row["ceiling"]), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from bench.families import FAMILIES, _commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", help=f"comma-separated families of bench/families.py ({', '.join(FAMILIES)}); "
                                         f"default the Llama-2-7B shape ({LEGACY})")
    parser.add_argument("--workloads", help="SEQxMB, comma-separated (default 512x16,4096x1; 64x1 with --tiny)")
    parser.add_argument("--steps", type=int, default=12, help="steps a variant trains (the first 3 untimed)")
    parser.add_argument("--levers", default="no_offload",
                        help="variants to time too, comma-separated ('' for none): bench/speed.py's settings "
                             f"levers, or an earlier way of the engine ({', '.join(EARLIER_WAYS)})")
    parser.add_argument("--models-dir", default="/tmp/models")
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD)")
    parser.add_argument("--tiny", action="store_true", help="the families at a tiny shape on the CPU (fp32)")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the products-and-attention ceiling")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the variants this many times, interleaved (all, lever, all, lever, ...), "
                             "after one warm-up run that is not kept: each variant's rates and their median, "
                             "for levers of about the run-to-run spread")
    args = parser.parse_args(argv)
    from bench.speed import LEVERS

    names = args.family.split(",") if args.family else [LEGACY]
    odd = [x for x in args.levers.split(",") if x and x not in LEVERS and x not in EARLIER_WAYS]
    if odd:
        parser.error(f"unknown lever {', '.join(odd)}; choose from {', '.join([*LEVERS, *EARLIER_WAYS])}")
    unknown = [n for n in names if n not in FAMILIES and not (n == LEGACY and not args.tiny)]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)}"
                     + ("" if args.tiny else f" (or {LEGACY}, the default)"))

    import torch
    import transformers

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        parser.error("no GPU here: --tiny runs the families at a tiny shape on the CPU")
    workloads = (args.workloads or ("64x1" if args.tiny else "512x16,4096x1")).split(",")
    t0 = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["python3", "bench/profile_gpu_bound.py", *(argv or sys.argv[1:])]),
              "commit": _commit(args.commit), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
              "tiny": args.tiny, "steps": args.steps, "profiled_steps": PROFILED_STEPS,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           **{name: _version(name) for name in ("peft", "bitsandbytes", "liger_kernel", "triton")}},
              "models": {}}
    for name in names:
        model, config, info = load_model(name, args.models_dir, args.tiny)
        shape = Shape.of(config)
        entry = {**info, "shape": asdict(shape), "config": config, "workloads": {}}
        result["models"][name] = entry
        for spec in workloads:
            print(f"{name} {spec}", flush=True)
            trace = out_path.with_name(f"{out_path.stem}_trace_{name}_{spec}.json")
            entry["workloads"][spec] = run_workload(model, spec, shape, args, trace)
            out_path.write_text(json.dumps(result, indent=1))
        del model
        _free(cuda)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
