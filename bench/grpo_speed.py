"""GRPO speed: Studio's GRPO steps/s and peak reserved memory against TRL's GRPOTrainer and Unsloth's.

In one call it builds (or reuses) the random Llama-3-8B-shaped model, writes the prompts, then runs
GRPO with Studio (its Session + Trainer: the batched sampler with the slot KV cache and the decode
step as a CUDA graph, then the scored pass), with TRL's ``GRPOTrainer`` (1.15.0, generation by
transformers' ``generate``, no vLLM) and with Unsloth's GRPO (its patched GRPOTrainer, no vLLM),
each in its own process so that each one's peak memory is its own, and writes one JSON with steps/s,
the ratio to TRL, peak allocated / reserved (Studio's also per phase: the sampling, and the scored
pass with the update), the completions' mean length, the GPU, the commit, the package versions and
the exact command.

    # on the GPU machine (TRL's and Unsloth's wheels carried as ../shared/GPU.md says); --commit always:
    python bench/grpo_speed.py --out $OUT/grpo_speed.json --steps 10 --commit <sha>
    # one side a process with its own timeout (the JSON is written at the end), as bench/NEXT_GPU.md runs it:
    timeout 170 python3 bench/grpo_speed.py --model /tmp/llama3-8b-random --sides studio --steps 4 --warmup 1 \\
        --commit <sha> --out $OUT/grpo_studio.json
    # on a CPU, the tiny model: a check that Studio's side (and TRL's, where it is installed) runs
    python bench/grpo_speed.py --tiny --out /tmp/grpo-tiny.json --steps 2 --warmup 1

Every side: NF4 double-quant base and bf16 compute on the GPU (the tiny model in fp32 on a CPU),
LoRA r16 / alpha 32 / dropout 0 on the seven projections, gradient checkpointing, one prompt of
``--prompt`` tokens a step with ``--generations`` completions of up to ``--completion`` tokens at
temperature 1, beta 0 (no reference pass), the ``grpo`` loss with rewards scaled within the group,
AdamW at a constant learning rate, one policy update per sampling. The reward is :func:`reward`
(plain Python, the same function on every side). With random weights a completion almost never
samples the end token, so completions run to the length limit on every side (the JSON has each
side's mean length). Steps/s is timed over the steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATE = 1e-6
SIDES = ("studio", "trl", "unsloth")


def reward(completions: list, **kwargs) -> list[float]:
    """The benchmark's reward (TRL's signature): how many vowels a completion holds, so that the
    completions of a group score differently and every side computes a real advantage."""
    return [float(sum(ch in "aeiou" for ch in str(c))) for c in completions]


def write_prompts(path: Path, rows: int, prompt_tokens: int, seed: int) -> None:
    """``rows`` prompts of ``prompt_tokens`` tokens each with the project's tokenizer: letters joined by
    dashes, one token each."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    n = (prompt_tokens + 1) // 2
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            text = "-".join(rng.choice(letters) for _ in range(n)) + ("-" if prompt_tokens % 2 == 0 else "")
            out.write(json.dumps({"prompt": text, "split": 0}) + "\n")


def _peaks(torch) -> dict:
    if not torch.cuda.is_available():
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3)}


class PhasePeaks:
    """Peak allocated and reserved bytes per phase of Studio's step (the sampling; the scored pass
    with the update) over the whole run. Studio's Trainer starts a new peak window at every logged
    step (engine/memory.py's ``reset_peak``), so a single reading at the end would see the last
    step only: every reset, the Trainer's and the phase ends', first folds the window's peaks into
    the phase it belongs to. The run's peak is the largest phase's, as TRL's and Unsloth's sides read
    theirs over the whole run."""

    def __init__(self, torch, phase: str):
        self.cuda = torch.cuda
        self.peaks: dict[str, list[int]] = {}
        self.phase = phase
        """The phase the current peak window belongs to."""
        self._reset = torch.cuda.reset_peak_memory_stats
        torch.cuda.reset_peak_memory_stats = self._fold_and_reset
        self._reset()

    def _fold_and_reset(self, *args, **kwargs) -> None:
        seen = self.peaks.setdefault(self.phase, [0, 0])
        seen[0] = max(seen[0], self.cuda.max_memory_allocated())
        seen[1] = max(seen[1], self.cuda.max_memory_reserved())
        self._reset(*args, **kwargs)

    def close(self, phase: str, then: str) -> None:
        """The window so far belongs to ``phase``; the next one to ``then``."""
        self.phase = phase
        self._fold_and_reset()
        self.phase = then

    def report(self) -> dict:
        """``_peaks``' two numbers over every phase, and each phase's."""
        gb = {name: [round(b / 1e9, 3) for b in pair] for name, pair in self.peaks.items()}
        return {"peak_allocated_gb": max(a for a, _ in gb.values()), "peak_reserved_gb": max(r for _, r in gb.values()),
                "phase_peaks_gb": {name: {"allocated": a, "reserved": r} for name, (a, r) in gb.items()}}


