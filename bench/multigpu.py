"""Data-parallel scaling: Studio's tokens/s on 1 GPU vs N GPUs (default 2), in one call.

On a machine with two GPUs (nvidia-h200-x2), with bitsandbytes and liger-kernel as wheels:

    python bench/multigpu.py --out bench/results/current --steps 30

It builds the random Llama-2-7B if missing (bench/make_random_model.py), writes rows longer than 512
tokens (so every packed row is one 512-token example), and for micro-batch 4 and 16 trains Studio's
Session + Trainer (NF4 double quant, LoRA r16 alpha 32 on every linear layer, dropout 0, AdamW,
checkpointing, constant learning rate) on 1 process, then on N processes started by torchrun, each
GPU with the same micro-batch (accumulation 1: the effective batch is micro-batch x N). Ranks > 0 run
``studio.engine.session.follow``, as under ``studio train --gpus N``. tokens/s is counted over every
rank's tokens after ``--warmup-steps`` steps (CUDA-graph capture and the first steps' allocations
excluded). It writes ``multigpu.json``: per run tokens/s, per-rank peak reserved memory, losses; the
summary's ``scaling`` (tokens/s on N over tokens/s on 1, per micro-batch); the GPUs, the versions
(NCCL's included) and the exact command.

``--tiny`` checks the script on a CPU: the tiny test model, two gloo processes, a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 512
MICRO_BATCHES = (4, 16)


def bench_config(args: argparse.Namespace, data: Path, micro: int, gpus: int):
    """The run config of one measurement."""
    from studio.core.config import RunConfig

    config = RunConfig()
    config.model.base_model = args.model
    config.quantization.bits = None if args.tiny else 4
    config.lora.r, config.lora.alpha, config.lora.dropout, config.lora.target_modules = 16, 32, 0.0, "all-linear"
    config.prompt.template = "{instruction}\n{output}"
    config.data.path, config.data.max_seq_length, config.data.val_fraction = str(data), args.seq, 0.02
    t = config.trainer
    t.max_steps, t.micro_batch_size, t.effective_batch_size = args.steps, micro, micro
    t.learning_rate, t.scheduler, t.warmup_fraction, t.optimizer = 2e-4, "constant", 0.0, "adamw"
    t.gradient_checkpointing, t.packing, t.seed = True, True, args.seed
    t.eval_interval, t.eval_max_rows, t.checkpoint_interval, t.log_interval = 0, 8, 0, 1
    config.distributed.gpus = gpus
    config.output_dir = str(Path(args.work) / "runs")
    return config


def rank_worker(args: argparse.Namespace) -> int:
    """One process of one measurement (under torchrun when N > 1): rank 0 trains and writes the JSON."""
    from bench.speed import fast_facts
    from studio.core import events as ev
    from studio.core.runs import RunDir
    from studio.engine import distributed
    from studio.engine.session import Session, follow

    run = RunDir(Path(args.run_dir))
    group = distributed.current()
    if not group.leader:
        follow(run)
        return 0
    steps: list[ev.StepLogged] = []
    peaks: dict[int, int] = {}
    notes: list[str] = []

    def emit(event: ev.Event) -> None:
        if isinstance(event, ev.StepLogged):
            steps.append(event)
        elif isinstance(event, ev.MemorySampled):
            peaks[event.rank] = max(peaks.get(event.rank, 0), event.peak_reserved)
        elif isinstance(event, ev.WorkerFailed):
            notes.append(event.message)
            print(f"rank 0: {event.message}", flush=True)

    session = Session(run.config(), run, emit)
    try:
        session.load()
        session.train()
    finally:
        group.instruct({"do": "exit"})
        group.close()
    warm = min(args.warmup_steps, len(steps) - 1)
    first, last = steps[warm - 1] if warm else None, steps[-1]
    tokens = last.tokens_seen - (first.tokens_seen if first else 0)
    seconds = last.elapsed_s - (first.elapsed_s if first else 0.0)
    result = {"processes": group.world, "tokens_per_s": tokens / max(seconds, 1e-9),
              "timed_steps": len(steps) - warm, "losses": [e.loss for e in steps],
              "peak_reserved_gib_by_rank": {str(r): p / 2**30 for r, p in sorted(peaks.items())},
              "fast_path": fast_facts(session.fast), "notes": notes}
    Path(args.json).write_text(json.dumps(result))
    print(f"{group.world} process(es), micro-batch {run.config().trainer.micro_batch_size}: "
          f"{result['tokens_per_s']:.0f} tokens/s {json.dumps(result['fast_path'])}", flush=True)
    return 0


def versions() -> dict[str, str]:
    """Versions of what decides the result, NCCL's included."""
    import torch

    from bench.speed import versions as package_versions

    out = package_versions()
    nccl = getattr(torch.cuda, "nccl", None)
    try:
        out["nccl"] = ".".join(map(str, nccl.version())) if nccl is not None and torch.cuda.is_available() else "-"
    except Exception:  # noqa: BLE001 - a torch without NCCL
        out["nccl"] = "missing"
    return out


