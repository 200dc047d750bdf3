"""One driver for the speed benchmark: the HF + PEFT baseline and Studio, same config, data and seed.

In one call on the GPU machine it: measures a bf16 matmul (the MFU ceiling), builds the random
Llama-2-7B if missing, writes the workloads' batches, runs the baseline (bench/baseline_qlora.py) and
Studio (this file, ``--worker``) in separate processes (so each one's peak memory is its own), and
writes one JSON with tokens/s, the ratio, peak allocated/reserved, the loss at every step, MFU, the
GPU, the package versions and the exact command.

    python bench/speed.py --out $OUT --steps 50

Workloads: ``fixed_mb4`` / ``fixed_mb1`` (rows of 512 tokens, micro-batch 4 / 1, loss on every
token) and ``short_*`` (short instruction-like examples, lengths drawn like Code Alpaca's): the
baseline trains on them padded (micro-batch 4, padded to the longest), Studio packed into rows of
512 tokens (micro-batch 4).
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
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 512


# ------------------------------------------------------------------------------- workloads


def _zipf_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Token frequencies of text fall off like 1/rank: a learnable distribution, unlike uniform ids.
    return [min(vocab - 1, 3 + int(rng.paretovariate(1.0))) for _ in range(n)]


def write_workloads(folder: Path, steps: int, seed: int, vocab: int = 32000) -> dict[str, Path]:
    """The batch files, one per workload (lists of dicts of CPU tensors)."""
    import torch

    from studio.core.prompt import IGNORE_INDEX
    from studio.engine.batching import DataStream

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = {}
    for mb in (4, 1):
        batches = []
        for _ in range(steps):
            ids = torch.tensor([_zipf_ids(rng, SEQ, vocab) for _ in range(mb)])
            batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": None,
                            "position_ids": torch.arange(SEQ).expand(mb, SEQ).clone(), "tokens": mb * SEQ})
        paths[f"fixed_mb{mb}"] = folder / f"fixed_mb{mb}.pt"
        torch.save(batches, paths[f"fixed_mb{mb}"])

    class Ex:
        def __init__(self, ids, labels):
            self.input_ids, self.labels = ids, labels

    examples = []
    for _ in range(4000):
        # Code Alpaca through the Alpaca template: ~60 prompt tokens, answers mostly under 150.
        prompt = max(30, min(200, int(rng.lognormvariate(4.1, 0.3))))
        answer = max(4, min(SEQ - prompt, int(rng.lognormvariate(3.9, 0.8))))
        ids = _zipf_ids(rng, prompt + answer, vocab)
        examples.append(Ex(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    for packing, name in ((False, "short_padded"), (True, "short_packed")):
        stream = DataStream(examples, seed=seed, packing=packing, max_len=SEQ)
        # The plain HF loop: shuffled examples, each batch padded to its longest (no length grouping).
        units = stream.units(0) if packing else [[i] for i in rng.sample(range(len(examples)), 4 * steps)]
        batches = []
        for i in range(steps):
            mb = stream.collate(units[i * 4:(i + 1) * 4], pad_id=0)
            batches.append({"input_ids": mb.input_ids, "labels": mb.labels, "attention_mask": mb.attention_mask,
                            "position_ids": mb.position_ids, "tokens": mb.tokens})
        paths[name] = folder / f"{name}.pt"
        torch.save(batches, paths[name])
    return paths


# --------------------------------------------------------------------------------- Studio side


LEVERS = {
    "all": {},
    "no_graphs": {"cuda_graphs": False},
    "no_kernels": {"kernels": False},
    "no_offload": {"host_offload": False},
}
"""Each lever: ``trainer.fast_path`` settings (core/config/sections.py's FastPathConfig) switched from their
defaults. The comparisons with earlier orders of the engine (the levers that turned one change off
at a time) went with those orders in issue 38; their results are in bench/results and NOTES.md."""


def fast_facts(fm) -> dict:
    """What the fast path ran with, as data for a result file: its settings, and which of its parts
    are on in this process (a kernel that failed here, a graph capture that failed)."""
    from dataclasses import asdict

    from studio.engine.fast import cross_entropy, dequant, norm, update

    if fm is None:
        return {"path": "plain"}
    failed = {name: module.broken() for name, module in (("dequant", dequant), ("update", update), ("norm", norm),
                                                         ("cross_entropy", cross_entropy)) if module.broken()}
    return {"path": "fast", "settings": asdict(fm.options), "liger": fm.liger is not None,
            "varlen": fm.varlen is not None, "cuda_graphs": fm._graphs is not None,
            "host_offload": fm._host is not None, "adapter_dropout": fm._seed is not None,
            "kernels_failed": failed, "graphs_failed": fm.graphs_failed}


def studio_load(model_path: str, lora_dropout: float, seed: int, targets: list[str] | None = None):
    """The 4-bit model with LoRA attached, as Studio's engine loads it (no fp32 upcasts); ``targets``:
    the LoRA modules (default the seven of a Llama layer). Without a GPU (bench/profile_gpu_bound.py's
    ``--tiny``), the model in fp32 on the CPU, unquantized."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from bench.baseline_qlora import LORA_TARGETS

    kwargs: dict = {"dtype": torch.float32}
    if torch.cuda.is_available():
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs = {"quantization_config": quant, "dtype": torch.bfloat16, "device_map": {"": 0}}
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)  # its own attention: the fast path has its own
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules=targets or LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def random_7b(models_dir: str, lora_dropout: float = 0.0, seed: int = 42):
    """The random-weight Llama-2-7B (built under ``models_dir`` on first use) with LoRA attached, as
    :func:`studio_load` loads it: the model the GPU-bound scripts share."""
    from bench.vram_accuracy import build_model

    folder = build_model("llama2-7b", Path(models_dir) / "llama2-7b")
    return studio_load(str(folder), lora_dropout, seed)


