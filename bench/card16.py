"""A 16 GB card on a big GPU: the automatic plan and every phase of a run through the product (issues 39, 40).

A second process (the holder) takes all but 16 GB (decimal) of the GPU's free memory and keeps it,
so that the free memory the automatic plan reads (engine/planning.py) is a 16 GB card's
(/work/shared/GPU.md). Then, as a user would, for each case:

    studio train CONFIG --detach     # micro_batch_size: auto; a worker that stays up after training
    studio attach RUN                # follows the run to its end (steps, evaluations, adapter save)
    studio eval RUN --rows 1 --json  # the answer after training, by the same worker process

``--detach`` because a foreground ``studio train`` exits when training ends: the answer after training
(what the training pane's chat asks) is only served by a worker kept up, as the TUI keeps it. The
worker is then shut down as the next start would do it (``claim_device``).

Cases (random weights in the real shapes, the project's tiny byte-level tokenizer beside them):

- ``sft``: Qwen3-8B, seq 1024, every example full length, Studio's defaults otherwise (NF4, LoRA r16 on
  every projection, 16 examples a step), an evaluation mid-run (step 2, CUDA graphs alive) and at the
  end, then an answer to a held-out prompt about as long as a training row. Issue 39's bar: no phase
  runs out of memory, at micro-batch 4 or more;
- ``grpo``: Llama-3-8B at the GRPO defaults of docs/grpo.md (16 prompts a step, 8 completions of up
  to 256 tokens, 512-token rows; prompts of ~240 tokens, so every row fills its room), two steps (the
  second samples with the optimizer's state alive), the final evaluation (greedy sampling of held-out
  prompts) and the answer after training. Issue 40's bar: no phase runs out of memory.

The JSON keeps, per case: the plan chosen (AutoPlanChosen and RunStarted from the run's
events.jsonl) and the plan core/memory predicts for a 16 GB card, the path, any out-of-memory
halving or failure, whether every phase finished, tokens/s (SFT) or steps/s (GRPO), the allocator's
peak of each step (MemorySampled), the card's view of each phase (the most Studio held of the 16 GB,
sampled by the holder every 0.1 s: allocator, CUDA context and all), the wall times, the commands and
their output; and the command, commit, GPU and versions.

    # the GPU box, from the repository root (wheels as docs/testing.md says); models reused when there
    python3 bench/card16.py --commit <sha> --out $OUT/card16.json            # both cases, ~300 s + builds
    python3 bench/card16.py --only sft --commit <sha> --out $OUT/card16_sft.json   # ~90 s (+ ~45 s build)
    python3 bench/card16.py --only grpo --commit <sha> --out $OUT/card16_grpo.json # ~200 s (+ ~35 s build)
    python3 bench/card16.py --dry-run       # the plans core/memory predicts for the cases; runs nothing
    python3 bench/card16.py --cpu --out /tmp/card16.json  # the pipeline on the tiny model, no holder
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 10**9
SFT_MODEL = Path("/tmp/models/qwen3-8b")
"""Where bench/families.py --models-dir /tmp/models builds Qwen3-8B: one build serves both scripts."""
GRPO_MODEL = Path("/tmp/llama3-8b-random")
"""Where bench/make_random_model.py --arch llama3-8b builds it (bench/grpo_speed.py's default)."""
SFT_SEQ = 1024
GRPO_PROMPT_TOKENS = 240
"""A GRPO prompt's tokens: the default 512-token rows less the 256 of a completion leave 256."""
SAMPLE_S = 0.1
"""How often the holder reads the card's free memory."""


def vowels(completions: list, **_: object) -> list[float]:
    """The GRPO case's reward (TRL's signature): a completion's vowels, so that a group's completions
    score differently and the scored pass runs with real advantages."""
    return [float(sum(ch in "aeiou" for ch in str(c))) for c in completions]


# ------------------------------------------------------------------------------------ the holder


def hold(card_bytes: int, samples: Path) -> int:
    """The holder process: take all of the GPU's free memory but ``card_bytes``, say so on stdout
    (HELD and a JSON line), then write ``time free_bytes`` every :data:`SAMPLE_S` seconds to ``samples``
    until its parent is gone or it is terminated."""
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    block = torch.empty(max(0, free - card_bytes), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    left, _ = torch.cuda.mem_get_info()
    print("HELD " + json.dumps({"gpu": torch.cuda.get_device_name(0), "total_bytes": total,
                                "free_before_bytes": free, "held_bytes": block.numel(), "free_after_bytes": left}),
          flush=True)
    parent = os.getppid()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(samples, "a", encoding="utf-8") as out:
        while not stop.is_set() and os.getppid() == parent:
            out.write(f"{time.time():.3f} {torch.cuda.mem_get_info()[0]}\n")
            out.flush()
            stop.wait(SAMPLE_S)
    del block
    return 0


def start_holder(card_bytes: int, samples: Path, env: dict) -> tuple[subprocess.Popen, dict]:
    """Start :func:`hold` in its own process; its HELD facts once it holds the memory."""
    proc = subprocess.Popen([sys.executable, __file__, "--hold", str(card_bytes), "--samples", str(samples)],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("HELD "):
            return proc, json.loads(line[5:])
    raise SystemExit(f"the holder ended without holding the card (exit {proc.wait()})")


# ------------------------------------------------------------------------------------ the cases


def _cut(tokenizer, text: str, tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens], skip_special_tokens=True)


def _pool_text() -> str:
    sample = ROOT / "sample_data" / "code_alpaca_sample.jsonl"
    rows = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    return "\n".join(f"{r['instruction']}\n{r['output']}" for r in rows)


def write_sft_data(path: Path, model: Path, seq: int, steps: int) -> None:
    """Training and validation rows that each run past ``seq`` tokens (bench/engines.py's long rows),
    and two held-out (test) rows whose prompt is about a training row long less an answer's room."""
    from transformers import AutoTokenizer

    from bench.engines import long_rows

    long = long_rows(path.with_suffix(".long.jsonl"), 16 * steps + 16 + 8, seq)
    rows = [json.loads(line) for line in long.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model)
    # the answer's 128 new tokens (generation.max_new_tokens) and the template's own tokens fit the row
    prompt = _cut(tokenizer, _pool_text(), max(16, seq - 128 - 32))
    with open(path, "w", encoding="utf-8") as out:
        for i, row in enumerate(rows):
            out.write(json.dumps({**row, "split": 1 if i < 8 else 0}) + "\n")
        for i in range(2):
            out.write(json.dumps({"instruction": f"{i}. {prompt}", "output": "ok", "split": 2}) + "\n")


def write_grpo_data(path: Path, model: Path, prompt_tokens: int, rows: int) -> None:
    """Prompts of ``prompt_tokens`` tokens of the sample's text: 4 validation, 2 test, the rest training."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.encode(_pool_text(), add_special_tokens=False)
    with open(path, "w", encoding="utf-8") as out:
        for i in range(rows):
            start = (i * 97) % max(1, len(ids) - prompt_tokens)
            text = tokenizer.decode(ids[start:start + prompt_tokens], skip_special_tokens=True)
            out.write(json.dumps({"prompt": text, "split": 1 if i < 4 else 2 if i < 6 else 0}) + "\n")


def case_config(case: str, model: Path, data: Path, runs: Path, steps: int, cpu: bool) -> dict:
    """The run config a case writes (Studio's defaults except what the case is about). On the CPU
    (``cpu``) the GRPO group, batch and lengths are small: the pipeline, not the defaults."""
    config: dict = {"model": {"base_model": str(model)}, "data": {"path": str(data)}, "output_dir": str(runs)}
    if case == "sft":
        config["data"]["max_seq_length"] = 64 if cpu else SFT_SEQ
        config["prompt"] = {"template": "{instruction}\n{output}"}
        config["trainer"] = {"max_steps": steps, "eval_interval": 2}
        if cpu:
            config["trainer"]["effective_batch_size"] = 4
    else:
        config["prompt"] = {"template": "{prompt}"}
        config["trainer"] = {"method": "grpo", "max_steps": steps, "eval_max_rows": 4}
        config["grpo"] = {"rewards": [f"{Path(__file__).resolve()}:vowels"]}
        if cpu:
            config["data"]["max_seq_length"] = 64
            config["trainer"]["effective_batch_size"] = 2
            config["grpo"].update(num_generations=2, max_completion_length=16)
    return config


def predicted_plan(config_path: Path, card_bytes: int) -> dict:
    """What core/memory's automatic plan chooses for the case's config on a card of ``card_bytes``
    (the engine's own call, without a GPU)."""
    from studio.core.config import load_config
    from studio.core.memory import autoplan
    from studio.core.model.info import load_model_info

    config = load_config(config_path)
    info = load_model_info(config.model.base_model, config.model.revision)
    planned = autoplan.plan_or_smallest(config, info, card_bytes)
    t = planned.config.trainer
    out = {"micro_batch_size": t.micro_batch(), "gradient_accumulation_steps": t.accumulation_steps(),
           "gradient_checkpointing": t.checkpointing(), "capacity_bytes": card_bytes,
           "fits_with_headroom": planned.smallest is None}
    if planned.plan is not None:
        out.update(path=planned.plan.path, estimated_bytes=planned.plan.chosen.total,
                   headroom_bytes=planned.plan.headroom)
    return out


def two_micro_batches(config: dict, config_path: Path, planned: dict, card_bytes: int) -> str:
    """A GRPO step of two micro-batches of the size the plan predicts at the default prompts a step,
    where that smaller step plans the same micro-batch (a step's count of micro-batches changes only
    how many are accumulated, not what one holds): ``config`` and its file are changed then. What
    was done, in words."""
    import yaml

    micro = planned["micro_batch_size"]
    if planned["gradient_accumulation_steps"] < 2:
        return f"the default: {micro} prompts a micro-batch, one a step"
    smaller = {**config, "trainer": {**config["trainer"], "effective_batch_size": 2 * micro}}
    config_path.write_text(yaml.safe_dump(smaller, sort_keys=False))
    again = predicted_plan(config_path, card_bytes)
    if again["micro_batch_size"] != micro or again["gradient_checkpointing"] != planned["gradient_checkpointing"]:
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return (f"the default: at {2 * micro} prompts a step the plan would be {again['micro_batch_size']} a "
                f"micro-batch, not {micro}")
    config["trainer"]["effective_batch_size"] = 2 * micro
    return (f"{2 * micro} (two micro-batches of {micro}, as the plan predicts at the default "
            f"{planned['micro_batch_size'] * planned['gradient_accumulation_steps']}); the plan checked the same")


# ------------------------------------------------------------------------------------ reading a run


def read_run(run_dir: Path) -> dict:
    """What the run's events.jsonl says: the plan, the path, the steps and their peaks, evaluations,
    halvings, failures, the end."""
    from studio.core import events as ev
    from studio.core.runs.directory import iter_events

    events = list(iter_events(run_dir / "events.jsonl"))
    kinds = {type(e).__name__ for e in events}
    plan = next((e for e in events if isinstance(e, ev.AutoPlanChosen)), None)
    started = next((e for e in events if isinstance(e, ev.RunStarted)), None)
    loaded = next((e for e in events if isinstance(e, ev.ModelLoaded)), None)
    steps = [e for e in events if isinstance(e, ev.StepLogged)]
    memory = [e for e in events if isinstance(e, ev.MemorySampled)]
    evals = [e for e in events if isinstance(e, ev.EvalLogged)
             or isinstance(e, ev.GrpoStepLogged) and e.split != "train"]
    finished = next((e for e in events if isinstance(e, ev.TrainingFinished)), None)
    out: dict = {
        "events": sorted(kinds),
        "plan": None if plan is None else {k: getattr(plan, k) for k in (
            "micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "effective_batch_size",
            "path", "estimated_bytes", "capacity_bytes", "headroom_bytes", "rejected", "message")},
        "run_started": None if started is None else {k: getattr(started, k) for k in (
            "micro_batch_size", "gradient_accumulation_steps", "effective_batch_size", "total_steps")},
        "path": None if loaded is None else loaded.path, "path_reason": None if loaded is None else loaded.path_reason,
        "load_seconds": None if loaded is None else loaded.load_seconds,
        "steps": len(steps), "losses": [e.loss for e in steps], "step_end_s": [e.elapsed_s for e in steps],
        "step_peak_reserved": [e.peak_reserved for e in memory],
        "evaluations": len(evals),
        "batch_size_reduced": [e.message for e in events if isinstance(e, ev.BatchSizeReduced)],
        "failures": [f"{e.kind}: {e.message}" for e in events if isinstance(e, ev.WorkerFailed)],
        "finished": finished is not None and not finished.stopped,
    }
    if len(steps) > 1:  # the first step (captures, compiles) left out
        a, b = steps[0], steps[-1]
        out["tokens_per_s"] = round((b.tokens_seen - a.tokens_seen) / max(b.elapsed_s - a.elapsed_s, 1e-9), 1)
        out["steps_per_s"] = round((len(steps) - 1) / max(b.elapsed_s - a.elapsed_s, 1e-9), 4)
    out["_marks"] = [(e.time, _mark(e)) for e in events if _mark(e)]
    return out


def _mark(event) -> str | None:
    """The phase an event ends (its time closes it): what the holder's samples before it belong to."""
    name = type(event).__name__
    if name == "GrpoStepLogged":
        return "steps" if event.split == "train" else "evaluation"
    return {"ModelLoaded": "load", "StepLogged": "steps", "EvalLogged": "evaluation",
            "TrainingFinished": "save"}.get(name)


def card_phases(samples: Path, marks: list, answer: tuple[float, float], window: tuple[float, float],
                free_at_start: int) -> dict:
    """The most of the emulated card each phase used (bytes: free at the start less the least free
    seen), from the holder's samples inside ``window``; ``answer``: the ``studio eval`` command's span."""
    out: dict = {}
    if not samples.exists():
        return out
    marks = sorted(marks)
    for line in samples.read_text().splitlines():
        t, free = line.split()
        t, free = float(t), int(free)
        if not window[0] <= t <= window[1]:
            continue
        if answer[0] <= t <= answer[1]:
            phase = "answer"
        else:
            phase = next((m for when, m in marks if when >= t), "after")
        out[phase] = max(out.get(phase, 0), free_at_start - free)
    return out


# ------------------------------------------------------------------------------------ one case


def _end_worker(run, wait_s: float = 60.0) -> None:
    """Stop the run's worker (this script started it): SIGTERM (a checkpoint, then exit), SIGKILL
    after ``wait_s``."""
    pid = run.worker_pid()
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + wait_s
    while run.worker_pid() is not None and time.time() < deadline:
        time.sleep(0.5)
    if run.worker_pid() is not None:
        os.kill(pid, signal.SIGKILL)


def _studio(args: list[str], env: dict, timeout: float, log: Path) -> tuple[int, str]:
    """``studio ARGS`` as a user types it; its exit status and stdout (everything goes to ``log``)."""
    command = [sys.executable, "-m", "studio.cli", *args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = exc.stdout if isinstance(exc.stdout, str) else ""
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"$ studio {' '.join(args)}\n{text}\n(timed out after {timeout:.0f} s)\n")
        return 124, text
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ studio {' '.join(args)}\n{done.stdout}\n--- stderr ---\n{done.stderr}\n")
    return done.returncode, done.stdout


def run_case(case: str, model: Path, steps: int, work: Path, env: dict, args: argparse.Namespace,
             samples: Path, free_at_start: int) -> dict:
    """One case end to end; its entry of the JSON."""
    import yaml

    folder = work / case
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.jsonl"
    if case == "sft":
        write_sft_data(data, model, 64 if args.cpu else SFT_SEQ, steps)
    else:
        write_grpo_data(data, model, 24 if args.cpu else GRPO_PROMPT_TOKENS, 64)
    config = case_config(case, model, data, folder / "runs", steps, args.cpu)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry: dict = {"model": str(model), "steps_asked": steps}
    card = int(args.card_gb * GB)
    if not args.cpu:
        entry["predicted_plan"] = predicted_plan(config_path, card)
        if case == "grpo" and args.grpo_two_micro_batches:
            entry["prompts_per_step"] = two_micro_batches(config, config_path, entry["predicted_plan"], card)
    entry["config"] = config
    entry = through_the_product(entry, config_path, folder, steps, env, args.case_timeout_s, samples, free_at_start)
    if "every_phase_finished" in entry:  # a run that started: issue 39's SFT bar also asks micro-batch 4 or more
        micro = (entry.get("plan") or {}).get("micro_batch_size") or 0
        entry["meets_bar"] = entry["every_phase_finished"] and (micro >= 4 or case != "sft" or args.cpu)
    return entry


def through_the_product(entry: dict, config_path: Path, folder: Path, steps: int, env: dict, timeout_s: float,
                        samples: Path, free_at_start: int) -> dict:
    """Train ``config_path`` as a user would (``studio train --detach``, ``attach``, then ``studio eval``
    for the answer after training, by the worker that trained), then read the run: ``entry`` with the
    run's plan, path, steps, evaluations, failures, wall times, the card's use by phase (the holder's
    ``samples``, from ``free_at_start``) and ``every_phase_finished``. ``timeout_s``: training and
    answer together; past it the run is stopped with a checkpoint and no answer is asked."""
    from studio.core.runs import find_run
    from studio.worker.client import claim_device

    log = folder / "commands.log"
    start = time.time()
    code, out = _studio(["train", str(config_path), "--detach"], env, 120, log)
    lines = out.split()
    if code != 0 or not lines:
        entry["error"] = f"studio train --detach exited {code}: {log.read_text()[-1500:]}"
        return entry
    run = find_run(lines[0], folder / "runs")
    entry["run"] = str(run.path)
    budget = max(30.0, timeout_s - (time.time() - start))
    entry["attach_exit"], _ = _studio(["attach", run.id, "--runs-dir", str(folder / "runs")], env, budget, log)
    trained = time.time()
    worker = run.worker_pid()
    answer_start = answer_end = time.time()
    entry["eval_exit"], entry["answer"] = None, None
    if entry["attach_exit"] == 124:  # over its time, still training: stopped with a checkpoint, no answer asked
        _end_worker(run)
    else:
        entry["eval_exit"], report = _studio(
            ["eval", run.id, "--rows", "1", "--json", "--runs-dir", str(folder / "runs")], env,
            max(30.0, timeout_s - (answer_start - start)), log)
        answer_end = time.time()
        try:
            answers = json.loads(report)["results"]
            entry["answer"] = {"rows": len(answers), "tuned_answer_chars": len(answers[0].get("tuned") or "")}
        except (ValueError, KeyError, IndexError):
            pass
    entry["answer_by_the_training_worker"] = worker is not None and run.worker_pid() == worker
    if entry["attach_exit"] not in (0, None) or entry["eval_exit"] not in (0, None):
        # the commands' own words (the work folder is gone with the machine): the last of the log
        entry["commands_log_tail"] = log.read_text(encoding="utf-8", errors="replace")[-2500:]
        from studio.core import events as ev
        from studio.core.runs.directory import iter_events

        entry["warnings"] = [e.message for e in iter_events(run.path / "events.jsonl")
                             if isinstance(e, ev.WarningRaised)][-5:]
    try:
        claim_device(timeout=60)  # shuts the idle worker down, as the next start would
    except Exception as exc:  # noqa: BLE001 - a worker that would not go is the result's note
        entry["shutdown"] = f"{type(exc).__name__}: {exc}"
    found = read_run(run.path)
    marks = found.pop("_marks")
    entry.update(found)
    entry["wall_s"] = {"train": round(trained - start, 1), "answer": round(answer_end - answer_start, 1),
                       "case": round(time.time() - start, 1)}
    entry["card_used_bytes_by_phase"] = card_phases(samples, marks, (answer_start, answer_end),
                                                    (start, answer_end), free_at_start)
    # From the run's own events (attach's status only says how following it ended) and the answer.
    entry["every_phase_finished"] = bool(
        found["finished"] and found["steps"] == steps and found["evaluations"] >= 1 and entry["eval_exit"] == 0
        and entry["answer"] and entry["answer_by_the_training_worker"] and not found["batch_size_reduced"]
        and not found["failures"])
    return entry


# ------------------------------------------------------------------------------------ the driver


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "triton", "liger-kernel"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else "unknown (pass --commit)"


def build_models(cases: list[str], args: argparse.Namespace, env: dict) -> dict[str, Path]:
    """Each case's model folder: the tiny model on the CPU; else the random-weight folder, built
    (before the holder takes the card) unless it is there."""
    if args.cpu:
        from studio.engine.tiny import build_tiny_model

        tiny = build_tiny_model()
        return dict.fromkeys(cases, tiny)
    folders = {"sft": Path(args.sft_model), "grpo": Path(args.grpo_model)}
    for case in cases:
        folder = folders[case]
        if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
            continue
        if case == "sft":
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
                    f"from bench.families import build_model; build_model('qwen3-8b', Path({str(folder)!r}), False)")
            subprocess.run([sys.executable, "-c", code], check=True, env=env)
        else:
            # The tiny tokenizer as build_tokenizer makes it: the tiny model's own would be pretrained first.
            from studio.engine.tiny import build_tokenizer

            tokenizer = Path(tempfile.mkdtemp(prefix="card16_tokenizer_"))
            build_tokenizer().save_pretrained(tokenizer)
            subprocess.run([sys.executable, str(ROOT / "bench" / "make_random_model.py"), "--arch", "llama3-8b",
                            "--out", str(folder), "--tokenizer", str(tokenizer)], check=True, env=env)
    return {case: folders[case] for case in cases}


def dry_run(args: argparse.Namespace) -> int:
    """The plan core/memory predicts for each case on the card (the bundled config.json where the
    model folder is not built here)."""
    import yaml

    bundled = {"sft": ROOT / "sample_data" / "model_configs" / "Qwen" / "Qwen3-8B",
               "grpo": ROOT / "sample_data" / "model_configs" / "meta-llama" / "Llama-3.1-8B"}
    chosen = {"sft": Path(args.sft_model), "grpo": Path(args.grpo_model)}
    with tempfile.TemporaryDirectory() as work:
        for case in args.only.split(","):
            model = chosen[case] if (chosen[case] / "config.json").exists() else bundled[case]
            path = Path(work) / f"{case}.yaml"
            config = case_config(case, model, Path(work) / "data.jsonl", Path(work) / "runs",
                                 args.sft_steps if case == "sft" else args.grpo_steps, cpu=False)
            path.write_text(yaml.safe_dump(config))
            print(case, model, json.dumps(predicted_plan(path, int(args.card_gb * GB))))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--only", default="sft,grpo", help="the cases, comma-separated: sft, grpo")
    parser.add_argument("--commit", help="the commit this tree is (git on the GPU box answers a stale one)")
    parser.add_argument("--card-gb", type=float, default=16.0, help="the card emulated, in GB (10^9 bytes)")
    parser.add_argument("--sft-steps", type=int, default=3, help="optimizer steps of the SFT case")
    parser.add_argument("--grpo-steps", type=int, default=2, help="optimizer steps of the GRPO case")
    parser.add_argument("--sft-model", default=str(SFT_MODEL), help="the Qwen3-8B folder (built when missing)")
    parser.add_argument("--grpo-model", default=str(GRPO_MODEL), help="the Llama-3-8B folder (built when missing)")
    parser.add_argument("--grpo-two-micro-batches", action="store_true",
                        help="a GRPO step of two micro-batches of the predicted size instead of the default 16 "
                             "prompts (same plan, checked; ~4x less time a step)")
    parser.add_argument("--case-timeout-s", type=float, default=300.0,
                        help="a case's training and answer together; past it the run is stopped")
    parser.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, no holder: the pipeline")
    parser.add_argument("--dry-run", action="store_true", help="print the predicted plans; run nothing")
    parser.add_argument("--hold", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hold is not None:
        return hold(args.hold, args.samples)
    if args.dry_run:
        return dry_run(args)
    if not args.out:
        parser.error("--out is required")
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in cases if c not in ("sft", "grpo")]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}: sft, grpo")
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="card16_"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "STUDIO_WORKER_LINGER": "300"}  # the worker waits for studio eval after training
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "STUDIO_FAST_PATH"):  # the engine's own defaults
        env.pop(key, None)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result: dict = {"what": f"micro_batch_size: auto and every phase of a run (steps, evaluation, the answer after "
                            f"training) through studio train --detach / attach / eval, with another process holding "
                            f"all but {args.card_gb:g} GB of the GPU",
                    "command": " ".join(["python3", "bench/card16.py", *(sys.argv[1:] if argv is None else argv)]),
                    "commit": _commit(args.commit), "versions": _versions(), "cpu_only": args.cpu,
                    "card_bytes": int(args.card_gb * GB), "work": str(work), "cases": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        result["wall_s"] = round(time.time() - start, 1)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    t0 = time.time()
    models = build_models(cases, args, env)
    result["build_s"] = round(time.time() - t0, 1)
    samples = work / "card_samples.txt"
    holder, free_at_start = None, 0
    if not args.cpu:
        holder, held = start_holder(int(args.card_gb * GB), samples, env)
        result.update(gpu=held["gpu"], holder=held)
        free_at_start = held["free_after_bytes"]
    else:
        result["gpu"] = "cpu"
    write()
    try:
        for case in cases:
            steps = args.sft_steps if case == "sft" else args.grpo_steps
            entry = run_case(case, models[case], steps, work, env, args, samples, free_at_start)
            result["cases"][case] = entry
            write()
            plan = entry.get("plan") or {}
            print(f"{case}: finished every phase: {entry.get('every_phase_finished')}; plan micro-batch "
                  f"{plan.get('micro_batch_size')} x {plan.get('gradient_accumulation_steps')}; path {entry.get('path')}; "
                  f"card used by phase (GB) {json.dumps({k: round(v / GB, 2) for k, v in entry.get('card_used_bytes_by_phase', {}).items()})}; "
                  f"{entry.get('error') or ''}", flush=True)
    finally:
        if holder is not None:
            holder.terminate()  # the holder this script started
            holder.wait(timeout=30)
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
