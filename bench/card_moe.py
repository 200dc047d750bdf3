"""Mixtures of experts on an emulated small card: gpt-oss-20b in 16 GB, Qwen3-30B-A3B in 24 GB, every
phase of a run through the product (issue 42).

bench/card16.py's method: a second process holds all of the GPU's free memory but the card's, then,
as a user would, ``studio train CONFIG --detach``, ``studio attach RUN`` (the steps, an evaluation
mid-run and at the end, the adapter save) and ``studio eval RUN --rows 1 --json`` (the answer after
training, by the worker that trained); the holder samples the card every 0.1 s, and the JSON says
what the card saw by phase (``card_used_bytes_by_phase``: Studio's allocator, CUDA context and all).

Cases (random weights in the real shapes of bench/moe_shapes.py, the tiny tokenizer beside them):

- ``gpt-oss``: gpt-oss-20b, seq 2048, micro-batch 1, on 16 GB (10^9 bytes, as card16's cases);
- ``qwen3-moe``: Qwen3-30B-A3B, seq 2048, micro-batch 1, on 24 GiB (a 24 GB card's 2^30 bytes).

Studio's defaults otherwise: NF4 (the experts packed in 4 bits), LoRA r16 on ``all-linear`` (the
attention projections of a model whose every MLP is sparse), two micro-batches a step, full-length
rows, an evaluation at step 2 and at the end, an answer to a prompt about a training row long.
``--card-gb`` / ``--card-gib`` set one card for every case of the call.

**What a fit on a subset means.** The whole Qwen3-30B-A3B is 61 GB in bf16 and gpt-oss-20b 42 GB: the
box's 64 GB disk holds the second and perhaps not the first (make_random_model.py's check says, and
``--layers fit``, the default, builds as many layers as the disk holds; a RAM-backed ``--models-dir
/dev/shm/...`` where the box has room). A subset's run is a smaller model's fit, not the real one's:
each case's ``fit`` says how many layers were built, whether the card's use is the real model's,
core/memory's estimate of the whole model and of the subset for the same run, and the whole model's
use extrapolated as the estimate scaled by its error on the subset (``extrapolated_full_fits``).
Weights generated in memory are no way round the disk here: Studio's worker loads a folder or a Hub
id (make_random_model.py). gpt-oss is refused by the estimator and by the fast path until it describes
the family: its case then runs the plain path (``path``, ``path_reason``) and has no estimate.

    # the GPU box, from the repository root (wheels as docs/testing.md says); models reused when there
    python3 bench/card_moe.py --only qwen3-moe --card-gib 24 --commit <sha> --out $OUT/card24_qwen3_moe.json
    python3 bench/card_moe.py --only gpt-oss --card-gb 16 --commit <sha> --out $OUT/card16_gpt_oss.json
    python3 bench/card_moe.py --dry-run      # each case's estimate, whole and as built (or --layers N); runs nothing
    python3 bench/card_moe.py --cpu --out /tmp/card_moe.json   # the pipeline on tiny shapes, no holder
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.card16 import (  # noqa: E402
    GB,
    _commit,
    _versions,
    predicted_plan,
    start_holder,
    through_the_product,
    write_sft_data,
)
from bench.make_random_model import (  # noqa: E402
    DISK_MARGIN,
    build_model,
    free_bytes,
    hf_config,
    layers_that_fit,
    read_build,
    sizes,
)
from bench.moe_shapes import HUB_IDS, MOE_MODELS, layer_subset, tiny  # noqa: E402

GIB = 2**30
CASES = {"gpt-oss": {"arch": "gpt-oss-20b", "card_bytes": 16 * GB},
         "qwen3-moe": {"arch": "qwen3-30b-a3b", "card_bytes": 24 * GIB}}
"""Each case's model (bench/moe_shapes.py) and the card issue 42 asks it to fit."""
SEQ, CPU_SEQ = 2048, 64
MODELS_DIR = Path("/tmp/models")


# ------------------------------------------------------------------------------------ the model


