"""One family's speed and memory in one GPU call: Studio through its Trainer, Unsloth through its own
loop and the HF + PEFT loop, on the same data and seed (issue 39).

The family's model is built with random weights in its real shape (the bundled config.json of
sample_data/model_configs: Qwen3-8B, Qwen2.5-7B, Gemma-3-4B's text model as gemma3_text, Gemma-2-9B,
Phi-4-mini, Llama-3.1-8B as the control) with the project's tiny byte-level BPE tokenizer beside
it (/work/shared/GPU.md), then each side trains every workload in a fresh process: NF4 with double
quantization, bf16 compute, LoRA r16 (alpha 32, dropout 0) on every linear projection of the
layers, AdamW at 2e-4 constant, gradient clipping at 1.0, checkpointing. Workloads: seq 2048 at
micro-batch 1 (the headline) and seq 1024 at micro-batch 4, full-length rows.

- Studio: ``studio.engine.train.Trainer`` on a JSONL of rows that each run past the sequence
  length (bench/engines.py's ``long_rows``), its own path decision, fast path and CUDA graphs. It
  records the micro-batches it trained on and its adapters' initial weights;
- the HF loop: transformers + PEFT + bitsandbytes as people write it (``prepare_model_for_kbit_training``,
  bf16 autocast), on those micro-batches from those initial adapters, so that its per-step losses
  are Studio's reference (within 1%);
- Unsloth 2026.10.9: ``FastLanguageModel`` (4-bit, its offloaded checkpointing) on those
  micro-batches, its own adapters' initialisation.

Tokens/s counts the steps after ``--warmup`` (3: the CUDA-graph captures and Unsloth's compiles
are in them); peak reserved memory is read after the model loaded. The JSON keeps the command, the
commit, the GPU, the versions, every side's per-step losses and a summary whose keys name the
family and the workload.

    # the GPU box, from the repository root (wheels as docs/testing.md says), one family a call (~6 min on an H100)
    python3 bench/families.py --family qwen3-8b --commit $(git rev-parse HEAD) --out $OUT/families_qwen3-8b.json
    # here, on the CPU: the Studio and HF sides on a tiny shape of each family (fp32, STUDIO_FAST_PATH=1)
    python3 bench/families.py --tiny --family all --out /tmp/families_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import child_env  # noqa: E402

FAMILIES = {
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "gemma-3-4b": "google/gemma-3-4b-it",  # its text model (gemma3_text), as the issue measured it
    "gemma-2-9b": "google/gemma-2-9b",
    "phi-4-mini": "microsoft/Phi-4-mini-instruct",
    "llama-3-8b": "meta-llama/Llama-3.1-8B",  # the control: today's Llama rows
}
"""Each family's label and the bundled config.json (sample_data/model_configs) it is built from."""

WORKLOADS = {"seq2048_mb1": (2048, 1), "seq1024_mb4": (1024, 4)}
"""Workload -> (sequence length, micro-batch)."""

TINY_WORKLOADS = {"seq2048_mb1": (64, 1), "seq1024_mb4": (32, 4)}
"""--tiny: the same workloads' shapes, small."""

TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128)
"""--tiny: a family's config with these sizes (head_dim 128 keeps Phi-4-mini's RoPE factors' length)."""

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16
LR = 2e-4
SEED = 42
LOSS_TOLERANCE = 0.01
"""Studio's per-step losses against the HF loop's: relative difference at most this."""
DROPPED = ("architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "quantization_config",
           "_name_or_path")
"""Keys of a Hub config.json that are not the architecture (a model built here has its own)."""


# ------------------------------------------------------------------------------------ the model


