"""Which change moves Studio's per-step losses away from the HF loop's: the Trainer on the same
recorded batches, once per variant, each against a baseline's losses already measured.

The HF + PEFT loop's losses on bench/speed.py's recorded batches are reproducible between machines
(to about 2e-4 relative), so they are read from a committed speed.py result instead of re-run.
A variant is either some ``trainer.fast_path`` settings switched (``name=JSON``, core/config/sections.py's
FastPathConfig) or another checkout of the code (``name=@folder``: that folder's studio/ and bench/
run instead of these; the way to compare with an order of the engine that is gone):

    python3 bench/loss_bisect.py --model /tmp/llama2-7b-random --baseline bench/results/archive/h100_v9_losses_vs_hf.json \\
        --variant 'now={}' --variant 'no_kernels={"kernels": false}' --variant 'v7=@/tmp/v7' --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TEMPLATE = "{instruction}\n{output}"


def run_variant(args, common: list[str], name: str, spec: str, data: Path) -> dict:
    code = Path(spec[1:]) if spec.startswith("@") else Path(__file__).resolve().parent.parent
    out = Path(args.work) / f"variant_{name}.json"
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(code / "bench" / "speed.py"), "--worker", "trainer", *common, "--work", str(work),
           "--json", str(out), "--workload", f"{args.workload}:{data}:{args.micro_batch}:{TEMPLATE}"]
    if not spec.startswith("@") and spec not in ("", "{}"):
        cmd += ["--fast-options", spec]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                     .split(os.pathsep) if p]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        return {"spec": spec, "failed": proc.returncode, "wall_s": wall, "stderr": proc.stderr[-2000:]}
    result = json.loads(out.read_text())
    return {"spec": spec, "wall_s": wall, "losses": result["losses"], "tokens_per_s": result["tokens_per_s"],
            "fast_path": result.get("fast_path")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/llama2-7b-random")
    parser.add_argument("--baseline", required=True, help="a bench/speed.py result with runs.baseline's losses")
    parser.add_argument("--workload", default="fixed_mb4")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    # speed.py's recipe (its defaults): the recorded batches and the baseline's losses depend on them
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--tokenizer", default="", help="for the model when it has to be built")
    parser.add_argument("--variant", action="append", default=[], help="name=trainer.fast_path JSON, or name=@folder")
    parser.add_argument("--work", default="/tmp/loss-bisect")
    parser.add_argument("--out", required=True)
    parser.add_argument("--code", default="")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    from bench.speed import _workers_setup, long_rows, loss_agreement, versions

    _, work, common, _ = _workers_setup(args)  # builds the random model when it is missing
    data = work / "long.jsonl"
    long_rows(data, 104, args.seed)  # speed.py's own rows and seed: the recorded batches are the same
    baseline = json.loads(Path(args.baseline).read_text())["runs"]["baseline"]["workloads"][args.workload]["losses"]
    results: dict = {"what": "per-step losses of Studio's Trainer per variant against the HF loop's "
                             f"(from {args.baseline}) on the same batches",
                     "code": args.code, "command": " ".join(sys.argv), "workload": args.workload,
                     "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "versions": versions(),
                     "baseline_losses": baseline, "variants": {}}
    for item in args.variant:
        name, _, spec = item.partition("=")
        out = run_variant(args, common, name, spec, data)
        if "losses" in out:
            out.update(loss_agreement(out["losses"], baseline))
            print(f"{name}: max {out['loss_max_rel_diff']:.4f} mean {out['loss_mean_rel_diff']:.4f} "
                  f"signed {out['loss_mean_signed_rel_diff']:+.4f} ({out['tokens_per_s']:.0f} tok/s)", flush=True)
        results["variants"][name] = out
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
