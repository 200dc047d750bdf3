"""Where the GPU waits inside Studio's Trainer: two of its steps profiled, the compute stream's idle
time by size and by the kernel (and host operator) that came after each gap, beside the step's wall
time. Issue 13's table measures Studio through the Trainer, and its rate has run ~2% under the
profile harness's own loop (bench/profile_gpu_bound.py) on the same machine: this shows what the
Trainer's host work between and inside steps costs the GPU.

The run is bench/engines.run_trainer's (Llama-2-7B shape, random weights, NF4, LoRA r16 on all
projections, full-length rows), with the profiler started and stopped from the optimizer update of
the steps around the window.

    python3 bench/trainer_gaps.py --out bench/results/x.json --tokenizer bench-tokenizer [--workload 512x16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The allocator Studio's engine sets up (bench/vram_accuracy.py, imported below, defaults to the other)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from bench.profile_gpu_bound import compute_stream_gaps  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workload", default="512x16", help="SEQxMB")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--profile-from", type=int, default=9, help="the step whose update starts the profile")
    parser.add_argument("--arch", default="llama2-7b", help="bench/vram_accuracy.py's ARCHS (tiny: a CPU dry run)")
    parser.add_argument("--models-dir", default="/tmp/models")
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args()

    import torch

    import studio.engine.train as train
    from bench.engines import run_trainer
    from bench.make_random_model import _copy_tokenizer
    from bench.vram_accuracy import Case, build_model
    from studio.core.vram import ALL_LINEAR

    seq, mb = (int(x) for x in args.workload.split("x"))
    folder = Path(args.models_dir) / args.arch
    build_model(args.arch, folder)
    _copy_tokenizer(folder, Path(args.tokenizer) if args.tokenizer else None)
    cuda = torch.cuda.is_available()
    case = Case(arch=args.arch, weights="nf4" if cuda else "bf16", r=16, targets=ALL_LINEAR, seq=seq, micro_batch=mb,
                checkpointing=True, expandable=True, engine="trainer")
    trace = Path(tempfile.mkdtemp(prefix="trainer_gaps_")) / "trace.json"
    window: dict = {}
    real_update = train.Trainer.update

    def update(self, params):
        # Called once a step, after its backward was queued: the window spans from here at step
        # ``profile_from`` to here two steps later, so it holds two steps' worth of everything.
        out = real_update(self, params)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if self.step + 1 == args.profile_from:
            sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            window["prof"] = torch.profiler.profile(
                activities=activities + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            window["prof"].__enter__()
            window["t0"] = time.perf_counter()
        elif self.step + 1 == args.profile_from + 2 and "prof" in window:
            sync()
            window["wall_ms"] = (time.perf_counter() - window["t0"]) * 1000
            window["prof"].__exit__(None, None, None)
            window["prof"].export_chrome_trace(str(trace))
        return out

    train.Trainer.update = update
    work = Path(tempfile.mkdtemp(prefix="trainer_gaps_run_"))
    row = run_trainer(case, folder, args.steps, 3, work)
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name() if cuda else "cpu",
              "versions": {"torch": torch.__version__}, "workload": args.workload,
              "tokens_per_s": row.get("tokens_per_s"), "fast_path": row.get("fast_path"),
              "notes": row.get("notes"), "profiled_wall_ms_per_step": round(window.get("wall_ms", 0) / 2, 2)}
    if trace.exists():
        result["compute_stream"] = compute_stream_gaps(trace, 2)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "compute_stream"}), flush=True)
    stream = result.get("compute_stream", {})
    print({k: stream.get(k) for k in ("busy_ms_per_step", "idle_ms_per_step", "idle_by_size_ms_per_step",
                                      "idle_10us_up_by_cause_ms_per_step")}, flush=True)
    for entry in stream.get("idle_before_ms_per_step", [])[:12]:
        print(entry, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