def existing_build(models_dir: Path, arch: str) -> tuple[int, Path] | None:
    """The complete build of ``arch`` in ``models_dir`` with the most layers, and its layers (None:
    none there)."""
    found = [(read_build(f), f) for f in models_dir.glob(f"{arch}*") if (f / "tokenizer.json").exists()]
    found = [(b["layers_built"], f) for b, f in found if b is not None and b["arch"] == arch]
    return max(found) if found else None


def model_folder(case: str, args: argparse.Namespace, env: dict) -> Path:
    """The case's model folder: on the CPU a tiny shape; else ``--layers`` of the real shape (``fit``:
    a build already there with the most layers, or as many as the disk holds), built unless there."""
    import subprocess

    arch = CASES[case]["arch"]
    models_dir = Path(args.models_dir)
    if args.cpu:
        return build_model(f"{arch}-tiny", tiny(MOE_MODELS[arch]), models_dir / f"{arch}-tiny")
    layers = args.layers
    if layers == "fit":
        layers = layers_that_fit(sizes(MOE_MODELS[arch]), free_bytes(models_dir)) or 1
        there = existing_build(models_dir, arch)
        if there is not None and there[0] >= layers:  # the disk it takes is not free: reuse it
            return there[1]
    layers = min(int(layers), int(MOE_MODELS[arch]["num_hidden_layers"]))
    whole = layers >= int(MOE_MODELS[arch]["num_hidden_layers"])
    folder = models_dir / (arch if whole else f"{arch}-l{layers}")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "make_random_model.py"), "--arch", arch, "--layers",
                           str(layers), "--out", str(folder)], env=env, capture_output=True, text=True)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1][:600])
    return folder


# ------------------------------------------------------------------------------------ the case


def case_config(model: Path, data: Path, runs: Path, steps: int, seq: int) -> dict:
    """The run config of a case: Studio's defaults but seq, micro-batch 1, two micro-batches a step and
    an evaluation every 2 steps."""
    return {"model": {"base_model": str(model)}, "data": {"path": str(data), "max_seq_length": seq},
            "output_dir": str(runs), "prompt": {"template": "{instruction}\n{output}"},
            "trainer": {"max_steps": steps, "eval_interval": 2, "micro_batch_size": 1, "effective_batch_size": 2}}


def estimated_total(config_path: Path, model_config: dict, name: str) -> int | str:
    """core/memory's estimate (peak reserved plus the CUDA context: what the card holds) of the run
    config on a model with ``model_config`` (config.json's values), or why it has none."""
    from studio.core.config import load_config
    from studio.core.memory import estimate
    from studio.core.model.info import ModelInfoError, from_config_dict

    try:
        return estimate(load_config(config_path), from_config_dict(dict(model_config), name)).total
    except (ModelInfoError, ValueError) as exc:
        return str(exc)