def family_config(family: str, tiny: bool, vocab: int | None = None) -> dict:
    """The config.json values a family's model is built from (``model_type`` included): the bundled
    file's (Gemma 3's text_config, as gemma3_text), with :data:`TINY_SHAPE` and ``vocab`` for --tiny."""
    path = ROOT / "sample_data" / "model_configs" / FAMILIES[family] / "config.json"
    config = json.loads(path.read_text())
    if "text_config" in config:
        config = dict(config["text_config"])
    config = {k: v for k, v in config.items() if k not in DROPPED}
    if tiny:
        config.update(TINY_SHAPE, vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return config


def build_model(family: str, folder: Path, tiny: bool) -> dict:
    """Random bf16 weights in the family's shape, saved like a downloaded checkpoint with the tiny
    tokenizer beside it; returns the config.json written."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.engine.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    fields = family_config(family, tiny, vocab=len(tokenizer))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    tokenizer.save_pretrained(folder)
    print(f"built {family} in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads((folder / "config.json").read_text())


def lora_targets(folder: Path) -> list[str]:
    """Every linear projection of the model's layers by its module names (Phi-3's fused ones)."""
    from studio.core.decoder import describe_decoder

    return list(describe_decoder(json.loads((folder / "config.json").read_text())).lora_modules("all-linear"))


# ------------------------------------------------------------------------------------ the sides


def studio_side(folder: Path, workload: str, seq: int, micro_batch: int, steps: int, warmup: int, work: Path,
                targets: tuple[str, ...] = ALL, experts: bool = False) -> dict:
    """Studio's Trainer on one workload: per-step losses, tokens/s, peak reserved, the path it took;
    the micro-batches it trained on and its adapters' initial weights are saved in ``work`` under the
    workload's name. ``targets``: the LoRA modules (all seven: ``all-linear``); ``experts``: a mixture
    of experts' expert adapters too (``lora.target_experts``)."""
    import torch

    import studio.engine.memory as memory
    import studio.engine.session as session_module
    from bench.engines import long_rows, trainer_config
    from bench.speed import fast_facts
    from studio.core import events as ev
    from studio.core.runs import create_run
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    cuda = torch.cuda.is_available()
    case = SimpleNamespace(weights="nf4" if cuda else "bf16", r=RANK, dropout=0.0, targets=targets, seq=seq,
                           micro_batch=micro_batch, checkpointing=True, optimizer="adamw", packing=True,
                           experts=experts)
    data = long_rows(work / f"rows_{workload}.jsonl", max(64, micro_batch * (steps + 2) * 2), seq)
    config = trainer_config(case, folder, data, steps, cuda)
    config.output_dir = str(work / f"runs_{workload}")
    t = config.trainer
    t.learning_rate, t.warmup_fraction, t.scheduler, t.seed, t.log_interval = LR, 0.0, "constant", SEED, 1

    real_attach = session_module.attach_lora

    def attach(base, run_config):  # the adapters' initial weights: the HF loop starts from them
        model = real_attach(base, run_config)
        torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad},
                   work / f"init_{workload}.pt")
        return model

    session_module.attach_lora = attach
    memory.reset_peak = lambda device=None: None  # the Trainer's per-step reset: this reads the run's
    steps_seen, notes, peaks, ends = [], [], {}, []

    def emit(event) -> None:
        if isinstance(event, ev.ModelLoaded):
            peaks["path"], peaks["reason"] = event.path, event.path_reason
            if cuda:  # from here on: training, not loading
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        elif isinstance(event, ev.StepLogged):
            steps_seen.append(event)
            ends.append(time.perf_counter())  # the event's elapsed_s is rounded to 10 ms
            if cuda:
                peaks["reserved"] = torch.cuda.max_memory_reserved()
                peaks["allocated"] = torch.cuda.max_memory_allocated()
        elif isinstance(event, ev.WorkerFailed):
            notes.append(f"{event.kind}: {event.message}")

    trainer = Trainer(Session(config, create_run(config), emit))
    batches: list[dict] = []
    forward = trainer.forward

    def recording(batch):
        if torch.is_grad_enabled():  # a training micro-batch (evaluation's run without gradients)
            batches.append({"input_ids": batch.input_ids.cpu(), "labels": batch.labels.cpu(),
                            "attention_mask": None if batch.attention_mask is None else batch.attention_mask.cpu(),
                            "position_ids": batch.position_ids.cpu(), "tokens": int(batch.tokens)})
        return forward(batch)

    trainer.forward = recording
    trainer.train()
    torch.save(batches, work / f"batches_{workload}.pt")
    out = {"path": peaks.get("path"), "path_reason": peaks.get("reason"), "fast_path": fast_facts(trainer.session.fast),
           "losses": [e.loss for e in steps_seen], "notes": notes, "micro_batches": len(batches),
           "example_tokens": sorted({len(e.input_ids) for e in trainer.session.data.train})[-3:],
           "experts": expert_storage(trainer.session.model)}
    if len(steps_seen) > warmup:
        a, b = steps_seen[warmup - 1], steps_seen[-1]
        # each step logged once its loss is on the host (a sync): timed here to the microsecond
        out["tokens_per_s"] = (b.tokens_seen - a.tokens_seen) / max(ends[-1] - ends[warmup - 1], 1e-9)
    if cuda:
        out["peak_reserved"], out["peak_allocated"] = peaks.get("reserved"), peaks.get("allocated")
    return out


