"""Measure the memory estimate against today's engine in one GPU call: tests/data/vram_measured.json.

Builds random-weight models of four shapes on the GPU (/work/shared/GPU.md; SmolLM2-135M,
Qwen3-0.6B, Llama-2-7B, Llama-3-8B: AutoConfig, bf16, save_pretrained, the project's tiny byte-level
BPE tokenizer beside them), then trains every row of :data:`ROWS` through Studio's own Trainer
(bench/engines.py ``run_trainer``: the engine's own path decision, fast path, CUDA graphs, a final
evaluation, the adapter save) and answers one chat prompt as long as a training row, each row in a
fresh process, ``--parallel`` at a time (the peaks are per process). Each row keeps the run config
it trained with, the path the engine took, the peaks of the training steps, of the whole run and
of the chat answer, where the answer's KV cache lived and the longest examples; the file keeps the
command, the commit (the engine version every row was measured on), the GPU and the versions.
tests/core/test_vram_measured.py checks the estimate (``studio estimate`` of each row's config) against it.

    # the GPU box, from the repository root (wheels as docs/testing.md says): 323 s for the 24 rows at
    # --parallel 4 on an H200 (9058222, the models' builds included)
    python3 bench/vram_measure.py --commit $(git rev-parse HEAD) --parallel 4 --out $OUT/vram_measured.json
    # then here: cp <files_at>/vram_measured.json tests/data/vram_measured.json
    python3 bench/vram_measure.py --dry-run              # the rows and today's predictions; runs nothing
    python3 bench/vram_measure.py --cpu --out /tmp/v.json  # the whole pipeline on tiny shapes, on the CPU
    python3 bench/vram_measure.py --score tests/data/vram_measured.json  # the estimator as it stands

A third of the rows (every third) is out of sample: the estimator's constants are never fitted on
them (bench/refit_vram_fast.py fits on the others).

``--grid families`` is a second grid (issue 39): three to five rows on a small real shape of each
family the fast path covers beside Llama and Qwen3 (Qwen2.5-0.5B, Gemma-3-1B, Gemma-2-2B, Phi-4-mini,
OLMo-2-1B, SmolLM3-3B, Granite-3.1-2B, Mistral-7B; bench/family_shapes.py says where each shape's
values come from), at least a third of each family's rows out of sample (bench/vram_grids.py). Its
predictions are committed before it runs (bench/predictions/); the default grid's 24 rows, labels and
order stay as they are. ``--attribute`` names rows whose allocator history is recorded and replayed:
who held the memory at the peaks (bench/mem_attribution.py), for a row the estimate misses.

    python3 bench/vram_measure.py --grid families --dry-run --json bench/predictions/vram_families_<commit>.json
    # the GPU box: 30 rows x ~35-45 s, 4 at a time, while the 8 models build two at a time (~45 GB of
    # bf16 folders): ~300-350 s (bench/NEXT_GPU.md)
    python3 bench/vram_measure.py --grid families --parallel 4 --budget-s 300 --commit <commit> \\
        --models-dir /tmp/grid --out $OUT/vram_measured_families.json
    python3 bench/vram_measure.py --grid families --score vram_measured_families.json \\
        --predictions bench/predictions/vram_families_<commit>.json   # today's estimate and the committed one
    python3 bench/vram_measure.py --grid families --cpu --out /tmp/f.json  # a tiny row a family, ~2 min

``--grid moe`` (issue 42): three rows on each of OLMoE-1B-7B, Qwen3-30B-A3B's first 8 layers and
Mixtral-8x7B's first 4 (bench/vram_grids.py; every layer in its real shape, the result's ``layers``
says how many of how many), LoRA on the attention, the experts' own adapters on one row a model, a
third out of sample. Predictions committed before it runs; the bar: every row's committed estimate
of peak reserved within 5% (``--score ... --predictions``).

    python3 bench/vram_measure.py --grid moe --dry-run --json bench/predictions/vram_moe_<commit>.json
    # the GPU box: 9 rows x ~45 s, 3 at a time, while the 3 models build (~37 GB of bf16): ~200-250 s
    python3 bench/vram_measure.py --grid moe --parallel 3 --budget-s 300 --commit <commit> \\
        --models-dir /tmp/grid --out $OUT/vram_measured_moe.json
    python3 bench/vram_measure.py --grid moe --score vram_measured_moe.json \\
        --predictions bench/predictions/vram_moe_<commit>.json
    python3 bench/vram_measure.py --grid moe --cpu --out /tmp/m.json  # a tiny row a family
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.moe_shapes import MOE_MODELS  # noqa: E402
from bench.vram_grids import (  # noqa: E402, F401 - ALL, QV, Row, ROWS and FAMILY_ROWS are read from here too
    ALL,
    BARS,
    FAMILY_ROWS,
    GRIDS,
    MOE_SUBSETS,
    QV,
    ROWS,
    Row,
)

WARMUP_STEPS = 3
"""Steps before the tokens/s clock starts (the CUDA-graph capture is in the first)."""


# ------------------------------------------------------------------------------- the estimate


@contextlib.contextmanager
def _engine_environment(alloc_conf: str | None):
    """The environment the rows ran in, for the estimate (it reads PYTORCH_CUDA_ALLOC_CONF and
    STUDIO_FAST_PATH as the engine does): the allocator setting recorded, no forced path."""
    saved = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "STUDIO_FAST_PATH")}
    os.environ.pop("STUDIO_FAST_PATH", None)
    if alloc_conf is None:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def predict(row: dict, models: dict, alloc_conf: str | None = None) -> dict:
    """What ``studio estimate`` says of a row's run config (the same call tests/core/test_vram_measured.py
    makes): the path, the peaks over every phase of the run, the phase that sets them, and where the
    chat answer's KV cache goes for the prompt the row measured (the session's own question)."""
    import yaml

    from studio.core.config import parse_config
    from studio.core.memory import estimate, estimate_plan
    from studio.core.model.info import from_config_dict

    config = parse_config(yaml.safe_dump(row["config"]))
    info = from_config_dict(dict(models[row["model"]]), row["model"])
    measured = row.get("measured", {})
    with _engine_environment(alloc_conf):
        result = estimate(config, info, lengths=tuple(measured.get("longest_examples", ())))
        out = {"path": result.path, "peak_allocated": result.peak_allocated, "peak_reserved": result.peak_reserved,
               "peak_phase": result.peak_phase}
        if "generate_prompt_tokens" in measured:
            asked = replace(estimate(config, info).plan, generate_prompt_tokens=measured["generate_prompt_tokens"],
                            generate_new_tokens=measured["generate_new_tokens"])
            out["kv_on_host"] = estimate_plan(info, asked).phases["generation"].host_kv
    return out


def score(results: dict) -> dict:
    """Each measured row's prediction and relative errors, and the summary: median and worst absolute
    error of both peaks over all rows and over the out-of-sample ones, and how many rows took the
    predicted path and kept the answer's KV cache where predicted."""
    scored = []
    for row in results["rows"]:
        measured = row.get("measured", {})
        if "peak_reserved" not in measured:
            continue
        predicted = predict(row, results["models"], results.get("environment", {}).get("PYTORCH_CUDA_ALLOC_CONF"))
        errors = {k: predicted[k] / measured[k] - 1 for k in ("peak_allocated", "peak_reserved")}
        scored.append({"label": row["label"], "out_of_sample": row["out_of_sample"], "predicted": predicted,
                       "error": errors, "path_agrees": predicted["path"] == measured["path"],
                       "kv_agrees": predicted.get("kv_on_host") == (measured.get("generate_kv_cache") == "host")})
    summary: dict = {"rows": len(scored), "out_of_sample_rows": sum(r["out_of_sample"] for r in scored),
                     "paths_agree": sum(r["path_agrees"] for r in scored),
                     "kv_cache_agrees": sum(r["kv_agrees"] for r in scored)}
    for part, chosen in (("all", scored), ("out_of_sample", [r for r in scored if r["out_of_sample"]])):
        for key in ("peak_allocated", "peak_reserved"):
            errors = [abs(r["error"][key]) for r in chosen]
            if errors:
                summary.setdefault(part, {})[key] = {"median_abs_error": round(statistics.median(errors), 4),
                                                     "worst_abs_error": round(max(errors), 4)}
    return {"rows": scored, "summary": summary}