# ------------------------------------------------------------------------------------ Studio


def run_studio(args: argparse.Namespace) -> dict:
    """Studio's GRPO through its Session and Trainer; per-step wall times from a between-steps hook."""
    import torch

    sys.path.insert(0, str(ROOT))
    from studio.core.config import RewardConfig, RunConfig
    from studio.core.runs import create_run
    from studio.engine.session import Session

    config = RunConfig()
    config.model.base_model = args.model
    config.quantization.bits = None if args.tiny else 4
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    config.lora.target_modules = list(LORA_TARGETS)
    config.prompt.template = "{prompt}"
    config.data.path, config.data.split_column = str(args.data), "split"
    config.data.max_seq_length = args.prompt + args.completion + 16
    t = config.trainer
    t.method, t.learning_rate, t.scheduler, t.warmup_fraction = "grpo", LEARNING_RATE, "constant", 0.0
    t.max_steps = args.warmup + args.steps
    t.micro_batch_size = t.effective_batch_size = 1
    t.gradient_checkpointing = True
    t.packing, t.eval_interval, t.checkpoint_interval, t.log_interval = False, 0, 0, 1
    g = config.grpo
    g.num_generations, g.max_completion_length, g.temperature, g.beta, g.loss = (
        args.generations, args.completion, 1.0, 0.0, "grpo")
    g.rewards = [RewardConfig(name=f"{Path(__file__).resolve()}:reward")]
    config.output_dir = str(args.work / "studio-runs")
    events: list = []
    times: list[float] = []

    def between_steps(trainer) -> None:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()  # a host sync: the step's time is the GPU's, not the launch's
        times.append(time.perf_counter())

    session = Session(config, create_run(config), events.append, between_steps)
    session.load()
    scored, sampling = "scored pass and update", "sampling"
    phases = PhasePeaks(torch, scored) if session.device.type == "cuda" else None
    if phases is not None:
        sample = session.grpo.sampler.sample

        def sample_marked(*args, **kwargs):
            phases.close(scored, then=sampling)  # what ran since the last sampling
            try:
                return sample(*args, **kwargs)
            finally:
                phases.close(sampling, then=scored)

        session.grpo.sampler.sample = sample_marked
    times.append(time.perf_counter())
    session.train()
    if phases is not None:
        phases.close(scored, then=scored)
    steps = [e for e in events if type(e).__name__ == "GrpoStepLogged" and e.split == "train"]
    notes = [e.message for e in events if type(e).__name__ == "WorkerFailed"]
    return {"step_times": [b - a for a, b in zip(times, times[1:], strict=False)],
            "mean_completion_length": [round(e.completion_length, 1) for e in steps],
            "rewards": [round(e.reward, 3) for e in steps],
            "graphs": not session.grpo.sampler.graphs_failed and session.device.type == "cuda",
            # completions a forward and backward of the scored pass (the estimate's choice on a GPU)
            "scored_rows_per_pass": session.grpo.scored_rows(args.generations),
            "notes": notes, **(phases.report() if phases is not None else _peaks(torch))}


# ------------------------------------------------------------------------------------ TRL / Unsloth


def run_trainer(args: argparse.Namespace, unsloth: bool) -> dict:
    """TRL's GRPOTrainer (``unsloth``: after Unsloth's loading and patching) on the same model, prompts
    and settings; per-step wall times from a callback."""
    if unsloth:
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
        from unsloth import FastLanguageModel  # first: it patches transformers and TRL
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    peft_config = None
    if unsloth:
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=args.model, max_seq_length=args.prompt + args.completion + 16, load_in_4bit=True,
            fast_inference=False)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS, use_gradient_checkpointing="unsloth")
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if args.tiny:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        else:
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=torch.bfloat16)
            model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quant, dtype=torch.bfloat16,
                                                         device_map={"": 0}, attn_implementation="sdpa")
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none",
                                 task_type="CAUSAL_LM")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset("json", data_files=str(args.data), split="train").remove_columns(["split"])
    config = GRPOConfig(
        output_dir=str(args.work / ("unsloth-out" if unsloth else "trl-out")),
        per_device_train_batch_size=args.generations, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion, temperature=1.0, top_p=1.0,
        beta=0.0, loss_type="grpo", scale_rewards="group", learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", max_steps=args.warmup + args.steps, gradient_checkpointing=not unsloth,
        bf16=not args.tiny, use_cpu=args.tiny, logging_steps=1, save_strategy="no", report_to="none", seed=42,
        dataloader_num_workers=0, use_vllm=False, log_completions=False)
    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, *_, **__):
            times.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(round(float(logs["completions/mean_length"]), 1))

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Timer()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return {"step_times": [b - a for a, b in zip(times, times[1:], strict=False)],
            "mean_completion_length": lengths, **_peaks(torch)}