def fit_report(arch: str, folder: Path, config_path: Path, card: int, used: dict[str, int]) -> dict:
    """What the case's fit means: the layers built of the model's, whether the card's use is the real
    model's, the estimate of the whole model and of the build, and the whole model's use extrapolated
    from the build's (the estimate scaled by its error on the build)."""
    build = read_build(folder) or {}
    est_built = estimated_total(config_path, json.loads((folder / "config.json").read_text()), str(folder))
    est_whole = estimated_total(config_path, hf_config(MOE_MODELS[arch]).to_dict(), HUB_IDS[arch])
    most = max(used.values()) if used else None
    out: dict = {"layers": f"{build.get('layers_built')} of {build.get('layers_real')}",
                 "full_model": build.get("full_model"), "card_bytes": card, "card_used_most_bytes": most,
                 "estimate_built_bytes": est_built, "estimate_full_bytes": est_whole,
                 "full_model_bf16_bytes": build.get("full_model_bytes_bf16"),
                 "disk_free_before_build_bytes": build.get("free_bytes_before")}
    if build.get("full_model"):
        out["meaning"] = (f"the whole {build.get('arch', arch)}: the card's use by phase is the real model's fit "
                          "(random weights)")
        return out
    words = [f"{out['layers']} layers of {arch}: the card's use is a {build.get('layers_built')}-layer model's, "
             "not the whole model's"]
    if isinstance(est_built, int) and isinstance(est_whole, int) and most is not None:
        out["extrapolated_full_bytes"] = round(est_whole * most / est_built)
        out["extrapolated_full_fits"] = out["extrapolated_full_bytes"] <= card
        words.append(f"the whole model's is estimated at {out['extrapolated_full_bytes'] / 1e9:.1f} GB of the card's "
                     f"{card / 1e9:.1f} (the estimate scaled by its error on this build)")
    else:
        words.append(f"no estimate of the whole model's ({est_whole if isinstance(est_whole, str) else est_built})")
    need, free = build.get("full_model_bytes_bf16"), build.get("free_bytes_before")
    if need is not None and free is not None:
        checkable = need + DISK_MARGIN <= free
        out["full_model_checkable_on_this_disk"] = checkable
        words.append(f"the whole model is {need / 1e9:.0f} GB in bf16 and {free / 1e9:.0f} GB was free where it was "
                     f"built: {'--layers ' + str(build.get('layers_real')) + ' would check it' if checkable else 'its own fit cannot be checked on this disk'}")
    out["meaning"] = "; ".join(words)
    return out


def run_case(case: str, folder: Path, work: Path, env: dict, args: argparse.Namespace, card: int,
             samples: Path, free_at_start: int) -> dict:
    """One case end to end: its data and config, the predicted plan, the run through the product, the fit."""
    import yaml

    here = work / case
    here.mkdir(parents=True, exist_ok=True)
    seq = CPU_SEQ if args.cpu else SEQ
    data = here / "data.jsonl"
    write_sft_data(data, folder, seq, args.steps)
    config = case_config(folder, data, here / "runs", args.steps, seq)
    config_path = here / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry: dict = {"model": str(folder), "arch": CASES[case]["arch"], "build": read_build(folder),
                   "card_bytes": card, "steps_asked": args.steps, "config": config}
    if not args.cpu:
        try:
            entry["predicted_plan"] = predicted_plan(config_path, card)
        except Exception as exc:  # noqa: BLE001 - the estimator refusing the model is the result's note
            entry["predicted_plan"] = {"error": f"{type(exc).__name__}: {exc}"}
    entry = through_the_product(entry, config_path, here, args.steps, env, args.case_timeout_s, samples, free_at_start)
    entry["fit"] = fit_report(CASES[case]["arch"], folder, config_path, card, entry.get("card_used_bytes_by_phase", {}))
    if "every_phase_finished" in entry and not args.cpu:  # issue 42's bar is the whole model's fit
        entry["meets_bar"] = entry["every_phase_finished"] if entry["fit"].get("full_model") else None
    return entry


# ------------------------------------------------------------------------------------ the driver


def card_for(case: str, args: argparse.Namespace) -> int:
    """The card a case runs on: ``--card-gb`` / ``--card-gib`` when given, else the case's own."""
    if args.card_gb is not None:
        return int(args.card_gb * GB)
    if args.card_gib is not None:
        return int(args.card_gib * GIB)
    return CASES[case]["card_bytes"]


def dry_run(args: argparse.Namespace) -> int:
    """Each case's estimate on its card: the whole model, and the build (``--layers``, default what
    the disk at ``--models-dir`` holds)."""
    import yaml

    with tempfile.TemporaryDirectory() as work:
        for case in args.only.split(","):
            arch = CASES[case]["arch"]
            shape = MOE_MODELS[arch]
            sized = sizes(shape)
            layers = args.layers if args.layers != "fit" else layers_that_fit(sized, free_bytes(Path(args.models_dir)))
            path = Path(work) / f"{case}.yaml"
            path.write_text(yaml.safe_dump(case_config(Path(work) / arch, Path(work) / "d.jsonl", Path(work) / "runs",
                                                       args.steps, SEQ)))
            whole = estimated_total(path, hf_config(shape).to_dict(), HUB_IDS[arch])
            built = estimated_total(path, hf_config(layer_subset(shape, max(1, int(layers)))).to_dict(), arch)
            card = card_for(case, args)
            print(json.dumps({"case": case, "card_bytes": card, "whole_estimate_bytes": whole,
                              "layers": f"{layers} of {sized['layers']}", "built_estimate_bytes": built,
                              "whole_bf16_bytes": sized["total_bytes"]}))
    return 0