def driver(args: argparse.Namespace) -> int:
    """Every measurement, one process set at a time, then the JSON."""
    import torch

    from bench.speed import long_rows
    from studio.core.runs import create_run

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not args.tiny and len(gpus) < args.gpus:
        print(f"error: {args.gpus} GPUs needed, {len(gpus)} visible; run on nvidia-h200-x2 (or use --tiny)",
              file=sys.stderr)
        return 1
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from studio.engine.tiny import build_tiny_model

        args.model = str(build_tiny_model())
    elif not (Path(args.model) / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench/make_random_model.py"), "--out", args.model], check=True)
    data = long_rows(work / "long.jsonl", max(MICRO_BATCHES) * args.gpus * args.steps + 64, args.seed)
    # This checkout first, then whatever the caller put there (wheels unpacked into a folder).
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if args.tiny:
        env.update(STUDIO_DEVICE="cpu", STUDIO_DISTRIBUTED_CPU="1", OMP_NUM_THREADS="1")
    report: dict = {"command": " ".join(shlex.quote(a) for a in sys.argv), "gpus": gpus or ["cpu"],
                    "versions": versions(), "steps": args.steps, "warmup_steps": args.warmup_steps, "seq": args.seq,
                    "model": "tiny test model" if args.tiny else "Llama-2-7B shape, random weights, NF4",
                    "lora": "r16 alpha 32 all-linear, dropout 0", "runs": {}}
    for micro in MICRO_BATCHES:
        for processes in (1, args.gpus):
            name = f"mb{micro}_gpus{processes}"
            config = bench_config(args, data, micro, processes)
            run = create_run(config, work / "runs")
            out_json = work / f"{name}.json"
            worker = [str(ROOT / "bench/multigpu.py"), "--rank-worker", "--run-dir", str(run.path), "--json",
                      str(out_json), "--warmup-steps", str(args.warmup_steps)]
            launch = [sys.executable, *worker] if processes == 1 else \
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                 *worker]
            print(f"--- {name}: {' '.join(launch)}", flush=True)
            subprocess.run(launch, check=True, env=env)
            report["runs"][name] = json.loads(out_json.read_text())
    report["summary"] = summarize(report["runs"], args.gpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("multigpu_tiny.json" if args.tiny else "multigpu.json")
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {path}")
    return 0


def summarize(runs: dict, gpus: int) -> dict:
    """tokens/s on N over tokens/s on 1 per micro-batch, and how far the first losses agree (the
    same first rows: N processes see micro-batch x N rows a step, so only step 1's rows are shared)."""
    scaling, tokens = {}, {}
    for micro in MICRO_BATCHES:
        one, many = runs.get(f"mb{micro}_gpus1"), runs.get(f"mb{micro}_gpus{gpus}")
        if one and many:
            scaling[f"mb{micro}"] = round(many["tokens_per_s"] / one["tokens_per_s"], 3)
            tokens[f"mb{micro}"] = {"1": round(one["tokens_per_s"], 1), str(gpus): round(many["tokens_per_s"], 1)}
    return {"gpus": gpus, "scaling": scaling, "tokens_per_s": tokens, "target": 1.85,
            "meets_target": bool(scaling) and all(v >= 1.85 for v in scaling.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/current")
    parser.add_argument("--work", default="/tmp/studio-multigpu")
    parser.add_argument("--model", default="/tmp/llama2-7b-random")
    parser.add_argument("--gpus", type=int, default=2, help="N of the N-GPU runs (default 2)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--tiny", action="store_true", help="check the script on a CPU: tiny model, gloo, few steps")
    parser.add_argument("--rank-worker", action="store_true", help="internal: one process of one measurement")
    parser.add_argument("--run-dir", default="", help="internal: the run directory of the measurement")
    parser.add_argument("--json", default="", help="internal: where rank 0 writes its numbers")
    args = parser.parse_args()
    args.seq = 64 if args.tiny else SEQ
    if args.tiny and args.steps == parser.get_default("steps"):
        args.steps, args.warmup_steps = 6, 2
    return rank_worker(args) if args.rank_worker else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