def print_score(scored: dict) -> None:
    """Each row's errors, then the summary."""
    for r in scored["rows"]:
        e = r["error"]
        print(f"{'OOS' if r['out_of_sample'] else '   '} {r['label']:62} {r['predicted']['path']:5} "
              f"allocated {e['peak_allocated']:+6.1%} reserved {e['peak_reserved']:+6.1%}"
              f"{'' if r['path_agrees'] else '  PATH DIFFERS'}{'' if r['kv_agrees'] else '  KV CACHE DIFFERS'}")
    print(json.dumps(scored["summary"], indent=1))


# ------------------------------------------------------------------------------------ the GPU side


def build_model(name: str, shape: dict, out: Path) -> None:
    """Random bf16 weights in ``shape``, saved like a downloaded checkpoint, with the project's tiny
    byte-level BPE tokenizer (its ids are below every vocabulary here)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.engine.tiny import build_tokenizer

    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    build_tokenizer().save_pretrained(out)
    print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)


def _child(args: argparse.Namespace) -> int:
    """One row in this fresh process: RESULT and the row's measurement as JSON on the last line."""
    from bench.engines import run_trainer

    spec = json.loads(args.child)
    row = Row(**{**spec, "targets": tuple(spec["targets"])})
    attribution = args.child_attribute and _cuda()
    if attribution:  # from before the load: every block of the run is named
        from bench import mem_attribution

        mem_attribution.record()
    try:
        measured = run_trainer(row, Path(args.model_dir), args.steps, WARMUP_STEPS,
                               Path(tempfile.mkdtemp(prefix="vram_measure_")))
    except Exception as exc:  # noqa: BLE001 - an out-of-memory or a missing kernel is a result, not a crash
        measured = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    if attribution:
        measured["attribution"] = mem_attribution.attribute()
    print("RESULT " + json.dumps(measured), flush=True)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "triton", "liger-kernel"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _gpu_name() -> str:
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() or "unknown"


