"""The other two sides of bench/vram_accuracy.py's rows (and bench/vram_measure.py's): Studio's own Trainer and Unsloth.

Each function runs in a fresh process (the driver starts one per row), trains a few steps on
full-length rows of random-ish text, and returns the peaks, the speed and what ran:

- :func:`run_trainer` goes through ``studio.engine.train.Trainer``, the real engine (its path
  decision, fast path, CUDA graphs, evaluation and adapter save included), then answers one
  held-out prompt through the session's ``generate`` (what the worker's chat calls). Its peaks are
  read four times: once the model is loaded (the load's own peak: a mixture of experts' loader can
  hold 16-bit experts before packing them), over the training steps (the load included), over the
  training run (final evaluation and save too), and over the generation alone; the row's peak is the
  largest. The Trainer's per-step peak reset is turned off so nothing is lost between them.
- :func:`run_unsloth` loads the same folder with Unsloth's FastLanguageModel (4-bit, its offloaded
  checkpointing, dropout 0) and trains with a plain loop (Unsloth patches transformers globally,
  which is why it never shares a process with the others).

Tokens/s is timed from the end of step ``warmup`` to the end of the last step.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAINER_TEMPLATE = "{instruction}\n{output}"
"""The prompt template of the Trainer rows (bench/vram_accuracy.py re-renders their short rows with it)."""

GENERATE_NEW_TOKENS = 64
"""New tokens of the generation phase: exactly this many (a random model's answer ignores EOS)."""


def child_env(tiny: bool) -> dict:
    """The environment of a benchmark's side processes: this tree importable, offline, the engine's own
    allocator setting; on the CPU (``tiny``) the fast path forced on, else left to the path decision."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the engine's own setting
    env["HF_HUB_OFFLINE"] = "1"
    if tiny:  # the CPU: the fast path forced on (it is off on a CPU otherwise)
        env.update(CUDA_VISIBLE_DEVICES="", STUDIO_FAST_PATH="1")
    else:
        env.pop("STUDIO_FAST_PATH", None)
    return env


def long_rows(path: Path, rows: int, seq: int, seed: int = 0) -> Path:
    """A JSONL of instruction rows whose rendered text runs past ``seq`` tokens of the tiny
    tokenizer, so each becomes one full-length (truncated) example; made of the sample data."""
    sample = ROOT / "sample_data" / "code_alpaca_sample.jsonl"
    pool = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    # The tiny tokenizer gives ~2-3 characters a token and an output is ~150 characters: seq // 16
    # outputs run well past seq tokens, so every row is cut to exactly seq and every micro-batch has
    # one layout (seq // 64 left some rows short at seq 2048: packed layouts varied, and each new one
    # cost a CUDA graph capture inside the timed steps).
    picks = max(24, seq // 16)
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(rows):
            chosen = [pool[rng.randrange(len(pool))] for _ in range(picks)]
            out.write(json.dumps({"instruction": chosen[0]["instruction"],
                                  "output": "\n\n".join(c["output"] for c in chosen)}) + "\n")
    return path


def short_rows(path: Path, copies: int = 4) -> Path:
    """The sample's short instruction rows (a few hundred tokens or less each), ``copies`` times."""
    sample = ROOT / "sample_data" / "code_alpaca_sample.jsonl"
    rows = [json.loads(line) for line in sample.read_text().splitlines() if line.strip()]
    with open(path, "w", encoding="utf-8") as out:
        for _ in range(copies):
            for row in rows:
                out.write(json.dumps({"instruction": row["instruction"], "output": row["output"]}) + "\n")
    return path


def _trainer(config, run, emit):
    """Studio's Trainer over a Session that owns the loaded model."""
    from studio.engine.session import Session
    from studio.engine.train import Trainer

    return Trainer(Session(config, run, emit))


def trainer_config(case, folder: Path, data: Path, steps: int, cuda: bool):  # -> RunConfig
    """The run config a Trainer row trains with: ``case``'s setup on the model in ``folder`` and the
    rows in ``data``, one final evaluation of a micro-batch, no checkpoints, a chat answer of
    :data:`GENERATE_NEW_TOKENS` new tokens."""
    from studio.core.config import RunConfig

    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits = {"nf4": 4, "fp4": 4, "int8": 8}.get(case.weights)
    config.quantization.compute_dtype = "bfloat16" if cuda else "float32"
    config.lora.r, config.lora.alpha, config.lora.dropout = case.r, 2 * case.r, case.dropout
    config.lora.target_modules = "all-linear" if len(case.targets) == 7 else list(case.targets)
    config.lora.target_experts = getattr(case, "experts", False)  # a mixture of experts' own adapters
    config.prompt.template = TRAINER_TEMPLATE
    config.data.path = str(data)
    config.data.max_seq_length = case.seq
    config.data.val_fraction = 0.05
    t = config.trainer
    t.max_steps, t.micro_batch_size, t.effective_batch_size = steps, case.micro_batch, case.micro_batch
    t.gradient_checkpointing, t.optimizer, t.packing = case.checkpointing, case.optimizer, case.packing
    # one evaluation batch at the end (the phase that used to need full fp32 logits), no mid-run ones
    t.eval_interval, t.eval_max_rows, t.checkpoint_interval = 0, case.micro_batch, 0
    config.generation.max_new_tokens = GENERATE_NEW_TOKENS  # the chat answers (between two steps, after training)
    return config


def run_trainer(case, folder: Path, steps: int, warmup: int, work: Path) -> dict:
    """One row through Studio's Trainer: peaks (training steps; whole run), tokens/s, the path, and
    the run config it trained with."""
    import torch

    import studio.engine.memory as memory
    from bench.speed import fast_facts
    from studio.core import events as ev
    from studio.core.runs import create_run

    cuda = torch.cuda.is_available()
    if getattr(case, "data", "long") == "short":
        data = short_rows(work / "short_rows.jsonl")
    else:
        data = long_rows(work / f"rows_{case.seq}.jsonl", max(64, case.micro_batch * (steps + 2) * 2), case.seq)
    config = trainer_config(case, folder, data, steps, cuda)
    config.output_dir = str(work / "runs")

    steps_seen: list = []
    notes: list[str] = []
    train_peak: dict[str, int] = {}
    trainer_box: list = []
    captured: set = set()  # every layout seen captured at a step's end (a widened one replaces its own)

    def emit(event) -> None:
        if isinstance(event, ev.ModelLoaded) and cuda:  # the load's own peak: a mixture of experts' can be the run's
            counters = memory.allocator_counters(torch.device("cuda"))
            train_peak["load_allocated"] = counters["peak_allocated"]
            train_peak["load_reserved"] = counters["peak_reserved"]
        elif isinstance(event, ev.StepLogged):
            steps_seen.append(event)
            if cuda:  # one reading of the allocator's counters: this runs between two timed steps
                counters = memory.allocator_counters(torch.device("cuda"))
                # max: the answer between steps resets the counters (between_steps below)
                train_peak["allocated"] = max(train_peak.get("allocated", 0), counters["peak_allocated"])
                train_peak["reserved"] = max(train_peak.get("reserved", 0), counters["peak_reserved"])
                graphs = getattr(getattr(trainer_box[0].session, "fast", None), "_graphs", None) \
                    if trainer_box else None
                if graphs is not None:  # counted while training: the graphs are given back at its end
                    train_peak["graphs"] = max(train_peak.get("graphs", 0), len(graphs.graphed))
                    captured.update(graphs.graphed)
        elif isinstance(event, ev.WorkerFailed):
            notes.append(f"{event.kind}: {event.message}")

    lever = getattr(case, "lever", "")
    if lever:  # one of the fast path's settings switched (the defaults otherwise)
        from bench.speed import LEVERS
        from studio.core.config import FastPathConfig

        config.trainer.fast_path = FastPathConfig(**LEVERS[lever])
    # The Trainer resets the peak before every step (its memory events are per step); a benchmark of
    # the whole run's peak must not lose the earlier steps'.
    memory.reset_peak = lambda device=None: None
    trainer = _trainer(config, create_run(config), emit)
    trainer_box.append(trainer)
    between: dict = {}
    if steps >= 2:
        trainer.between_steps = _answer_between_steps(steps - 1, case.seq, between, train_peak)
    t0 = time.perf_counter()
    finished = trainer.train()
    wall = time.perf_counter() - t0
    fast = getattr(trainer, "fast", None)
    if fast is None and hasattr(trainer, "session"):
        fast = trainer.session.fast
    row = {"engine": "trainer", "lever": lever, "path": "fast" if fast is not None else "plain",
           "config": config.to_dict(), "fast_path": fast_facts(fast), "notes": notes,
           "losses": [e.loss for e in steps_seen], "steps": finished.step, "wall_s": round(wall, 1),
           # each logged step's end, seconds since training began (where a slow step sits)
           "step_end_s": [round(e.elapsed_s, 4) for e in steps_seen]}
    # what sized the steps, so that a row can be re-scored offline from the lengths it trained on
    seen = [b.tokens_seen - a.tokens_seen for a, b in zip(steps_seen, steps_seen[1:], strict=False)]
    row["max_step_tokens"] = max([steps_seen[0].tokens_seen, *seen]) if steps_seen else 0
    row["longest_examples"] = sorted((len(e.input_ids) for e in trainer.session.data.train), reverse=True)[:32]
    if len(steps_seen) > warmup:
        a, b = steps_seen[warmup - 1], steps_seen[-1]
        row["tokens_per_s"] = (b.tokens_seen - a.tokens_seen) / max(b.elapsed_s - a.elapsed_s, 1e-9)
    if cuda:
        torch.cuda.synchronize()
        # the run's peaks: since the answer between steps reset the counters, and before it
        row["run_peak_allocated"] = max(torch.cuda.max_memory_allocated(), between.get("run_allocated", 0))
        row["run_peak_reserved"] = max(torch.cuda.max_memory_reserved(), between.get("run_reserved", 0))
        row["train_peak_allocated"] = train_peak.get("allocated", 0)
        row["train_peak_reserved"] = train_peak.get("reserved", 0)
        row["load_peak_allocated"] = train_peak.get("load_allocated", 0)
        row["load_peak_reserved"] = train_peak.get("load_reserved", 0)
        torch.cuda.reset_peak_memory_stats()  # the generation's own peaks from here
    row.update(generate_phase(trainer.session, case.seq, GENERATE_NEW_TOKENS))
    row.update({f"between_steps_{k}": v for k, v in between.get("answer", {}).items()})
    if cuda:
        row["peak_allocated"] = max(row["run_peak_allocated"], row["generate_peak_allocated"],
                                    row.get("between_steps_generate_peak_allocated", 0))
        row["peak_reserved"] = max(row["run_peak_reserved"], row["generate_peak_reserved"],
                                   row.get("between_steps_generate_peak_reserved", 0))
        if fast is not None and getattr(fast, "_graphs", None) is not None:
            row["graphs"] = train_peak.get("graphs", 0)  # the most alive at once
            row["captures"] = len(captured)
            row["graphs_failed"] = getattr(fast._graphs, "failed", None)
    return row


def _answer_between_steps(at_step: int, seq: int, out: dict, train_peak: dict):
    """The Trainer's between-steps hook for a row: after step ``at_step`` (one with a step after it:
    the optimizer's state and the CUDA graphs' pools still held) it answers as the worker's chat
    does between two steps (server.py's ``_serve_anytime``), the answer's own peaks in
    ``out["answer"]``. That moment, not the answer after training (which has given back both), is
    what the estimate's generation phase models (core/memory/phases.py). The run's peaks so far go
    to ``out["run_*"]`` first, and the counters are reset again after the answer, so the training
    peaks read later are the steps' own."""
    import torch

    from studio.engine import memory

    def hook(trainer) -> None:
        if trainer.step != at_step or "answer" in out:
            return None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            counters = memory.allocator_counters(torch.device("cuda"))
            out["run_allocated"], out["run_reserved"] = counters["peak_allocated"], counters["peak_reserved"]
            train_peak["allocated"] = max(train_peak.get("allocated", 0), counters["peak_allocated"])
            train_peak["reserved"] = max(train_peak.get("reserved", 0), counters["peak_reserved"])
            torch.cuda.reset_peak_memory_stats()
        out["answer"] = generate_phase(trainer.session, seq, GENERATE_NEW_TOKENS)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        return None

    return hook


def held_out_prompt(session, tokens: int) -> dict:
    """An instruction of the session's validation rows (their text repeated as needed) whose
    rendered prompt is about ``tokens`` tokens of the run's tokenizer: as long as a training row."""
    data = session.data
    rows = data.validation_rows or data.test_rows or []
    text = "\n".join(str(v) for row in rows for v in row.values() if isinstance(v, str)) or "Explain."
    tok = session.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < tokens:
        ids = ids + ids
    overhead = len(tok.encode(session.render_prompt({"instruction": ""}), add_special_tokens=False)) + 1
    return {"instruction": tok.decode(ids[:max(1, tokens - overhead)], skip_special_tokens=True)}


def generate_phase(session, prompt_tokens: int, new_tokens: int) -> dict:
    """Chat's generation after training: one held-out prompt of about ``prompt_tokens`` tokens
    answered with the adapter through ``session.generate`` (the worker's chat path), greedy, exactly
    ``new_tokens`` new tokens (stop tokens are ignored: a random model may pick EOS at any point).
    On CUDA, its own peaks (the caller resets them first)."""
    import torch

    import studio.engine.generate as gen

    prompt = held_out_prompt(session, prompt_tokens)
    n_prompt = len(gen.prompt_ids(session.tokenizer, session.render_prompt(prompt)))
    stops = gen.stop_ids
    gen.stop_ids = lambda model, tokenizer: set()
    try:
        t0 = time.perf_counter()
        answer = session.generate(prompt, adapter=True, max_new_tokens=new_tokens, temperature=0.0)
        seconds = time.perf_counter() - t0
    finally:
        gen.stop_ids = stops
    out = {"generate_prompt_tokens": n_prompt, "generate_new_tokens": answer.new_tokens,
           "generate_s": round(seconds, 2), "generate_kv_cache": "host" if answer.kv_on_host else "card"}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        out["generate_peak_allocated"] = torch.cuda.max_memory_allocated()
        out["generate_peak_reserved"] = torch.cuda.max_memory_reserved()
    return out


def run_unsloth(case, folder: Path, steps: int, warmup: int) -> dict:
    """One row through Unsloth 2026.10.9 (4-bit NF4 only): peaks and tokens/s over a plain loop."""
    import os

    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import unsloth  # noqa: F401 - first, so that its patches apply before transformers loads
    from unsloth import FastLanguageModel

    t0 = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(str(folder), max_seq_length=case.seq, load_in_4bit=True,
                                                 dtype=None)
    model = FastLanguageModel.get_peft_model(model, r=case.r, lora_alpha=2 * case.r, lora_dropout=case.dropout,
                                             target_modules=list(case.targets), bias="none",
                                             use_gradient_checkpointing="unsloth", random_state=0)
    load_s = time.perf_counter() - t0
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    ends, losses = [], []
    for _ in range(steps):
        ids = torch.randint(3, vocab, (case.micro_batch, case.seq), generator=generator).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # a sync point: the step has finished on the GPU
        ends.append(time.perf_counter())
    tokens = case.micro_batch * case.seq * (steps - warmup)
    return {"engine": "unsloth", "path": "unsloth", "load_s": round(load_s, 1), "losses": losses,
            "tokens_per_s": tokens / (ends[-1] - ends[warmup - 1]),
            "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "versions": {"unsloth": getattr(unsloth, "__version__", "?")}}
