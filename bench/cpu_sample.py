"""The bundled sample config on a CPU: how long `studio` takes to fine-tune it, and what it gains.

Runs the config exactly as bare `studio` opens it (studio/cli/app.initial_config: the bundled
sample_data/sample_config.yaml, its data path made absolute) through `studio train` with CUDA hidden,
then `studio eval` on held-out rows (base vs fine-tuned answers, greedy). Writes one JSON with the
command, the machine (CPU model, cores usable, load average before / during / after: this machine
may be shared), the package versions, the training's wall and CPU seconds, the base model's eval
loss at step 0 and the fine-tune's at the end, and the held-out totals.

    python bench/cpu_sample.py --threads 2 --rows 20 --out bench/results/current/cpu_sample_smollm2.json
    python bench/cpu_sample.py --held-out-only RUN_DIR --rows 8   # redo the comparison of a run

A loaded machine stretches wall time, not CPU time: ``estimated_wall_s_on_idle_cores`` divides the
training's CPU seconds by the threads used, what the same work takes on that many idle cores. With
two threads on a busy machine, each thread also burns CPU time waiting for the other (OpenMP spins),
so a shared machine is measured with ``--threads 1``:

    python bench/cpu_sample.py --threads 1 --rows 4 --out bench/results/current/cpu_sample_smollm2_1thread.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "tokenizers", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


class LoadSampler:
    """The 1-minute load average every few seconds while a command runs."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[float] = []
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _timed(cmd: list[str], env: dict[str, str], log: Path) -> dict:
    """Run ``cmd``; wall and CPU seconds (its whole process tree), load averages, exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    with LoadSampler() as load, open(log, "w") as out:
        code = subprocess.call(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    samples = load.samples or [os.getloadavg()[0]]
    return {"exit_code": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "load_avg_1m_mean": round(sum(samples) / len(samples), 2), "load_avg_1m_max": round(max(samples), 2)}


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _python(threads: int) -> list[str]:
    """``studio`` pinned to ``threads`` cores, as on a small laptop, when this machine has more."""
    cores = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", ",".join(str(c) for c in cores[:threads])]
    if len(cores) <= threads or not Path("/usr/bin/taskset").exists():
        pin = []
    return [*pin, sys.executable, "-m", "studio.cli"]


def _held_out(python: list[str], env: dict[str, str], run_dir: Path, rows: int) -> dict:
    """``studio eval`` on the run: base vs fine-tuned answers on held-out rows, timed."""
    scored = _timed([*python, "eval", str(run_dir), "--rows", str(rows), "--json",
                     "--runs-dir", str(run_dir.parent)], env, run_dir.parent.parent / "eval.log")
    report = json.loads((run_dir / "eval.json").read_text()) if (run_dir / "eval.json").exists() else {}
    held_out = {**scored, "command": " ".join([*python, "eval", str(run_dir), "--rows", str(rows)]),
                "rows": report.get("rows"), "split": report.get("split"), "base": report.get("base"),
                "fine_tuned": report.get("fine_tuned")}
    if report.get("results"):
        first = report["results"][0]
        held_out["example"] = {k: first[k] for k in ("target", "base", "tuned")}
    return held_out


def held_out_only(run_dir: Path, args: argparse.Namespace) -> int:
    """Redo the held-out comparison of a finished run and store it in ``args.out``'s JSON."""
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result["held_out"] = _held_out(_python(args.threads), _env(args.threads), run_dir, args.rows)
    result["held_out"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["held_out_command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["held_out"], indent=1))
    return 0 if result["held_out"].get("fine_tuned") else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    parser.add_argument("--rows", type=int, default=20, help="held-out rows to compare (default 20)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/current/cpu_sample_smollm2.json"))
    parser.add_argument("--held-out-only", metavar="RUN_DIR",
                        help="only (re)do the held-out comparison of this finished run, into --out's JSON")
    args = parser.parse_args()
    if args.held_out_only:
        return held_out_only(Path(args.held_out_only), args)

    from studio.cli.app import initial_config
    from studio.core.events import EvalLogged, TrainingFinished, from_json

    config, _ = initial_config(None, None)
    work = Path(tempfile.mkdtemp(prefix="studio-cpu-sample-"))
    config_path = work / "sample_config.yaml"
    config.output_dir = str(work / "runs")
    config.save(config_path)
    env = _env(args.threads)
    python = _python(args.threads)
    load_before = os.getloadavg()

    train = _timed([*python, "train", str(config_path)], env, work / "train.log")
    runs = sorted((work / "runs").iterdir())
    run_dir = runs[-1] if runs else None
    events = [from_json(line) for line in (run_dir / "events.jsonl").read_text().splitlines()] if run_dir else []
    evals = [e for e in events if isinstance(e, EvalLogged)]
    finished = next((e for e in events if isinstance(e, TrainingFinished)), None)

    held_out = _held_out(python, env, run_dir, args.rows) if run_dir is not None and finished is not None else {}

    result = {
        "bench": "cpu_sample",
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "commit": _commit(),
        "what": "bundled sample config as `studio` opens it, trained by `studio train` on the CPU "
                "(CUDA hidden), then `studio eval` on held-out rows",
        "machine": {"cpu": _cpu_model(), "cores_visible": os.cpu_count(), "threads": args.threads,
                    "pinned_to": python[2] if python[0] == "taskset" else "not pinned (all visible cores)",
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                    "platform": platform.platform()},
        "versions": _versions(),
        "config": {"base_model": config.model.base_model, "quantization_bits": config.quantization.bits,
                   "on_cpu": config.quantization.on_cpu, "sample_ratio": config.data.sample_ratio,
                   "max_seq_length": config.data.max_seq_length, "epochs": config.trainer.epochs,
                   "learning_rate": config.trainer.learning_rate,
                   "effective_batch_size": config.trainer.effective_batch_size,
                   "eval_max_rows": config.trainer.eval_max_rows,
                   "gradient_checkpointing": config.trainer.gradient_checkpointing},
        "train": {**train, "estimated_wall_s_on_idle_cores": round(train["cpu_s"] / max(1, args.threads), 1),
                  "steps": finished.step if finished else None,
                  "eval_loss_step0": round(evals[0].loss, 4) if evals and evals[0].step == 0 else None,
                  "eval_loss_final": round(evals[-1].loss, 4) if evals else None,
                  "token_accuracy_step0": round(evals[0].token_accuracy, 4) if evals else None,
                  "token_accuracy_final": round(evals[-1].token_accuracy, 4) if evals else None},
        "held_out": held_out,
        "run_dir": str(run_dir) if run_dir else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if finished is not None else 1


if __name__ == "__main__":
    sys.exit(main())