def studio_train(fast_model, params, batches, steps: int, lr: float, warmup_steps: int, seed: int,
                 profile: Path | None = None) -> dict:
    """Same loop as the baseline's, with the fast path's loss and a fused AdamW (on CUDA; on the CPU,
    where the fast path runs for the tests, the same loop with torch's plain AdamW)."""
    import torch

    from bench.baseline_qlora import WARMUP

    device = fast_model.backbone.embed_tokens.weight.device
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=cuda)
    # Linear warmup over the first steps (as Studio's trainer does), then constant.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / (WARMUP + 1) if s < WARMUP else 1.0)
    losses, times, tokens = [], [], []
    sync()
    prof = None
    for step in range(steps):
        batch = batches[step % len(batches)]
        if profile is not None and step == warmup_steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if prof is not None and step == warmup_steps + 2:
            prof.__exit__(None, None, None)
            write_profile(prof, profile, sum(times[warmup_steps:]))
            prof = None
        t0 = time.perf_counter()
        mask = batch["attention_mask"]
        loss = fast_model.loss(batch["input_ids"].to(device, non_blocking=True),
                               batch["labels"].to(device, non_blocking=True),
                               mask.to(device, non_blocking=True) if mask is not None else None,
                               batch["position_ids"].to(device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(int(batch["tokens"]))
    timed = slice(warmup_steps, None)
    return {"losses": losses, "step_s": times, "tokens": tokens,
            "tokens_per_s": sum(tokens[timed]) / sum(times[timed]),
            "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None}


def write_profile(prof, path: Path, wall_s: float) -> None:
    """The two profiled steps: GPU busy time against wall time, and the top operators."""
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e6
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    head = (f"2 steps: wall {wall_s:.3f} s, GPU kernel time {kernels:.3f} s "
            f"({100 * kernels / max(wall_s, 1e-9):.0f}% busy), {launches} launches\n")
    path.write_text(head + events.table(sort_by="self_device_time_total", row_limit=40)
                    + events.table(sort_by="self_cpu_time_total", row_limit=25))
    print(head, flush=True)


def optimizer_state_free() -> None:
    """Release what a failed variant left on the GPU."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def studio_worker(args) -> int:
    """Run Studio's fast path on each workload (and each lever variant on the fixed ones)."""
    import torch

    from bench.baseline_qlora import reset_lora
    from studio.core.config import FastPathConfig
    from studio.engine import fast

    t0 = time.perf_counter()
    model = studio_load(args.model, args.lora_dropout, args.seed)
    load_s = time.perf_counter() - t0
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    results = {"impl": "studio", "load_s": load_s, "after_load_allocated": torch.cuda.memory_allocated(),
               "trainable_params": sum(p.numel() for p in init.values()), "workloads": {}}
    plan = [(Path(p).stem, p, "all", args.steps) for p in args.batches.split(",")]
    if args.levers:
        for lever in args.lever_names.split(","):
            if lever != "all":
                plan += [(Path(p).stem, p, lever, args.lever_steps) for p in args.levers.split(",")]
    for name, path, lever, steps in plan:
        batches = torch.load(path)
        fm, why = fast.prepare(model, FastPathConfig(**LEVERS[lever]))
        if fm is None:
            print(f"fast path unavailable: {why}", flush=True)
            return 1
        reset_lora(model, init)
        optimizer_state_free()  # the previous variant's graphs and their memory pools go here
        torch.cuda.reset_peak_memory_stats()
        try:
            profile = Path(args.profile) / f"profile_{name}.txt" if args.profile and lever == "all" \
                and name.startswith("fixed") else None
            out = studio_train(fm, params, batches, steps, args.lr, args.warmup_steps, args.seed, profile)
        except Exception:  # noqa: BLE001 - one failing variant must not hide the others' numbers
            traceback.print_exc()
            optimizer_state_free()
            continue
        out["fast_path"] = fast_facts(fm)
        key = name if lever == "all" else f"{name}:{lever}"
        results["workloads"][key] = out
        print(f"studio {key}: {out['tokens_per_s']:.0f} tokens/s, peak {out['peak_allocated'] / 2**30:.2f} / "
              f"{out['peak_reserved'] / 2**30:.2f} GiB, loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}"
              f" {json.dumps(out['fast_path'])}", flush=True)
        del fm
    Path(args.json).write_text(json.dumps(results))
    return 0


# ------------------------------------------------------------------------- Studio's Trainer


def long_rows(path: Path, n: int, seed: int) -> Path:
    """Rows whose rendered text is longer than 512 tokens: each becomes one 512-token example."""
    rng = random.Random(seed)
    sample = ROOT / "sample_data" / "code_alpaca_sample.jsonl"
    rows = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(n):
            picks = rng.sample(rows, 24)
            out.write(json.dumps({"instruction": picks[0]["instruction"], "input": "",
                                  "output": "\n\n".join(p["output"] for p in picks)}) + "\n")
    return path


def trainer_config(args, data: Path, mb: int, template: str):
    """The Studio config of a workload: the baseline's recipe in Studio's keys."""
    from bench.baseline_qlora import WARMUP
    from studio.core.config import RunConfig

    config = RunConfig()
    config.model.base_model = args.model
    config.lora.r, config.lora.alpha, config.lora.dropout = 16, 32, args.lora_dropout
    config.lora.target_modules = "all-linear"
    config.prompt.template = template
    config.data.path = str(data)
    config.data.max_seq_length = SEQ
    config.data.val_fraction = 0.02
    t = config.trainer
    t.learning_rate, t.max_steps, t.micro_batch_size, t.effective_batch_size = args.lr, args.steps, mb, mb
    t.warmup_fraction = WARMUP / args.steps  # the same warmup steps as the baseline's
    t.scheduler, t.optimizer, t.max_grad_norm, t.gradient_checkpointing = "constant", "adamw", 1.0, True
    t.packing, t.eval_interval, t.eval_max_rows, t.checkpoint_interval, t.seed = True, 0, 8, 0, args.seed
    if args.fast_options:  # some of the fast path's settings switched (the defaults otherwise)
        from studio.core.config import FastPathConfig

        t.fast_path = FastPathConfig(**json.loads(args.fast_options))
    config.output_dir = str(Path(args.work) / "runs")
    return config


def trainer_worker(args) -> int:
    """Studio's own engine (Trainer) on one workload; writes its numbers and the baseline's batches."""
    import torch

    from studio.core import events as ev
    from studio.core.runs import create_run
    from studio.engine.batching import collate
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    name, data, mb, template = args.workload.split(":")
    config = trainer_config(args, Path(data), int(mb), template)
    steps: list = []
    notes: list[str] = []
    peak = {}
    profiled: dict = {}

    def emit(event) -> None:
        if isinstance(event, ev.StepLogged):
            steps.append(event)
            if args.trainer_profile:  # the last two steps but one: outside the timed window below
                profile_steps(event.step, args.steps - 3, profiled)
            # Read here: the final evaluation (not part of training speed) runs after the last step.
            cuda = torch.cuda.is_available()
            peak["allocated"] = torch.cuda.max_memory_allocated() if cuda else 0
            peak["reserved"] = torch.cuda.max_memory_reserved() if cuda else 0
        elif isinstance(event, ev.WorkerFailed):
            notes.append(event.message)
            print(f"studio {name}: {event.message}", flush=True)

    trainer = Trainer(Session(config, create_run(config), emit))
    t0 = time.perf_counter()
    trainer.load()
    load_s = time.perf_counter() - t0
    recorded = []
    collate_orig = trainer.stream.collate

    def recording(units, pad_id):
        batch = collate_orig(units, pad_id)
        recorded.append({"input_ids": batch.input_ids, "labels": batch.labels,
                         "attention_mask": batch.attention_mask, "position_ids": batch.position_ids,
                         "tokens": batch.tokens})
        return batch

    trainer.stream.collate = recording
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    warm = args.warmup_steps
    # Profiling (its start and the trace's export) happens in StepLogged of steps - 3 and - 1: those
    # steps' successors carry its time, so the window ends at step - 3.
    timed = steps[warm:len(steps) - 3] if args.trainer_profile else steps[warm:]
    tokens = timed[-1].tokens_seen - steps[warm - 1].tokens_seen
    seconds = timed[-1].elapsed_s - steps[warm - 1].elapsed_s
    if "gaps" in profiled:
        print(f"studio {name}: GPU idle {json.dumps(profiled['gaps'])}", flush=True)
    result = {"impl": "studio-trainer", "load_s": load_s, "profile": profiled.get("gaps"),
              "fast_path": fast_facts(trainer.session.fast), "notes": notes, "losses": [e.loss for e in steps],
              "step_tokens_per_s": [e.tokens_per_s for e in steps], "mfu_events": [e.mfu for e in steps],
              "tokens_per_s": tokens / seconds, "peak_allocated": peak["allocated"],
              "peak_reserved": peak["reserved"], "graphs_failed": trainer.session.fast._graphs.failed
              if trainer.session.fast is not None and trainer.session.fast._graphs is not None else ""}
    Path(args.json).write_text(json.dumps(result))
    # The baseline trains on exactly these batches; on short data it gets the same examples padded.
    work = Path(args.work)
    if name.startswith("fixed"):
        torch.save(recorded, work / f"{name}.pt")
    else:
        rng = random.Random(args.seed)
        order = rng.sample(range(len(trainer.session.data.train)), len(trainer.session.data.train))
        padded = []
        for i in range(args.steps):
            unit = [[trainer.session.data.train[j % len(order)]] for j in order[4 * i:4 * i + 4]]
            b = collate(unit, trainer.tokenizer.pad_token_id, packing=False)
            padded.append({"input_ids": b.input_ids, "labels": b.labels, "attention_mask": b.attention_mask,
                           "position_ids": b.position_ids, "tokens": b.tokens})
        torch.save(padded, work / "short_padded.pt")
    print(f"studio {name}: {result['tokens_per_s']:.0f} tokens/s, peak {peak['allocated'] / 2**30:.2f} / "
          f"{peak['reserved'] / 2**30:.2f} GiB, loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f} "
          f"{json.dumps(result['fast_path'])} {result['graphs_failed']}", flush=True)
    return 0


def profile_steps(step: int, start: int, state: dict) -> None:
    """From inside the Trainer (its StepLogged): profile the two steps after step ``start`` and put
    the GPU's idle time under the Trainer's labelled phases (``state["gaps"]``)."""
    import torch

    from bench.kernel_trace import idle_by_phase, kernel_table

    if step == start:
        torch.cuda.synchronize()
        state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
        state["prof"].__enter__()
        state["t0"] = time.perf_counter()
    elif step == start + 2 and "prof" in state:
        torch.cuda.synchronize()
        wall = time.perf_counter() - state["t0"]
        prof = state.pop("prof")
        prof.__exit__(None, None, None)
        trace = Path(f"/tmp/trainer_trace_{os.getpid()}.json")
        prof.export_chrome_trace(str(trace))
        table = kernel_table(trace, wall)
        state["gaps"] = {**idle_by_phase(trace, steps=2), "wall_ms_per_step": round(wall * 500, 2),
                         "gpu_busy_ms_per_step": round(table["gpu_busy_ms"] / 2, 2),
                         "by_category_ms_per_step": {k: round(v / 2, 2) for k, v in table["by_category_ms"].items()}}
        trace.unlink()


def loss_agreement(losses: list[float], baseline: list[float]) -> dict:
    """How far per-step ``losses`` are from ``baseline``'s, over the steps both have: the worst and
    mean relative difference, each step's, and the signed mean (positive: above the baseline on
    average, i.e. learning more slowly)."""
    pairs = list(zip(losses, baseline, strict=False))
    rel = [abs(x - y) / abs(y) for x, y in pairs]
    return {"loss_max_rel_diff": max(rel), "loss_mean_rel_diff": sum(rel) / len(rel),
            "loss_mean_signed_rel_diff": sum((x - y) / abs(y) for x, y in pairs) / len(pairs),
            "loss_rel_diff_per_step": [round(r, 4) for r in rel]}


def _workers_setup(args) -> tuple[Path, Path, list[str], dict]:
    """What both drivers start with: the random model (built if missing), the work folder, the
    arguments every worker shares, and the workers' environment."""
    model = Path(args.model)
    if not (model / "config.json").exists():
        tokenizer = ["--tokenizer", args.tokenizer] if args.tokenizer else []
        subprocess.run([sys.executable, str(ROOT / "bench/make_random_model.py"), "--out", str(model), *tokenizer],
                       check=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
              "--lr", str(args.lr), "--lora-dropout", str(args.lora_dropout), "--seed", str(args.seed),
              "--work", str(work)]
    return model, work, common, dict(os.environ, PYTHONUNBUFFERED="1")


def gaps_driver(args) -> int:
    """Studio's Trainer and bench/speed.py's loop on the same recorded batches, in one call, per
    micro-batch of ``--gaps``: tokens/s of each, and where the Trainer's GPU waits (its profiled
    steps' idle time by phase). The loop times only from a batch's upload to its step's end."""
    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"what": "Trainer against the direct loop, same batches, same call", "code": args.code,
              "command": " ".join(shlex.quote(a) for a in sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": versions(), "steps": args.steps, "workloads": {}}
    model, work, common, env = _workers_setup(args)
    long_data = long_rows(work / "long.jsonl", 16 * args.steps + 40, args.seed)
    for mb in (int(x) for x in args.gaps.split(",")):
        name = f"fixed_mb{mb}"
        trainer_json, loop_json = work / f"trainer_{name}.json", work / f"loop_{name}.json"
        subprocess.run([sys.executable, str(ROOT / "bench/speed.py"), "--worker", "trainer", *common,
                        "--json", str(trainer_json), "--workload", f"{name}:{long_data}:{mb}:{{instruction}}\n{{output}}",
                        "--trainer-profile", "1"], check=True, env=env)
        subprocess.run([sys.executable, str(ROOT / "bench/speed.py"), "--worker", "direct", *common,
                        "--json", str(loop_json), "--batches", str(work / f"{name}.pt")], check=True, env=env)
        trainer, loop = json.loads(trainer_json.read_text()), json.loads(loop_json.read_text())["workloads"][name]
        report["workloads"][name] = {
            "trainer_tokens_per_s": round(trainer["tokens_per_s"]), "loop_tokens_per_s": round(loop["tokens_per_s"]),
            "trainer_over_loop": round(trainer["tokens_per_s"] / loop["tokens_per_s"], 4),
            "trainer_losses": trainer["losses"], "loop_losses": loop["losses"],
            "trainer_profile": trainer.get("profile"), "fast_path": trainer["fast_path"]}
        print(json.dumps({k: v for k, v in report["workloads"][name].items() if "losses" not in k}), flush=True)
        out.write_text(json.dumps(report, indent=1))
    return 0


# ------------------------------------------------------------------------------------ driver


def matmul_tflops() -> float:
    """bf16 8192^3 matmul rate on this GPU (median of 20 after warm-up, random data)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * 8192**3 / times[len(times) // 2] / 1e12


def versions() -> dict[str, str]:
    """Versions of the packages that decide the result."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "peft", "bitsandbytes", "liger-kernel", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "missing"
    return out


def driver(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(shlex.quote(a) for a in sys.argv), "gpu": torch.cuda.get_device_name(),
              "versions": versions(), "steps": args.steps, "seq": SEQ, "lora_dropout": args.lora_dropout}
    report["matmul_tflops"] = matmul_tflops()
    print(f"{report['gpu']}: bf16 matmul {report['matmul_tflops']:.0f} TFLOP/s; {report['versions']}", flush=True)
    torch.cuda.empty_cache()
    model, work, common, env = _workers_setup(args)
    runs = {"studio": {"impl": "studio-trainer", "workloads": {}}}
    # Studio first: its trainer records the batches the baseline then trains on.
    long_data = long_rows(work / "long.jsonl", 4 * args.steps + 40, args.seed)
    workloads = [("fixed_mb4", long_data, 4, "{instruction}\n{output}"),
                 ("fixed_mb1", long_data, 1, "{instruction}\n{output}"),
                 ("short_packed", ROOT / "sample_data" / "code_alpaca_sample.jsonl", 4, "alpaca")]
    for name, data, mb, template in workloads:
        out_json = work / f"studio_{name}.json"
        subprocess.run([sys.executable, str(ROOT / "bench/speed.py"), "--worker", "trainer", *common,
                        "--json", str(out_json), "--workload", f"{name}:{data}:{mb}:{template}"],
                       check=True, env=env)
        runs["studio"]["workloads"][name] = json.loads(out_json.read_text())
    if not args.skip_baseline:
        base = [work / f"{k}.pt" for k in ("fixed_mb4", "fixed_mb1", "short_padded")]
        subprocess.run([sys.executable, str(ROOT / "bench/baseline_qlora.py"), *common[:-2], "--json",
                        str(work / "baseline.json"), "--batches", ",".join(map(str, base))], check=True, env=env)
        runs["baseline"] = json.loads((work / "baseline.json").read_text())
    if args.levers:
        paths = write_workloads(work / "levers", args.lever_steps, args.seed)
        mine = ",".join(str(paths[k]) for k in ("fixed_mb4", "fixed_mb1", "short_packed"))
        subprocess.run([sys.executable, str(ROOT / "bench/speed.py"), "--worker", "direct", *common, "--json",
                        str(work / "levers.json"), "--batches", mine, "--levers", mine,
                        "--steps", str(args.lever_steps), "--lever-steps", str(args.lever_steps),
                        "--lever-names", args.lever_names], check=True, env=env)
        runs["levers"] = json.loads((work / "levers.json").read_text())
    report.update(summarize(runs, report["matmul_tflops"]))
    report["runs"] = runs
    (out / "speed.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0


def summarize(runs: dict, peak_tflops: float) -> dict:
    """Ratios, MFU and loss agreement from the two runs' JSON."""
    from transformers import LlamaConfig

    from bench.make_random_model import ARCHS
    from studio.engine.fast import model_flops_per_token

    config = LlamaConfig(**ARCHS["llama2-7b"])
    pairs = {"fixed_mb4": ("fixed_mb4", "fixed_mb4"), "fixed_mb1": ("fixed_mb1", "fixed_mb1"),
             "short_instructions": ("short_padded", "short_packed")}
    summary = {}
    base = runs.get("baseline", {}).get("workloads", {})
    studio = runs["studio"]["workloads"]
    for label, (b, s) in pairs.items():
        row = {}
        seq = float(SEQ)
        if b in base and not label.startswith("fixed"):  # attention's share follows the example length
            seq = sum(base[b]["tokens"]) / (4 * len(base[b]["tokens"]))
        flops = model_flops_per_token(config, seq)
        if s in studio:
            row["studio_tokens_per_s"] = studio[s]["tokens_per_s"]
            row["studio_mfu"] = studio[s]["tokens_per_s"] * flops / (peak_tflops * 1e12)
            row["studio_peak_reserved_gib"] = studio[s]["peak_reserved"] / 2**30
            row["studio_peak_allocated_gib"] = studio[s]["peak_allocated"] / 2**30
        if b in base:
            row["baseline_tokens_per_s"] = base[b]["tokens_per_s"]
            row["baseline_mfu"] = base[b]["tokens_per_s"] * flops / (peak_tflops * 1e12)
            row["baseline_peak_reserved_gib"] = base[b]["peak_reserved"] / 2**30
            row["baseline_peak_allocated_gib"] = base[b]["peak_allocated"] / 2**30
        if s in studio and b in base:
            row["ratio"] = row["studio_tokens_per_s"] / row["baseline_tokens_per_s"]
            row["reserved_le_baseline"] = studio[s]["peak_reserved"] <= base[b]["peak_reserved"]
            if b == s:
                row.update(loss_agreement(studio[s]["losses"], base[b]["losses"]))
        summary[label] = row
    for key, value in runs.get("levers", {}).get("workloads", {}).items():
        summary.setdefault("levers", {})[key] = {"tokens_per_s": value["tokens_per_s"],
                                                 "peak_reserved_gib": value["peak_reserved"] / 2**30}
    return {"summary": summary}


def print_table(report: dict) -> None:
    print(f"\n{report['gpu']}  matmul {report['matmul_tflops']:.0f} TFLOP/s")
    for label, row in report["summary"].items():
        if label == "levers":
            for key, v in row.items():
                print(f"  lever {key:28s} {v['tokens_per_s']:8.0f} tok/s  reserved {v['peak_reserved_gib']:.2f} GiB")
            continue
        print(f"  {label:20s} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in row.items() if not isinstance(v, list)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["trainer", "direct"], help="internal: run one side")
    parser.add_argument("--tokenizer", default=".whl/tokenizer" if Path(".whl/tokenizer").exists() else "",
                        help="folder of tokenizer files for the random model (else the tiny model's)")
    parser.add_argument("--workload", default="", help="trainer worker: name:data:micro_batch:template")
    parser.add_argument("--model", default="/tmp/llama2-7b-random")
    parser.add_argument("--out", default="bench/results/current")
    parser.add_argument("--work", default="/tmp/studio-bench")
    parser.add_argument("--batches", default="")
    parser.add_argument("--json", default="")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--levers", default="", help="driver: any value runs the lever ablations")
    parser.add_argument("--lever-steps", type=int, default=12)
    parser.add_argument("--lever-names", default=",".join(LEVERS), help="which LEVERS to time, one by one")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--profile", default="", help="folder for torch.profiler tables of Studio's fixed runs")
    parser.add_argument("--trainer-profile", default="", help="trainer worker: profile two late steps, GPU idle by phase")
    parser.add_argument("--gaps", default="", help="micro-batches: the Trainer against the loop (gaps_driver)")
    parser.add_argument("--code", default="", help="what code ran (the device's git metadata is stale)")
    parser.add_argument("--fast-options", default="",
                        help="trainer worker: trainer.fast_path settings as JSON (core/config/sections.py's FastPathConfig)")
    args = parser.parse_args()
    if args.gaps and not args.worker:
        return gaps_driver(args)
    if args.worker == "trainer":
        return trainer_worker(args)
    return studio_worker(args) if args.worker == "direct" else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
