"""DPO speed: Studio's preference training against TRL's DPOTrainer, same model, data and settings.

In one call it builds (or reuses) the model, writes the preference pairs, then trains DPO with
Studio (its Session + Trainer, the plain path: the fast path computes SFT's loss only) and with
TRL's ``DPOTrainer`` (1.15.0), each in its own process so that each one's peak memory is its own,
and writes one JSON with tokens/s, the ratio, peak allocated/reserved, the losses, the GPU, the
package versions and the exact command.

    # on the GPU machine (TRL's wheels carried as ../shared/GPU.md says):
    python bench/preference.py --out $OUT/preference.json --steps 30
    # on a CPU, the tiny model (a check that Studio's side runs; TRL's needs Triton, so a GPU):
    python bench/preference.py --tiny --out /tmp/preference-tiny.json --steps 4

Both sides: LoRA r16 / alpha 32 on the seven projections (dropout 0), beta 0.1, sigmoid loss, the
reference is the base with the adapter disabled (neither keeps a second copy), AdamW at a constant
learning rate after 2 warm-up steps, micro-batch ``--pairs`` pairs, one micro-batch a step,
gradient checkpointing; on the GPU NF4 double-quant 4-bit base and bf16 compute. Every pair has the
same shape (a prompt of ``--prompt`` tokens, answers of ``--answer`` tokens: letters joined by
dashes, one token each with the project's tokenizer), so both sides process the same number of
tokens a step: tokens/s = pairs x (prompt + answer + EOS) x 2 / step time, timed over the steps
after ``--warmup``.
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
sys.path.insert(0, str(ROOT))

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA = 0.1
LEARNING_RATE = 5e-5
WARMUP_LR_STEPS = 2


def write_pairs(path: Path, rows: int, prompt_tokens: int, answer_tokens: int, seed: int) -> None:
    """``rows`` pairs of fixed token lengths: prompt, chosen and rejected as dash-joined letters."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def text(tokens: int) -> str:
        # n letters joined by dashes are 2n - 1 tokens; a final dash rounds an even count.
        n = (tokens + 1) // 2
        body = "-".join(rng.choice(letters) for _ in range(n))
        return body + ("-" if tokens % 2 == 0 else "")

    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            out.write(json.dumps({"prompt": text(prompt_tokens), "chosen": text(answer_tokens),
                                  "rejected": text(answer_tokens), "split": 0}) + "\n")


def pair_tokens(model_dir: str, data: Path) -> list[int]:
    """Tokens of each pair as both sides train on it: prompt + answer + EOS, twice."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        out.append(sum(len(tokenizer(row["prompt"] + row[side], add_special_tokens=False).input_ids) + 1
                       for side in ("chosen", "rejected")))
    return out


# ------------------------------------------------------------------------------------ Studio


def run_studio(args: argparse.Namespace) -> dict:
    """Studio's DPO through its Session and Trainer; per-step wall times from a between-steps hook."""
    import torch

    from studio.core.config import RunConfig
    from studio.core.runs import create_run
    from studio.engine.session import Session

    config = RunConfig()
    config.model.base_model = args.model
    config.quantization.bits = None if args.tiny else 4
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, 0.0
    config.lora.target_modules = list(LORA_TARGETS)
    config.prompt.template, config.prompt.response_field = "{prompt}{chosen}", "chosen"
    config.data.path, config.data.split_column = str(args.data), "split"
    config.data.max_seq_length = 4 * (args.prompt + args.answer)
    t = config.trainer
    t.method, t.beta, t.learning_rate, t.scheduler = "dpo", BETA, LEARNING_RATE, "constant"
    t.max_steps = args.warmup + args.steps
    t.warmup_fraction = WARMUP_LR_STEPS / t.max_steps
    t.micro_batch_size, t.effective_batch_size = args.pairs, args.pairs
    t.gradient_checkpointing = not args.tiny
    t.packing, t.eval_interval, t.checkpoint_interval, t.log_interval = False, 0, 0, 1
    config.output_dir = str(args.work / "studio-runs")
    events: list = []
    times: list[float] = []

    def between_steps(trainer) -> None:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()  # a host sync: the step's time is the GPU's, not the launch's
        times.append(time.perf_counter())

    session = Session(config, create_run(config), events.append, between_steps)
    session.load()
    if session.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times.append(time.perf_counter())
    session.train()
    losses = [e.loss for e in events if type(e).__name__ == "PreferenceLogged" and e.split == "train"]
    notes = [e.message for e in events if type(e).__name__ == "WorkerFailed"]
    return {"step_times": [b - a for a, b in zip(times, times[1:], strict=False)], "losses": losses,
            "notes": notes, **_peaks(torch)}


# ------------------------------------------------------------------------------------ TRL