def _commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit("no git here: pass --commit with the commit this tree is (git rev-parse HEAD), the "
                         "engine version every row is measured on")
    return done.stdout.strip()


def measure(args: argparse.Namespace) -> int:
    """Build the models, run the rows, write the file after every row (a run cut short keeps its rows)."""
    start = time.perf_counter()
    commit = _commit(args.commit)
    grid_rows, grid_models, tiny_models, _ = GRIDS[args.grid]
    rows, models = grid_rows, grid_models
    if args.cpu:  # a row of each family on its tiny shape, a few tokens, no bitsandbytes: the pipeline, not peaks
        models = tiny_models
        firsts = {grid_models[r.model]["model_type"]: r for r in reversed(grid_rows)}
        rows = [replace(r, model=family, weights="bf16", seq=64, micro_batch=2) for family, r in firsts.items()]
    if args.only:
        rows = [r for r in rows if any(part in r.label for part in args.only.split(","))]
    folders = Path(args.models_dir or tempfile.mkdtemp(prefix="vram_measure_models_"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "STUDIO_FAST_PATH"):  # the engine's own defaults
        env.pop(key, None)
    env["HF_HUB_OFFLINE"] = "1"  # every model is a local folder
    if args.cpu:  # the fast path, which the GPU rows take, forced on (a CPU takes the plain one otherwise)
        env.update(CUDA_VISIBLE_DEVICES="", STUDIO_FAST_PATH="1")
    checked_by = ("tests/core/test_vram_measured.py checks the estimate against them" if args.grid == "default"
                  else f"bench/vram_measure.py --grid {args.grid} --score scores the estimate against them")
    result = {"what": "peaks of Studio's Trainer on today's engine, one fresh process a row: the training steps, "
                      "the whole run (final evaluation, adapter save) and one chat answer of a prompt as long as a "
                      f"training row; {checked_by}",
              "grid": args.grid, "engine": commit[:12], "commit": commit,
              "command": " ".join(["python3", "bench/vram_measure.py", *sys.argv[1:]]),
              "gpu": _gpu_name(), "versions": _versions(), "cpu_only": args.cpu,
              "environment": {"PYTORCH_CUDA_ALLOC_CONF": None, "note": "unset: the engine sets expandable_segments:True"},
              "steps": args.steps, "parallel": args.parallel, "models": {}, "rows": []}
    if args.grid == "moe" and not args.cpu:  # each model's layers as built (random weights in the real per-layer shapes)
        result["layers"] = {name: "all" if layers is None else f"{layers} of {MOE_MODELS[shape]['num_hidden_layers']}"
                            for name, (shape, layers) in MOE_SUBSETS.items()}
    lock = threading.Lock()

    def write() -> None:
        result["rows"].sort(key=lambda r: [x.label for x in rows].index(r["label"]))
        result["wall_s"] = round(time.perf_counter() - start, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    def build(name: str) -> Path:
        folder = folders / name
        if not (folder / "tokenizer.json").exists():  # written last: a folder without it is half built
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
                    f"from bench.vram_measure import build_model; "
                    f"build_model({name!r}, {models[name]!r}, Path({str(folder)!r}))")
            subprocess.run([sys.executable, "-c", code], check=True, env=env)
        with lock:
            result["models"][name] = json.loads((folder / "config.json").read_text())
        return folder

    def one(row: Row, folder: Future) -> None:
        entry = {"label": row.label, "engine": result["engine"], "model": row.model,
                 "out_of_sample": row.out_of_sample, "case": {**asdict(row), "targets": list(row.targets)}}
        try:
            model_dir = folder.result()
        except subprocess.CalledProcessError as exc:
            entry["measured"] = {"error": f"the model did not build: {exc}"}
        else:
            if time.perf_counter() - start > args.budget_s:
                entry["measured"] = {"skipped": "time budget"}
            else:
                t0 = time.perf_counter()
                cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(entry["case"]),
                       "--model-dir", str(model_dir), "--steps", str(args.steps)]
                if any(part in row.label for part in (args.attribute or "").split(",") if part):
                    cmd.append("--child-attribute")
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                measured = json.loads(lines[-1][7:]) if lines else {"error": (done.stderr or "no output")[-300:]}
                entry["config"] = measured.pop("config", None)
                entry["measured"] = measured
                entry["wall_s"] = round(time.perf_counter() - t0, 1)
        note = ""
        with lock:
            if entry.get("config"):
                entry["predicted"] = predict(entry, result["models"])
            if "peak_reserved" in entry["measured"]:
                error = entry["predicted"]["peak_reserved"] / entry["measured"]["peak_reserved"] - 1
                note = f": reserved {entry['measured']['peak_reserved'] / 2**30:.2f} GiB, estimate {error:+.1%}"
            result["rows"].append(entry)
            write()
        shown = entry["measured"].get("error") or entry["measured"].get("skipped") or entry["measured"].get("path")
        print(f"[{time.perf_counter() - start:5.0f} s] {row.label}: {shown}{note}", flush=True)

    # Small models build in seconds and their rows start at once, while the large ones build.
    order = sorted(rows, key=lambda r: list(models).index(r.model))
    with ThreadPoolExecutor(max_workers=2) as builders, ThreadPoolExecutor(max_workers=args.parallel) as runners:
        built = {name: builders.submit(build, name) for name in models if any(r.model == name for r in rows)}
        list(runners.map(lambda r: one(r, built[r.model]), order))
    write()
    if not args.cpu:
        print_score(score(result))
    print(f"wrote {args.out} ({len(result['rows'])} rows) in {time.perf_counter() - start:.0f} s")
    return 0