def _loop(model, batches: list[dict], warmup: int, cuda: bool, autocast: bool = True) -> dict:
    """The plain training loop over ``batches``: per-step losses, tokens/s after ``warmup`` steps,
    peak reserved memory (from the caller's reset). ``autocast``: bf16 autocast on CUDA (the HF
    recipe's; Unsloth's model computes in bf16 itself)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    device = next(model.parameters()).device
    losses, ends = [], []
    start = time.perf_counter()
    for batch in batches:
        mask = batch["attention_mask"]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and autocast):
            loss = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device),
                         attention_mask=None if mask is None else mask.to(device),
                         position_ids=batch["position_ids"].to(device), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # a sync point: the step has finished on the GPU
        ends.append(time.perf_counter())
    out = {"losses": losses, "wall_s": round(ends[-1] - start, 2) if ends else 0.0}
    if len(ends) > warmup:
        tokens = sum(int(b["tokens"]) for b in batches[warmup:])
        out["tokens_per_s"] = tokens / (ends[-1] - ends[warmup - 1])
    if cuda:
        out["peak_reserved"], out["peak_allocated"] = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    return out


def expert_storage(model) -> dict | None:
    """How a side stores a mixture of experts' expert weights, read off its first experts module (None:
    a dense model): each weight's class, dtype and shape as the module holds it (bitsandbytes'
    ``Params4bit`` packs two values a byte), its 4-bit format where it has one, and Studio's packed
    4-bit copies where the engine keeps them beside a placeholder (engine/quantized_experts.py)."""
    for name, module in model.named_modules():
        weights = {n: getattr(module, n, None) for n in ("gate_up_proj", "down_proj")}
        if not all(hasattr(w, "dtype") for w in weights.values()):
            continue
        out: dict = {"module": name, "experts_modules": 1 + sum(
            1 for n, m in model.named_modules() if n != name and hasattr(getattr(m, "down_proj", None), "dtype")
            and hasattr(getattr(m, "gate_up_proj", None), "dtype"))}
        for n, w in weights.items():
            state = getattr(w, "quant_state", None)
            out[n] = f"{type(w).__name__} {str(w.dtype).removeprefix('torch.')} {list(w.shape)}" + (
                f" {state.quant_type}" if state is not None else "")
        from studio.engine.quantized_experts import packed_experts

        packed = packed_experts(module)
        if packed:
            out["studio_packed"] = {n: p.quant_type for n, p in packed.items()}
        return out
    return None


def _fresh(cuda: bool) -> None:
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def hf_side(folder: Path, workloads: list[str], warmup: int, work: Path, targets: list[str] | None = None,
            target_parameters: list[str] | None = None, kbit_prep: bool = True) -> dict:
    """The HF + PEFT loop on Studio's micro-batches, from Studio's initial adapters, each workload.
    ``targets``: the LoRA modules (default every linear projection); ``target_parameters``: PEFT's
    adapters on parameters (a mixture of experts' 3-D expert weights); ``kbit_prep``: PEFT's
    ``prepare_model_for_kbit_training``, which also casts every 16-bit parameter to fp32 (off: the
    model frozen and checkpointed as it does, its 16-bit weights left as loaded)."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    kwargs: dict = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if cuda:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    ckpt = {"use_reentrant": False}
    if cuda and kbit_prep:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs=ckpt)
    else:
        model.requires_grad_(False)
        model.enable_input_require_grads()  # checkpointed layers need an input that requires grad
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt)
    torch.manual_seed(SEED)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, bias="none",
                                             target_modules=targets or lora_targets(folder),
                                             target_parameters=target_parameters, task_type="CAUSAL_LM"))
    model.train()
    out: dict = {"load_s": round(time.perf_counter() - t0, 1), "workloads": {},
                 "experts_implementation": getattr(model.config, "_experts_implementation", None),
                 "experts": expert_storage(model)}
    named = dict(model.named_parameters())
    for workload in workloads:
        batches_file, init_file = work / f"batches_{workload}.pt", work / f"init_{workload}.pt"
        if not batches_file.exists():
            out["workloads"][workload] = {"error": "Studio's side left no micro-batches for it"}
            continue
        init = torch.load(init_file)
        missing = sorted(set(init) ^ {n for n, p in named.items() if p.requires_grad})
        with torch.no_grad():
            for name, value in init.items():
                if name in named:
                    named[name].copy_(value)
        _fresh(cuda)
        result = _loop(model, torch.load(batches_file), warmup, cuda)
        result["init"] = "Studio's" if not missing else f"own ({len(missing)} names differ, e.g. {missing[0]})"
        out["workloads"][workload] = result
    return out