# ------------------------------------------------------------------------------------ driver


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "unsloth", "accelerate", "bitsandbytes", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _commit(given: str | None = None) -> str:
    """``--commit`` when given (git on the GPU box answers a stale commit), else this tree's HEAD."""
    if given:
        return given
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _side(args: argparse.Namespace, side: str) -> dict:
    """Run one side in a fresh process; its JSON result, why it was skipped, or the failure's last lines."""
    import importlib.util

    needs = {"trl": ("trl", "datasets"), "unsloth": ("unsloth", "trl", "datasets")}.get(side, ())
    missing = [name for name in needs if importlib.util.find_spec(name) is None]
    if missing:
        return {"skipped": f"{', '.join(missing)} not installed here"}
    if side == "unsloth" and args.tiny:
        return {"skipped": "Unsloth needs a CUDA GPU"}
    if side == "trl" and (args.tiny or importlib.util.find_spec("triton") is None):
        # TRL 1.15's GRPOTrainer computes the log-probs through its chunked LM head, a Triton kernel
        # that takes CUDA tensors only: on the CPU (--tiny, even on a GPU box) it cannot run.
        return {"skipped": "TRL 1.15's GRPOTrainer needs Triton on a CUDA GPU (its chunked log-prob LM head)"}
    result = args.work / f"{side}.json"
    command = [sys.executable, __file__, "--side", side, "--model", args.model, "--data", str(args.data),
               "--work", str(args.work), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--generations", str(args.generations), "--prompt", str(args.prompt),
               "--completion", str(args.completion), "--out", str(result)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (args.work / f"{side}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run one side (``--side``) or the whole comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (a check, not a timing)")
    parser.add_argument("--model", help="a model folder (default: the random Llama-3-8B shape, built if missing; "
                        "with --tiny, the tiny model)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--generations", type=int, default=8, help="completions of each prompt (the group)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=256, help="most tokens of a completion")
    parser.add_argument("--sides", default=",".join(SIDES), help="which sides to run (comma-separated)")
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD, stale on the GPU box)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        result = run_studio(args) if args.side == "studio" else run_trainer(args, unsloth=args.side == "unsloth")
        args.out.write_text(json.dumps(result))
        return 0

    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    args.work = args.out.parent / (args.out.stem + "-work")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        sys.path.insert(0, str(ROOT))
        from studio.engine.tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model())
    elif not args.model:
        args.model = "/tmp/llama3-8b-random"
        if not (Path(args.model) / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "bench" / "make_random_model.py"), "--arch", "llama3-8b",
                            "--out", args.model], check=True)
    args.data = args.work / "prompts.jsonl"
    write_prompts(args.data, args.warmup + args.steps + 4, args.prompt, seed=0)
    report: dict = {"command": command, "commit": _commit(args.commit), "versions": _versions(), "model": args.model,
                    "settings": {"prompts_per_step": 1, "generations": args.generations,
                                 "prompt_tokens": args.prompt, "max_completion_tokens": args.completion,
                                 "steps_timed": args.steps, "warmup_steps": args.warmup, "beta": 0.0,
                                 "loss": "grpo", "lora": "r16 alpha 32 dropout 0, seven projections",
                                 "gradient_checkpointing": True,
                                 "quantization": None if args.tiny else "nf4 double-quant, bf16 compute"}}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as exc:  # noqa: BLE001 - the report still says what ran
        report["device"] = f"unknown ({exc})"
    for side in args.sides.split(","):
        result = _side(args, side.strip())
        timed = result.get("step_times", [])[args.warmup:]
        if timed:
            result["steps_per_s"] = round(len(timed) / sum(timed), 4)
            result["seconds_per_step"] = round(sum(timed) / len(timed), 3)
        result.pop("step_times", None)
        report[side.strip()] = result
    trl = report.get("trl", {}).get("steps_per_s")
    for side in ("studio", "unsloth"):
        if trl and report.get(side, {}).get("steps_per_s"):
            report[f"ratio_{side}_over_trl"] = round(report[side]["steps_per_s"] / trl, 3)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith("ratio") or k == "device"} |
                     {s: {k: report[s].get(k) for k in ("steps_per_s", "peak_reserved_gb", "error", "skipped")}
                      for s in SIDES if s in report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