def saved_config(shape: dict) -> dict:
    """The config.json that :func:`build_model` saves for ``shape`` (with the keys this transformers
    version writes there), made here without weights: a prediction before the run sizes what the
    scoring after it reads from the saved file."""
    from transformers import AutoConfig

    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        return json.loads((Path(folder) / "config.json").read_text())


def dry_run(grid: str, json_out: str | None = None, commit: str | None = None) -> int:
    """Every row of ``grid`` with today's prediction from its run config alone (full-length rows where
    the row is short: the data's lengths come from the run), and the rows' coverage; with
    ``json_out``, the same as a file: the predictions committed before a GPU run."""
    from bench.engines import trainer_config

    rows, shapes, _, _ = GRIDS[grid]
    # The default grid's shapes as written (its earlier predictions were made so); the family grid's
    # as the build will save them.
    models = {name: saved_config(shape) for name, shape in shapes.items()} if grid != "default" else shapes
    paths, entries = [], []
    for row in rows:
        config = trainer_config(row, Path("/models") / row.model, Path("rows.jsonl"), 5, cuda=True)
        predicted = predict({"config": config.to_dict(), "model": row.model}, models)
        paths.append(predicted["path"])
        entries.append({"label": row.label, "model": row.model, "out_of_sample": row.out_of_sample,
                        "predicted": predicted, "config": config.to_dict()})
        print(f"{'OOS' if row.out_of_sample else '   '} {row.label:62} {predicted['path']:5} "
              f"{predicted['peak_reserved'] / 2**30:6.2f} GiB reserved ({predicted['peak_phase']})")
    print(f"{len(rows)} rows, {sum(r.out_of_sample for r in rows)} out of sample, {paths.count('fast')} fast, "
          f"{paths.count('plain')} plain, models {', '.join(sorted({r.model for r in rows}))}")
    if json_out:
        made = {"what": f"bench/vram_measure.py --grid {grid}: each row's estimate before the GPU run, from its run "
                        "config and the config.json its model's build saves; the data's lengths are the full rows "
                        "the run trains on, the chat answer's prompt as long as a training row",
                "grid": grid, "estimator_commit": _commit(commit), "command": " ".join(["python3", *sys.argv]),
                "versions": {k: v for k, v in _versions().items() if k in ("python", "transformers")},
                "environment": {"PYTORCH_CUDA_ALLOC_CONF": None, "STUDIO_FAST_PATH": None},
                "models": models, "rows": entries}
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(made, indent=1) + "\n")
        print(f"wrote {json_out}")
    return 0