def unsloth_side(folder: Path, workloads: list[str], warmup: int, work: Path, seq: int | None = None,
                 targets: list[str] | None = None, target_parameters: list[str] | None = None) -> dict:
    """Unsloth 2026.10.9 (4-bit, its offloaded checkpointing) on Studio's micro-batches, each workload
    from its own adapters' initial weights. ``seq``: the longest sequence (default the workloads');
    ``targets`` and ``target_parameters`` as :func:`hf_side`'s."""
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import unsloth  # noqa: F401 - first, so that its patches apply before transformers loads
    from unsloth import FastLanguageModel

    longest = seq or max(WORKLOADS[w][0] for w in workloads)
    t0 = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(str(folder), max_seq_length=longest, load_in_4bit=True, dtype=None)
    model = FastLanguageModel.get_peft_model(model, r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                             target_modules=targets or lora_targets(folder), bias="none",
                                             target_parameters=target_parameters,
                                             use_gradient_checkpointing="unsloth", random_state=SEED)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    out: dict = {"load_s": round(time.perf_counter() - t0, 1), "workloads": {},
                 "version": getattr(unsloth, "__version__", "?"), "experts": expert_storage(model)}
    for workload in workloads:
        batches_file = work / f"batches_{workload}.pt"
        if not batches_file.exists():
            out["workloads"][workload] = {"error": "Studio's side left no micro-batches for it"}
            continue
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in init:
                    p.copy_(init[name])
        _fresh(True)
        out["workloads"][workload] = _loop(model, torch.load(batches_file), warmup, True, autocast=False)
    return out


# ------------------------------------------------------------------------------------ the driver


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "triton", "liger-kernel", "unsloth",
                 "unsloth_zoo"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _gpu_name() -> str:
    code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() or "unknown"


def _commit(given: str | None) -> str:
    if given:
        return given
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() if done.returncode == 0 else "unknown (pass --commit)"