def _layers(value: str) -> int | str:
    return value if value == "fit" else int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--only", default=",".join(CASES), help=f"the cases, comma-separated: {', '.join(CASES)}")
    parser.add_argument("--commit", help="the commit this tree is (git on the GPU box answers a stale one)")
    cards = parser.add_mutually_exclusive_group()
    cards.add_argument("--card-gb", type=float, help="the card for every case, in GB (10^9 bytes)")
    cards.add_argument("--card-gib", type=float, help="the card for every case, in GiB (2^30 bytes)")
    parser.add_argument("--layers", type=_layers, default="fit",
                        help="layers of each model to build: a number, or fit (a build there with the most layers, "
                             "else as many as the disk holds)")
    parser.add_argument("--models-dir", default=str(MODELS_DIR), help="where the models are built (reused when there)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps a case")
    parser.add_argument("--case-timeout-s", type=float, default=300.0,
                        help="a case's training and answer together; past it the run is stopped")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU, no holder: the pipeline")
    parser.add_argument("--dry-run", action="store_true", help="print each case's estimates; run nothing")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}: {', '.join(CASES)}")
    if args.dry_run:
        return dry_run(args)
    if not args.out:
        parser.error("--out is required")
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="card_moe_"))
    if args.cpu:
        args.models_dir = str(work / "models")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "STUDIO_WORKER_LINGER": "300"}  # the worker waits for studio eval after training
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "STUDIO_FAST_PATH"):  # the engine's own defaults
        env.pop(key, None)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result: dict = {"what": "a mixture of experts at seq 2048 micro-batch 1 and every phase of a run (steps, "
                            "evaluation, the answer after training) through studio train --detach / attach / eval, "
                            "with another process holding all of the GPU but the case's card; cases.<case>.fit says "
                            "whether the model was whole or a subset of its layers, and what the fit then means",
                    "command": " ".join(["python3", "bench/card_moe.py", *(sys.argv[1:] if argv is None else argv)]),
                    "commit": _commit(args.commit), "versions": _versions(), "cpu_only": args.cpu,
                    "work": str(work), "cases": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        result["wall_s"] = round(time.time() - start, 1)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    for case in cases:
        t0 = time.time()
        try:
            folder = model_folder(case, args, env)  # built before the holder takes the card
        except Exception as exc:  # noqa: BLE001 - a build refused for the disk is the case's result
            result["cases"][case] = {"error": f"the model did not build: {exc}"}
            write()
            continue
        build_s = round(time.time() - t0, 1)
        card = card_for(case, args)
        samples = work / f"card_samples_{case}.txt"
        holder, free_at_start = None, 0
        if not args.cpu:
            holder, held = start_holder(card, samples, env)
            result.update(gpu=held["gpu"])
            free_at_start = held["free_after_bytes"]
        else:
            result["gpu"] = "cpu"
        try:
            entry = run_case(case, folder, work, env, args, card, samples, free_at_start)
            entry["build_s"] = build_s
            if holder is not None:
                entry["holder"] = held
            result["cases"][case] = entry
        finally:
            if holder is not None:
                holder.terminate()  # the holder this script started
                holder.wait(timeout=30)
            write()
        fit = entry.get("fit", {})
        print(f"{case}: finished every phase: {entry.get('every_phase_finished')}; path {entry.get('path')}; "
              f"{fit.get('layers')} layers; card used by phase (GB) "
              f"{json.dumps({k: round(v / GB, 2) for k, v in entry.get('card_used_bytes_by_phase', {}).items()})} of "
              f"{card / GB:.2f}; {fit.get('meaning')}; {entry.get('error') or ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