def score_committed(predictions: dict, measured: dict, bar: tuple[float, float] = BARS["families"]) -> dict:
    """The committed predictions (:func:`dry_run`'s file) against a measured file, row by row by
    label: the reserved error of each, and the median and worst over all rows and out of sample, each
    against ``bar`` (the largest median and worst absolute error that meet it)."""
    by_label = {r["label"]: r for r in measured["rows"] if "peak_reserved" in r.get("measured", {})}
    rows = []
    for entry in predictions["rows"]:
        got = by_label.get(entry["label"])
        if got is not None:
            error = entry["predicted"]["peak_reserved"] / got["measured"]["peak_reserved"] - 1
            load = got["measured"].get("load_peak_reserved", 0)
            rows.append({"label": entry["label"], "out_of_sample": entry["out_of_sample"], "reserved_error": error,
                         "path_agrees": entry["predicted"]["path"] == got["measured"]["path"],
                         # a peak no phase of the estimate models: the model's load (a mixture of experts'
                         # 16-bit experts before they are packed)
                         "load_sets_the_peak": load >= got["measured"]["peak_reserved"]})
    summary: dict = {"rows": len(rows), "of": len(predictions["rows"]), "paths_agree": sum(r["path_agrees"] for r in rows)}
    for part, chosen in (("all", rows), ("out_of_sample", [r for r in rows if r["out_of_sample"]])):
        errors = [abs(r["reserved_error"]) for r in chosen]
        if errors:
            summary[part] = {"median_abs_error": round(statistics.median(errors), 4),
                             "worst_abs_error": round(max(errors), 4),
                             "meets_bar": statistics.median(errors) <= bar[0] and max(errors) <= bar[1]}
    return {"rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="default",
                        help="the rows: the estimator's pinned grid, three rows a family (issue 39) or three rows "
                             "a mixture of experts (issue 42)")
    parser.add_argument("--out", default=None, help="where the measured file goes (default: tests/data/, by grid)")
    parser.add_argument("--commit", default=None, help="the commit of this tree (no git on the GPU box)")
    parser.add_argument("--steps", type=int, default=5, help="training steps a row")
    parser.add_argument("--parallel", type=int, default=3, help="rows at a time (peaks are per process)")
    parser.add_argument("--budget-s", type=float, default=420, help="start no row after this many seconds")
    parser.add_argument("--models-dir", default=None, help="where the models are built (default: a temp dir)")
    parser.add_argument("--only", default=None, help="only rows whose label holds one of these (comma-separated)")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU: the pipeline, no peaks")
    parser.add_argument("--dry-run", action="store_true", help="print the rows and today's predictions")
    parser.add_argument("--json", default=None, help="with --dry-run: also write the predictions to this file")
    parser.add_argument("--score", default=None, help="score a measured file with the estimator as it stands")
    parser.add_argument("--predictions", default=None,
                        help="with --score: also score this committed predictions file (--dry-run --json's)")
    parser.add_argument("--attribute", default=None,
                        help="rows whose label holds one of these (comma-separated) record the allocator's history "
                             "(on a GPU; slower): who held the memory at the peaks, in the row's measured "
                             "'attribution' (bench/mem_attribution.py)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-attribute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    if args.dry_run:
        return dry_run(args.grid, args.json, args.commit)
    if args.score:
        measured = json.loads(Path(args.score).read_text())
        print_score(score(measured))
        if args.predictions:
            committed = score_committed(json.loads(Path(args.predictions).read_text()), measured, BARS[args.grid])
            for r in committed["rows"]:
                print(f"{'OOS' if r['out_of_sample'] else '   '} {r['label']:62} committed estimate "
                      f"reserved {r['reserved_error']:+6.1%}{'' if r['path_agrees'] else '  PATH DIFFERS'}"
                      f"{'  THE LOAD SETS THE PEAK' if r['load_sets_the_peak'] else ''}")
            print(json.dumps({"committed_predictions": committed["summary"]}, indent=1))
        return 0
    args.out = args.out or str(GRIDS[args.grid][3])
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
