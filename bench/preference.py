"""DPO speed: Studio's preference training against TRL's DPOTrainer, same model, data and settings.

In one call per model shape it builds (or reuses) the model with random weights, writes the
preference pairs, then trains DPO with Studio (its Session + Trainer, on the path its engine takes:
the fast one where it covers the model, which the result records with its reason) and with TRL's
``DPOTrainer`` (1.15.0), each in its own process so that each one's peak memory is its own, and
writes one JSON with tokens/s, the ratio, peak allocated/reserved (GiB), the losses, the GPU, the
commit, the package versions and the exact command. The bar (issue 39): Studio at least 1.3x TRL's
tokens/s with at most its peak reserved memory (``summary.meets_bar``).

    # the GPU box, from the repository root (the .whl wheels installed as docs/testing.md says: TRL,
    # datasets, liger-kernel, bitsandbytes); --commit always (git there answers a stale commit).
    # Each shape ~2 min with its model built (two sides, each ~15 s to start, ~20 s to load the 8B
    # model in 4 bits, 33 steps of 2,056 tokens: TRL ran 0.6 s a step on an H100 at Llama-2-7B's
    # shape), plus ~35 s to build the model when it is not there:
    python3 bench/preference.py --shape llama3-8b --model /tmp/llama3-8b-random --commit <sha> \\
        --out $OUT/dpo_llama3-8b.json        # the folder bench/make_random_model.py --arch llama3-8b makes
    python3 bench/preference.py --shape qwen3-8b --model /tmp/models/qwen3-8b --commit <sha> \\
        --out $OUT/dpo_qwen3-8b.json         # the folder bench/families.py --models-dir /tmp/models makes
    # without --model, the shape is built in /tmp/<shape>-random (reused when there)
    # on a CPU, the tiny model on the fast path (a check that Studio's side runs; TRL's DPO needs
    # Triton, so a GPU): ~40 s
    python3 bench/preference.py --tiny --out /tmp/preference-tiny.json --steps 4

The summary (``<shape>_dpo``) has Studio's path (``studio_path``, from its ModelLoaded event: "fast"
where the fast path trains the run, else "plain" and ``path_reason``), both sides' tokens/s and
peak reserved GiB, and ``meets_bar``: on the fast path, at least 1.3x TRL's tokens/s and at most its
peak reserved memory. A ``--model`` folder whose config.json is not ``--shape``'s is refused.

Shapes: the bundled config.json of sample_data/model_configs/ (Llama-3.1-8B's for ``llama3-8b``:
Llama-3-8B's dimensions with 3.1's RoPE scaling, which costs nothing; Qwen3-8B's; Llama-2-7B's),
built on the GPU in bf16 with random weights (the weights' values do not change the cost) and the
project's tiny byte-level tokenizer (its ids are below every vocabulary; a ``qwen3`` folder encodes
with it too, which :func:`pair_tokens` checks).

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
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"llama3-8b": "meta-llama/Llama-3.1-8B", "qwen3-8b": "Qwen/Qwen3-8B", "llama2-7b": "meta-llama/Llama-2-7b-hf"}
"""Model shapes by name: their config.json under sample_data/model_configs/."""
GIB = 2**30

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


def pair_tokens(model_dir: str, data: Path, expected: int) -> list[int]:
    """Tokens of each pair as both sides train on it: prompt + answer + EOS, twice. Refuses a
    tokenizer that does not make ``expected`` tokens of a pair (a tokenizer class picked by the
    model's type can encode the tiny tokenizer's text to nothing: ../shared/GPU.md)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        out.append(sum(len(tokenizer(row["prompt"] + row[side], add_special_tokens=False).input_ids) + 1
                       for side in ("chosen", "rejected")))
    if out[0] != expected:
        raise SystemExit(f"{model_dir}: a pair is {out[0]} tokens with its tokenizer ({type(tokenizer).__name__}), "
                         f"not {expected}: the benchmark's pairs are one token a letter or dash")
    return out


def check_shape(shape: str, model_dir: str) -> None:
    """Refuse a model folder whose config.json is not ``shape``'s (the result is labelled by it)."""
    from transformers import AutoConfig

    # Read through transformers: a saved config.json leaves out the values its class defaults to.
    bundled = AutoConfig.from_pretrained(ROOT / "sample_data" / "model_configs" / SHAPES[shape]).to_dict()
    found = AutoConfig.from_pretrained(model_dir).to_dict()
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads", "vocab_size")
    differ = [f"{k} {found.get(k)} (not {bundled.get(k)})" for k in keys if found.get(k) != bundled.get(k)]
    if differ:
        raise SystemExit(f"{model_dir} is not the {shape} shape: {', '.join(differ)}; pass its --shape")


