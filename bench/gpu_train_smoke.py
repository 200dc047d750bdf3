"""GPU smoke test of `studio train`: 4-bit NF4 QLoRA on the SmolLM2-135M and Llama-2-7B architectures.

No weights can be downloaded on the GPU machine, so both models are built there with random weights
(bench/make_random_model.py) and saved to /tmp; then the real command line trains each for a few
steps on the bundled sample config, and the run's events (tokens/s, memory) are summarised as JSON:

    python bench/gpu_train_smoke.py --out bench/results/current/gpu_train_smoke.json

Run it from the repository root on a CUDA machine. Each training command and its exit code is in the
summary, so a failure is reported rather than hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from studio.core import events as ev  # noqa: E402
from studio.core.runs import iter_events  # noqa: E402

CONFIG = "sample_data/sample_config.yaml"
MODELS = {"smollm2-135m": "/tmp/studio-smoke/smollm2-135m-random",
          "llama2-7b": "/tmp/studio-smoke/llama2-7b-random"}


def versions() -> dict[str, str]:
    """Versions of the libraries that decide speed and memory."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "transformers": transformers.__version__, "peft": peft.__version__,
            "bitsandbytes": bitsandbytes.__version__}


def gpu() -> dict[str, object]:
    import torch

    if not torch.cuda.is_available():
        return {"name": None}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_bytes": props.total_memory}


def summarize(run_dir: Path) -> dict[str, object]:
    """Tokens/s, memory and timings from a run's events.jsonl."""
    events = list(iter_events(run_dir / "events.jsonl"))
    steps = [e for e in events if isinstance(e, ev.StepLogged)]
    memory = [e for e in events if isinstance(e, ev.MemorySampled)]
    loaded = next((e for e in events if isinstance(e, ev.ModelLoaded)), None)
    failed = [e.to_dict() for e in events if isinstance(e, ev.WorkerFailed)]
    # The first steps include CUDA warm-up and allocator growth: report the steady state separately.
    steady = steps[len(steps) // 3:] if len(steps) >= 3 else steps
    return {
        "run_dir": str(run_dir),
        "steps": len(steps),
        "losses": [round(e.loss, 4) for e in steps],
        "tokens_per_s_mean_steady": (sum(e.tokens_per_s for e in steady) / len(steady)) if steady else None,
        "tokens_per_s": [e.tokens_per_s for e in steps],
        "elapsed_s": steps[-1].elapsed_s if steps else None,
        "peak_allocated_bytes": max((m.peak_allocated for m in memory), default=None),
        "peak_reserved_bytes": max((m.peak_reserved for m in memory), default=None),
        "capacity_bytes": memory[-1].capacity if memory else None,
        "memory_last": memory[-1].to_dict() if memory else None,
        "model_loaded": loaded.to_dict() if loaded else None,
        "failures": failed,
        "finished": any(isinstance(e, ev.TrainingFinished) for e in events),
    }


def train(model_dir: str, max_steps: int, runs_root: Path) -> dict[str, object]:
    """Run `studio train` on the sample config with ``--model model_dir``; returns the summary."""
    command = [sys.executable, "-m", "studio.cli", "train", CONFIG, "--model", model_dir,
               "--max-steps", str(max_steps)]
    before = set(runs_root.glob("*")) if runs_root.exists() else set()
    start = time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    result: dict[str, object] = {"command": " ".join(command), "exit_code": done.returncode,
                                 "wall_s": round(time.time() - start, 1),
                                 "stdout_tail": done.stdout[-3000:], "stderr_tail": done.stderr[-3000:]}
    new = sorted(set(runs_root.glob("*")) - before)
    if new:
        result.update(summarize(new[-1]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON summary")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--arch", choices=sorted(MODELS), action="append",
                        help="only these architectures (default: both)")
    args = parser.parse_args()

    from make_random_model import build

    summary: dict[str, object] = {"script": "bench/gpu_train_smoke.py", "argv": sys.argv, "gpu": gpu(),
                                  "versions": versions(), "config": CONFIG, "quantization": "4-bit nf4",
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "models": {}}
    for arch in args.arch or list(MODELS):
        folder = Path(MODELS[arch])
        t0 = time.time()
        build(arch, folder)
        print(f"{arch}: model ready in {time.time() - t0:.0f} s; training {args.max_steps} steps", flush=True)
        result = train(str(folder), args.max_steps, REPO / "runs")
        result["build_s"] = round(time.time() - t0 - float(result["wall_s"]), 1)
        summary["models"][arch] = result
        print(f"{arch}: exit {result['exit_code']}, {result.get('tokens_per_s_mean_steady')} tokens/s, "
              f"peak {result.get('peak_allocated_bytes')} bytes", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str))  # after each model: partial results survive
    ok = all(m["exit_code"] == 0 for m in summary["models"].values())
    print(f"summary written to {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
