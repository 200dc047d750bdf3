"""One mixture-of-experts model's speed and memory in one GPU call: Studio through its Trainer, Unsloth's
MoE path and the HF + PEFT loop, on the same micro-batches and seed (issue 42).

The model is built with random weights in its real shape (bench/moe_shapes.py: Qwen3-30B-A3B,
gpt-oss-20b, Mixtral-8x7B, OLMoE-1B-7B) by bench/make_random_model.py, on the first ``--layers``
layers where the whole model is too big for the GPU box's 64 GB disk or for the call's time: every
layer keeps its real shape and the result says how many of how many were built (``build``,
``summary.<model>.layers``). Seq 2048, micro-batch 1, full-length rows, NF4 with double
quantization, bf16 compute, LoRA r16 (alpha 32, dropout 0), AdamW 2e-4 constant, clipping at 1.0,
checkpointing. Two rows, each side a fresh process a row:

- ``attn``: LoRA on the attention projections (q/k/v/o), the experts frozen in 4 bits;
- ``experts``: the same and an adapter on every expert's gate/up and down weights (Studio's
  ``lora.target_experts``, PEFT's ``target_parameters`` ``mlp.experts.gate_up_proj`` and
  ``mlp.experts.down_proj`` on the other two sides).

The sides (bench/families.py's, with these targets):

- Studio: ``studio.engine.train.Trainer`` (its path decision: the fast path with 4-bit experts where
  it covers the family; gpt-oss takes the plain path or is refused until the fast path runs it, and
  the result says which, ``studio_path`` and ``studio_path_reason``). It records the micro-batches
  and its adapters' initial weights;
- the HF loop: transformers + PEFT + bitsandbytes 4-bit on those micro-batches from those weights
  (its per-step losses are Studio's reference). bitsandbytes quantizes ``nn.Linear`` only: the 3-D
  expert weights stay in bf16 as transformers loads them (``experts`` in the result says how each
  side stores them). PEFT's ``prepare_model_for_kbit_training`` is not called: it casts every 16-bit
  parameter to fp32, which here is the experts (twice their memory); the model is frozen and
  checkpointed as it would do. transformers runs the experts with its default implementation
  (``experts_implementation``: grouped_mm where it dispatches);
- Unsloth 2026.10.9: ``FastLanguageModel.from_pretrained(load_in_4bit=True)`` (it hands a mixture of
  experts to its ``FastModel`` path, which packs the 3-D experts in 4 bits and runs its grouped MoE
  kernels), ``get_peft_model`` with the same targets, its offloaded checkpointing, on those
  micro-batches from its own initial weights. Its gpt-oss-20b in ~14 GB is the MXFP4 or pre-quantized
  checkpoint; the random build here is bf16 (what it loads from such a folder is in ``experts``).

Tokens/s counts the steps after ``--warmup``; peak reserved is read after the model loaded. The
JSON keeps the command, commit, GPU, versions, the build, every side's per-step losses, and a
summary keyed by model then row: each side's tokens/s and peak reserved GiB, Studio's ratios to
Unsloth (speed, memory) and to the HF loop, and issue 42's bar: Studio >= 1.0x Unsloth's tokens/s
with at most its peak reserved, and >= 3x the HF loop's. The file is written after every side.

    # the GPU box, from the repository root (wheels as docs/testing.md says), one model a call
    python3 bench/moe.py --model qwen3-30b-a3b --commit <sha> --models-dir /tmp/models --out $OUT/moe_qwen3-30b-a3b.json
    # here, on the CPU: Studio and the HF loop on a tiny shape of each family (fp32, STUDIO_FAST_PATH=1)
    python3 bench/moe.py --tiny --model all --out /tmp/moe_tiny.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import child_env  # noqa: E402
from bench.families import _commit, _gpu_name, _run, _versions, summarize  # noqa: E402
from bench.make_random_model import build_model, read_build  # noqa: E402
from bench.moe_shapes import HUB_IDS, MOE_MODELS, tiny  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VARIANTS = {"attn": False, "experts": True}
"""Row -> whether the experts get adapters too (LoRA on the attention projections in both)."""

DEFAULT_LAYERS: dict[str, int | None] = {"qwen3-30b-a3b": 12, "gpt-oss-20b": 12, "gpt-oss-120b": 4,
                                         "mixtral-8x7b": 6, "olmoe-1b-7b": None}
"""Layers built by default (None: all): what the box's disk and a call's time hold with three sides
loading the model twice each (Qwen3-30B-A3B 12 of 48: 16 GB of bf16; gpt-oss-20b 12 of 24: 22 GB;
gpt-oss-120b 4 of 36: 27 GB; Mixtral-8x7B 6 of 32: 18 GB; OLMoE-1B-7B whole: 14 GB)."""

SEQ, MICRO_BATCH = 2048, 1
TINY_SEQ = 64
SIDES = ("studio", "hf", "unsloth")
BAR = {"vs_unsloth": 1.0, "vs_baseline": 3.0}
"""Issue 42's bar: Studio's tokens/s at least these multiples (and its peak reserved at most Unsloth's)."""


# ------------------------------------------------------------------------------------ the sides


def _child(args: argparse.Namespace) -> int:
    """One side of one row in this fresh process: RESULT and its measurement as JSON on the last line."""
    from bench.families import hf_side, studio_side, unsloth_side

    work, folder, variant = Path(args.work), Path(args.model_dir), args.variant
    experts = VARIANTS[variant]
    seq = TINY_SEQ if args.tiny else SEQ
    try:
        if args.child == "studio":
            result = studio_side(folder, variant, seq, MICRO_BATCH, args.steps, args.warmup, work,
                                 targets=tuple(ATTENTION), experts=experts)
        elif args.child == "hf":
            result = hf_side(folder, [variant], args.warmup, work, targets=ATTENTION,
                             target_parameters=EXPERTS if experts else None, kbit_prep=False)
        else:
            result = unsloth_side(folder, [variant], args.warmup, work, seq=seq, targets=ATTENTION,
                                  target_parameters=EXPERTS if experts else None)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory or a model a side cannot load is a result
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------ the summary


def judge(entry: dict) -> dict:
    """Issue 42's bar on one row's summary entry: each part True/False, or None where a side has no
    number (its reason is the side's error in the file)."""
    speed, base = entry.get("studio_vs_unsloth"), entry.get("studio_vs_baseline")
    ours, theirs = entry.get("studio_peak_reserved_gib"), entry.get("unsloth_peak_reserved_gib")
    parts = {"vs_unsloth": None if speed is None else speed >= BAR["vs_unsloth"],
             "memory_vs_unsloth": None if ours is None or theirs is None else ours <= theirs,
             "vs_baseline": None if base is None else base >= BAR["vs_baseline"]}
    parts["all"] = None if None in parts.values() else all(parts.values())
    return parts


def model_summary(name: str, build: dict | None, studio: dict, hf: dict, unsloth: dict) -> dict:
    """The summary of one model: what was built, then each row's numbers, ratios and bar."""
    rows = summarize(name, studio, {"workloads": hf}, {"workloads": unsloth})  # the sides' rows, flat
    out: dict = {}
    if build is not None:
        out["layers"] = f"{build['layers_built']} of {build['layers_real']}"
        out["full_model"] = build["full_model"]
    for variant in studio:
        entry = rows[f"{name}/{variant}"]
        entry["studio_path_reason"] = studio[variant].get("path_reason")
        ours, theirs = entry.get("studio_peak_reserved_gib"), entry.get("unsloth_peak_reserved_gib")
        if ours and theirs:
            entry["memory_vs_unsloth"] = round(ours / theirs, 3)
        entry["meets_bar"] = judge(entry)
        out[variant] = entry
    return out


# ------------------------------------------------------------------------------------ the driver


def build(name: str, folder: Path, layers: int | None, tiny_shape: bool, env: dict) -> dict:
    """The model's folder, built unless it is there: its random_build.json, the seconds it took, or
    the build's error."""
    import subprocess

    t0 = time.perf_counter()
    if tiny_shape:
        build_model(f"{name}-tiny", tiny(MOE_MODELS[name]), folder, layers=layers)
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "make_random_model.py"), "--arch", name, "--out", str(folder)]
        if layers is not None:
            cmd += ["--layers", str(layers)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            return {"error": f"the model did not build: {(done.stderr or done.stdout)[-600:]}"}
    return {**(read_build(folder) or {}), "wall_s": round(time.perf_counter() - t0, 1)}


def measure_model(name: str, args: argparse.Namespace, env: dict, start: float,
                  progress: Callable[[dict], None] = lambda entry: None) -> dict:
    """Build the model, then each row's sides, the attention row's three first (a call cut short keeps
    the headline); ``progress`` gets the entry after each side."""
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS[name]
    if args.tiny:
        layers = None
    work = Path(tempfile.mkdtemp(prefix=f"moe_{name}_"))
    suffix = "-tiny" if args.tiny else (f"-l{layers}" if layers else "")
    folder = Path(args.models_dir or work) / f"{name}{suffix}"
    entry: dict = {"model": name, "hub_id": HUB_IDS[name], "folder": str(folder)}
    entry["build"] = build(name, folder, layers, args.tiny, env)
    if "error" in entry["build"]:
        entry["error"] = entry["build"]["error"]
        return entry
    entry["config"] = json.loads((folder / "config.json").read_text())
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--model-dir", str(folder), "--work", str(work), "--steps", str(args.steps), "--warmup",
              str(args.warmup)] + (["--tiny"] if args.tiny else [])
    results: dict[str, dict] = {side: {} for side in SIDES}

    def report() -> dict:
        entry.update(studio=results["studio"], baseline=results["hf"], unsloth=results["unsloth"], logs=str(work),
                     summary=model_summary(name, entry.get("build"), results["studio"], results["hf"],
                                           results["unsloth"]))
        return entry

    variants = args.variants.split(",")
    sides = args.sides.split(",")
    for variant in variants:
        for side in SIDES:
            if side not in sides:
                continue
            elapsed = time.perf_counter() - start
            if side == "unsloth" and args.tiny:
                results[side][variant] = {"skipped": "--tiny: Unsloth needs a GPU"}
            elif side != "studio" and not results["studio"].get(variant, {}).get("losses"):
                results[side][variant] = {"skipped": "Studio's side trained no micro-batches for this row to replay"}
            elif elapsed > args.budget_s:
                results[side][variant] = {"skipped": "time budget"}
            else:
                t0 = time.perf_counter()
                got = _run(me + ["--child", side, "--variant", variant] + common, env, work / f"{side}_{variant}.log",
                           timeout=max(30.0, args.deadline_s - elapsed))
                got.update(got.pop("workloads", {}).get(variant, {}))  # the HF and Unsloth sides' one row
                results[side][variant] = {**got, "wall_s": round(time.perf_counter() - t0, 1)}
            if side == "studio":
                continue  # its numbers are reported with the sides that compare to them
            progress(report())
    return report()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", help=f"one of {', '.join(MOE_MODELS)}, or all")
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--layers", type=int, help="layers to build (default: per model, DEFAULT_LAYERS)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="rows: attn, experts (comma-separated)")
    parser.add_argument("--sides", default=",".join(SIDES), help="sides: studio, hf, unsloth (comma-separated)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps a row")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: Studio and the HF loop")
    parser.add_argument("--models-dir", help="where the built models go (reused when there)")
    parser.add_argument("--commit", help="the commit this tree is (git on the GPU box answers a stale one)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no side after this many seconds")
    parser.add_argument("--deadline-s", type=float, default=500.0, help="stop a side still running at this many seconds")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    if not args.out:
        parser.error("--out is required")
    models = list(MOE_MODELS) if args.model == "all" else args.model.split(",")
    problems = [f"unknown model {m}; choose from {', '.join(MOE_MODELS)} or all" for m in models if m not in MOE_MODELS]
    problems += [f"unknown row {v}; choose from {', '.join(VARIANTS)}" for v in args.variants.split(",")
                 if v not in VARIANTS]
    problems += [f"unknown side {s}; choose from {', '.join(SIDES)}" for s in args.sides.split(",") if s not in SIDES]
    if problems:
        parser.error("; ".join(problems))
    start = time.perf_counter()
    env = child_env(args.tiny)
    result = {"what": "Studio (Trainer) vs Unsloth's MoE path vs the HF + PEFT loop on a mixture of experts, same "
                      "micro-batches and seed; NF4, LoRA r16 on attention (row attn) and on the experts too (row "
                      "experts), seq 2048 micro-batch 1, AdamW 2e-4 constant, checkpointing; random weights in the "
                      "real per-layer shapes, on a subset of the layers where build.layers_built < build.layers_real",
              "command": " ".join(["python3", "bench/moe.py", *(sys.argv[1:] if argv is None else argv)]),
              "commit": _commit(args.commit), "gpu": _gpu_name(), "versions": _versions(), "tiny": args.tiny,
              "steps": args.steps, "warmup": args.warmup, "seq": TINY_SEQ if args.tiny else SEQ,
              "micro_batch": MICRO_BATCH, "bar": BAR, "models": {}, "summary": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write(entry: dict) -> None:
        result["models"][entry["model"]] = entry
        if "summary" in entry:
            result["summary"][entry["model"]] = entry["summary"]
        result["wall_s"] = round(time.perf_counter() - start, 1)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    for name in models:
        entry = measure_model(name, args, env, start, write)
        write(entry)
        summary = entry.get("summary", {})
        print(f"{name} ({summary.get('layers', 'all')} layers): {entry.get('error', '')}", flush=True)
        for variant in VARIANTS:
            row = summary.get(variant)
            if row is None:
                continue
            print(f"  {variant}: studio {row['studio_tokens_per_s'] or 0:.0f} tok/s ({row['studio_path']}), unsloth "
                  f"{row['unsloth_tokens_per_s'] or 0:.0f}, baseline {row['baseline_tokens_per_s'] or 0:.0f}; peak GiB "
                  f"{row['studio_peak_reserved_gib']} / {row['unsloth_peak_reserved_gib']} / "
                  f"{row['baseline_peak_reserved_gib']}; losses within 1%: {row.get('losses_within_1pct')}; "
                  f"bar: {row['meets_bar']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