def build_model(shape: str, out: Path) -> None:
    """The shape's architecture with random weights, built on the GPU in bf16 and saved with the
    tiny model's tokenizer (reused when ``out`` has both)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.engine.tiny import build_tiny_model

    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        print(f"{out} exists; reusing it", flush=True)
        return
    config = AutoConfig.from_pretrained(ROOT / "sample_data" / "model_configs" / SHAPES[shape])
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="4GB")
    tokenizer = build_tiny_model()
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    print(f"built and saved {shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters) "
          f"in {time.perf_counter() - start:.0f} s", flush=True)


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
    notes = [e.message for e in events if type(e).__name__ in ("WorkerFailed", "WarningRaised")]
    loaded = next(e for e in events if type(e).__name__ == "ModelLoaded")
    # why a capture failed (the policy's step or DPO's reference pass), "" when every one held
    graphs_failed = session.fast.graphs_failed if session.fast is not None else ""
    return {"step_times": [b - a for a, b in zip(times, times[1:], strict=False)], "losses": losses,
            "path": getattr(loaded, "path", ""), "path_reason": getattr(loaded, "path_reason", ""),
            "notes": notes, "graphs_failed": graphs_failed, **_peaks(torch)}


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
    """Peak allocated and reserved memory since the side's reset (after loading), in GiB, and the GPU."""
    if not torch.cuda.is_available():
        return {"peak_allocated_gib": None, "peak_reserved_gib": None, "device": "cpu"}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
            "device": torch.cuda.get_device_name(0)}


# ------------------------------------------------------------------------------------ driver


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "datasets", "liger-kernel",
                 "triton"):
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
    if args.tiny and side == "studio":
        env["STUDIO_FAST_PATH"] = "1"  # the fast path on the CPU: what the GPU runs, checked here
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    (args.work / f"{side}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(result.read_text())


def _commit(given: str | None) -> str:
    """The commit measured: ``--commit``, else this tree's HEAD, else said to be unknown."""
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git here: pass --commit)"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run one side (``--side``) or the whole comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    parser.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (a check, not a timing)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                        help="the model shape, built with random weights in /tmp when missing")
    parser.add_argument("--model", help="a model folder instead of --shape (with --tiny: the tiny model)")
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--pairs", type=int, default=4, help="pairs a micro-batch (and a step)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of every pair")
    parser.add_argument("--answer", type=int, default=128, help="tokens of each answer")
    parser.add_argument("--side", choices=("studio", "trl", "build"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "build":
        build_model(args.shape, Path(args.model))
        return 0
    if args.side:
        result = (run_studio if args.side == "studio" else run_trl)(args)
        args.out.write_text(json.dumps(result))
        return 0

    start = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    args.work = args.out.parent / (args.out.stem + "-work")
    args.work.mkdir(parents=True, exist_ok=True)
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:
        from studio.engine.tiny import build_tiny_model

        args.model = args.model or str(build_tiny_model())
    else:
        # Built in a process of its own: this one keeps no CUDA context or cached blocks beside the sides.
        args.model = args.model or f"/tmp/{args.shape}-random"
        if not (Path(args.model) / "config.json").exists() or not (Path(args.model) / "tokenizer.json").exists():
            subprocess.run([sys.executable, __file__, "--side", "build", "--shape", args.shape, "--model", args.model,
                            "--out", str(args.out)], check=True)
        check_shape(args.shape, args.model)
    args.data = args.work / "pairs.jsonl"
    write_pairs(args.data, args.pairs * (args.warmup + args.steps + 2), args.prompt, args.answer, seed=0)
    tokens = pair_tokens(args.model, args.data, expected=2 * (args.prompt + args.answer + 1))
    per_step = args.pairs * sum(tokens) / len(tokens)
    report: dict = {"command": command, "commit": _commit(args.commit), "versions": _versions(), "shape": shape,
                    "model": args.model,
                    "settings": {"pairs_per_step": args.pairs, "prompt_tokens": args.prompt,
                                 "answer_tokens": args.answer, "tokens_per_step": per_step, "beta": BETA,
                                 "steps_timed": args.steps, "warmup_steps": args.warmup,
                                 "lora": "r16 alpha 32 on the seven projections, dropout 0",
                                 "quantization": None if args.tiny else "nf4 double-quant, bf16 compute"}}
    for side in ("studio", "trl"):
        result = _side(args, side)
        timed = result.get("step_times", [])[args.warmup:]
        if timed:
            result["tokens_per_s"] = round(per_step * len(timed) / sum(timed), 1)
        result.pop("step_times", None)
        report[side] = result
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # kept if the call's time runs out next
    report["device"] = report["studio"].get("device") or report["trl"].get("device") or "unknown"
    studio, trl = report["studio"], report["trl"]
    summary = {"studio_path": studio.get("path"), "studio_path_reason": studio.get("path_reason"),
               "studio_tokens_per_s": studio.get("tokens_per_s"),
               "trl_tokens_per_s": trl.get("tokens_per_s"), "studio_peak_reserved_gib": studio.get("peak_reserved_gib"),
               "trl_peak_reserved_gib": trl.get("peak_reserved_gib")}
    if studio.get("tokens_per_s") and trl.get("tokens_per_s"):
        summary["ratio_studio_over_trl"] = round(studio["tokens_per_s"] / trl["tokens_per_s"], 3)
        if studio.get("peak_reserved_gib") is not None and trl.get("peak_reserved_gib") is not None:
            summary["meets_bar"] = (summary["ratio_studio_over_trl"] >= 1.3 and studio.get("path") == "fast"
                                    and studio["peak_reserved_gib"] <= trl["peak_reserved_gib"])
    report["summary"] = {f"{shape}_dpo": summary}
    report["wall_s"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"device": report["device"], "commit": report["commit"], **report["summary"],
                      "errors": {s: report[s].get("error", report[s].get("skipped"))[-600:]
                                 for s in ("studio", "trl") if report[s].get("error") or report[s].get("skipped")}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