def run_trl(args: argparse.Namespace) -> dict:
    """TRL's DPOTrainer on the same model, data and settings; per-step wall times from a callback."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.tiny:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quant, dtype=torch.bfloat16,
                                                     device_map={"": 0}, attn_implementation="sdpa")
    dataset = load_dataset("json", data_files=str(args.data), split="train").remove_columns(["split"])
    config = DPOConfig(
        output_dir=str(args.work / "trl-out"), per_device_train_batch_size=args.pairs,
        gradient_accumulation_steps=1, learning_rate=LEARNING_RATE, lr_scheduler_type="constant_with_warmup",
        warmup_steps=WARMUP_LR_STEPS, max_steps=args.warmup + args.steps, beta=BETA, loss_type=["sigmoid"],
        max_length=4 * (args.prompt + args.answer), gradient_checkpointing=not args.tiny,
        bf16=not args.tiny, use_cpu=args.tiny, logging_steps=1, save_strategy="no", report_to="none",
        seed=42, dataloader_num_workers=0)
    times: list[float] = []
    losses: list[float] = []

    class Timer(TrainerCallback):
        def on_step_end(self, *_, **__):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none",
                      task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora, callbacks=[Timer()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()

    class Start(TrainerCallback):
        def on_train_begin(self, *_, **__):
            times.append(time.perf_counter())

    trainer.add_callback(Start())
    trainer.train()
    return {"step_times": [b - a for a, b in zip(times, times[1:], strict=False)], "losses": losses,
            **_peaks(torch)}


def _peaks(torch) -> dict:
    if not torch.cuda.is_available():
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 3)}


# ------------------------------------------------------------------------------------ driver


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _side(args: argparse.Namespace, side: str) -> dict:
    """Run one side in a fresh process; its JSON result, or the failure's last lines."""
    import importlib.util

    if side == "trl" and importlib.util.find_spec("triton") is None:
        # TRL 1.15's DPOTrainer computes the log-probs through its chunked LM head, a Triton kernel.
        return {"skipped": "TRL 1.15's DPOTrainer needs Triton (its chunked log-prob LM head); none here"}
    result = args.work / f"{side}.json"
    command = [sys.executable, __file__, "--side", side, "--model", args.model, "--data", str(args.data),
               "--work", str(args.work), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--pairs", str(args.pairs), "--prompt", str(args.prompt), "--answer", str(args.answer),
               "--out", str(result)] + (["--tiny"] if args.tiny else [])
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
    parser.add_argument("--model", help="a model folder (default: the random Llama-2-7B, built if missing; "
                        "with --tiny, the tiny model)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--pairs", type=int, default=4, help="pairs a micro-batch (and a step)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of every pair")
    parser.add_argument("--answer", type=int, default=128, help="tokens of each answer")
    parser.add_argument("--side", choices=("studio", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        result = (run_studio if args.side == "studio" else run_trl)(args)
        args.out.write_text(json.dumps(result))
        return 0

    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    args.work = args.out.parent / (args.out.stem + "-work")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from studio.engine.tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model())
    elif not args.model:
        args.model = "/tmp/llama2-7b-random"
        if not (Path(args.model) / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "bench" / "make_random_model.py"), "--arch", "llama2-7b",
                            "--out", args.model], check=True)
    args.data = args.work / "pairs.jsonl"
    write_pairs(args.data, args.pairs * (args.warmup + args.steps + 2), args.prompt, args.answer, seed=0)
    tokens = pair_tokens(args.model, args.data)
    per_step = args.pairs * sum(tokens) / len(tokens)
    report: dict = {"command": command, "versions": _versions(), "model": args.model,
                    "settings": {"pairs_per_step": args.pairs, "prompt_tokens": args.prompt,
                                 "answer_tokens": args.answer, "tokens_per_step": per_step, "beta": BETA,
                                 "steps_timed": args.steps, "warmup_steps": args.warmup,
                                 "quantization": None if args.tiny else "nf4 double-quant, bf16 compute"}}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as exc:  # noqa: BLE001 - the report still says what ran
        report["device"] = f"unknown ({exc})"
    for side in ("studio", "trl"):
        result = _side(args, side)
        timed = result.get("step_times", [])[args.warmup:]
        if timed:
            result["tokens_per_s"] = round(per_step * len(timed) / sum(timed), 1)
        result.pop("step_times", None)
        report[side] = result
    if report["studio"].get("tokens_per_s") and report["trl"].get("tokens_per_s"):
        report["ratio_studio_over_trl"] = round(report["studio"]["tokens_per_s"] / report["trl"]["tokens_per_s"], 3)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report.get(k) for k in ("device", "ratio_studio_over_trl")} |
                     {s: {k: report[s].get(k) for k in ("tokens_per_s", "peak_reserved_gb", "error", "skipped")}
                      for s in ("studio", "trl")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