def _child(args: argparse.Namespace) -> int:
    """One side in this fresh process: RESULT and its measurement as JSON on the last line."""
    work, folder = Path(args.work), Path(args.model_dir)
    workloads = args.workloads.split(",")
    shapes = TINY_WORKLOADS if args.tiny else WORKLOADS
    try:
        if args.child == "studio":
            seq, micro_batch = shapes[workloads[0]]
            result = studio_side(folder, workloads[0], seq, micro_batch, args.steps, args.warmup, work)
        elif args.child == "hf":
            result = hf_side(folder, workloads, args.warmup, work)
        else:
            result = unsloth_side(folder, workloads, args.warmup, work)
    except Exception as exc:  # noqa: BLE001 - an out-of-memory or a model a side cannot load is a result
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _run(cmd: list[str], env: dict, log: Path, timeout: float | None = None) -> dict:
    """A side's process: its RESULT, or an error (its stderr's end, or the ``timeout`` it ran past)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        log.write_text(out + "\n--- stderr ---\n" + err)
        return {"error": f"timed out after {timeout:.0f} s (the call's deadline)"}
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"error": (done.stderr or "no output")[-400:]}


def _gib(value) -> float | None:
    return round(value / 2**30, 2) if isinstance(value, (int, float)) else None


def summarize(family: str, studio: dict, hf: dict, unsloth: dict) -> dict:
    """The summary entry of each workload, keyed ``<family>/<workload>``."""
    out = {}
    for workload, s in studio.items():
        h = hf.get("workloads", {}).get(workload, {})
        u = unsloth.get("workloads", {}).get(workload, {})
        entry = {"studio_tokens_per_s": s.get("tokens_per_s"), "unsloth_tokens_per_s": u.get("tokens_per_s"),
                 "baseline_tokens_per_s": h.get("tokens_per_s"),
                 "studio_peak_reserved_gib": _gib(s.get("peak_reserved")),
                 "unsloth_peak_reserved_gib": _gib(u.get("peak_reserved")),
                 "baseline_peak_reserved_gib": _gib(h.get("peak_reserved")), "studio_path": s.get("path")}
        if entry["studio_tokens_per_s"] and entry["unsloth_tokens_per_s"]:
            entry["studio_vs_unsloth"] = round(entry["studio_tokens_per_s"] / entry["unsloth_tokens_per_s"], 3)
        if entry["studio_tokens_per_s"] and entry["baseline_tokens_per_s"]:
            entry["studio_vs_baseline"] = round(entry["studio_tokens_per_s"] / entry["baseline_tokens_per_s"], 3)
        ours, theirs = s.get("losses") or [], h.get("losses") or []
        if ours and len(ours) == len(theirs):
            worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(ours, theirs, strict=True))
            entry["loss_max_rel_diff"] = round(worst, 5)
            entry["losses_within_1pct"] = worst <= LOSS_TOLERANCE
        out[f"{family}/{workload}"] = entry
    return out


def measure_family(family: str, args: argparse.Namespace, env: dict, start: float,
                   progress: Callable[[dict], None] = lambda entry: None) -> dict:
    """Build the family's model, run Studio (a process a workload), the HF loop and Unsloth;
    ``progress`` gets the entry so far after each side (a call cut short by its time limit keeps
    the sides that finished)."""
    work = Path(tempfile.mkdtemp(prefix=f"families_{family}_"))
    folder = Path(args.models_dir or work) / f"{family}{'-tiny' if args.tiny else ''}"
    entry: dict = {"family": family, "config_from": FAMILIES[family]}
    me = [sys.executable, str(Path(__file__).resolve())]
    if not (folder / "tokenizer.json").exists():
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
                f"from bench.families import build_model; build_model({family!r}, Path({str(folder)!r}), {args.tiny!r})")
        t0 = time.perf_counter()
        built = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        entry["build_s"] = round(time.perf_counter() - t0, 1)
        if built.returncode != 0:
            entry["error"] = f"the model did not build: {built.stderr[-400:]}"
            return entry
    entry["config"] = json.loads((folder / "config.json").read_text())
    common = ["--model-dir", str(folder), "--work", str(work), "--steps", str(args.steps), "--warmup",
              str(args.warmup)] + (["--tiny"] if args.tiny else [])
    workloads = args.only.split(",") if args.only else list(WORKLOADS)
    studio = {}
    for workload in workloads:
        if time.perf_counter() - start > args.budget_s:
            studio[workload] = {"skipped": "time budget"}
            continue
        t0 = time.perf_counter()
        left = max(1.0, args.deadline_s - (time.perf_counter() - start)) if args.deadline_s else None
        studio[workload] = _run(me + ["--child", "studio", "--workloads", workload] + common, env,
                                work / f"studio_{workload}.log", timeout=left)
        studio[workload]["wall_s"] = round(time.perf_counter() - t0, 1)
    sides: dict[str, dict] = {"hf": {}, "unsloth": {}}

    def report() -> dict:
        entry.update(studio=studio, baseline=sides["hf"], unsloth=sides["unsloth"], logs=str(work),
                     summary=summarize(family, studio, sides["hf"], sides["unsloth"]))
        return entry

    progress(report())
    for side in ("hf", "unsloth"):
        if side == "unsloth" and args.tiny:
            sides[side] = {"skipped": "--tiny: Unsloth needs a GPU"}
            continue
        if time.perf_counter() - start > args.budget_s:
            sides[side] = {"skipped": "time budget"}
            continue
        t0 = time.perf_counter()
        left = max(1.0, args.deadline_s - (time.perf_counter() - start)) if args.deadline_s else None
        sides[side] = _run(me + ["--child", side, "--workloads", ",".join(workloads)] + common, env,
                           work / f"{side}.log", timeout=left)
        sides[side]["wall_s"] = round(time.perf_counter() - t0, 1)
        progress(report())
    return report()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3-8b", help=f"one of {', '.join(FAMILIES)}, or all")
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--steps", type=int, default=13, help="optimizer steps a workload")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU: Studio and the HF loop")
    parser.add_argument("--models-dir", help="where the built models go (reused when there)")
    parser.add_argument("--commit", help="the commit this tree is (default: git rev-parse HEAD)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no side after this many seconds")
    parser.add_argument("--deadline-s", type=float, help="stop a running side after this many seconds "
                        "(its log stays, its error says so), so a call's own time limit never loses the file")
    parser.add_argument("--only", help=f"comma-separated workloads to run (default: all of {', '.join(WORKLOADS)})")
    parser.add_argument("--child", choices=("studio", "hf", "unsloth"), help=argparse.SUPPRESS)
    parser.add_argument("--workloads", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    if not args.out:
        parser.error("--out is required")
    families = list(FAMILIES) if args.family == "all" else args.family.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES)} or all")
    start = time.perf_counter()
    env = child_env(args.tiny)
    result = {"what": "Studio (Trainer) vs Unsloth vs the HF + PEFT loop per family, same micro-batches and seed; "
                      "NF4, LoRA r16 on every projection, AdamW 2e-4 constant, checkpointing",
              "command": " ".join(["python3", "bench/families.py", *sys.argv[1:]]), "commit": _commit(args.commit),
              "gpu": _gpu_name(), "versions": _versions(), "tiny": args.tiny, "steps": args.steps,
              "warmup": args.warmup, "workloads": TINY_WORKLOADS if args.tiny else WORKLOADS,
              # switches that change a side's code path (UNSLOTH_COMPILE_DISABLE where its compile fails)
              "environment": {k: v for k, v in os.environ.items() if k.startswith(("UNSLOTH_", "STUDIO_"))},
              "families": {}, "summary": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write(entry: dict) -> None:
        result["families"][entry["family"]] = entry
        result["summary"].update(entry.get("summary", {}))
        result["wall_s"] = round(time.perf_counter() - start, 1)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    for family in families:
        entry = measure_family(family, args, env, start, write)
        write(entry)
        for key, row in entry.get("summary", {}).items():
            print(f"{key}: studio {row['studio_tokens_per_s'] or 0:.0f} tok/s ({row['studio_path']}), unsloth "
                  f"{row['unsloth_tokens_per_s'] or 0:.0f}, baseline {row['baseline_tokens_per_s'] or 0:.0f}; peak "
                  f"GiB {row['studio_peak_reserved_gib']} / {row['unsloth_peak_reserved_gib']} / "
                  f"{row['baseline_peak_reserved_gib']}; losses within 1%: {row.get('losses_within_1pct')}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
