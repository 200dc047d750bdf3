"""`studio estimate CONFIG [--gpu-gb 16] [--json] [--model M]`: predicted GPU memory by category.

With ``trainer.micro_batch_size`` or ``gradient_checkpointing`` left ``auto`` (the default), the
estimate is of the plan a run would choose on the card (core/memory/autoplan.py), and the report shows that
plan and the alternatives rejected, with why (``--json``: ``"auto_plan"``).

Plain Python (no torch): it answers in a fraction of a second on a laptop with no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from studio.core.config import ConfigError, RunConfig, load_config
from studio.core.memory import CATEGORIES, OPTIONAL_CATEGORIES, Estimate, autoplan, estimate
from studio.core.memory.gpus import GB, detect_gpus, gpu_for_size
from studio.core.memory.lengths import data_lengths
from studio.core.memory.multigpu import requested_gpus
from studio.core.model.info import ModelInfoError, load_model_info

DEFAULT_GPU_GB = 24.0
"""Capacity assumed when no card is detected and none is given: the common 24 GB cards."""


def batch_line(config: RunConfig) -> str:
    """The effective batch, and on several GPUs that the memory above is each card's."""
    t, gpus = config.trainer, requested_gpus(config)
    line = f"effective batch {t.effective_batch(gpus)} = micro-batch {t.micro_batch()} x " \
           f"{t.accumulation_steps()} accumulation"
    if gpus > 1:
        line += (f" x {gpus} GPUs; the memory above is each GPU's (each holds the model, its LoRA and "
                 "optimizer; NCCL's buffers, a few hundred MB, are not counted)")
    return line


def format_table(result: Estimate, model: str, gpu_name: str, config: RunConfig | None = None) -> str:
    """The human-readable report: one line per category, the total and the verdict."""
    plan = result.plan
    lines = [f"{model}: {plan.stored}, "
             + (f"LoRA r{plan.lora_r} on {len(plan.lora_targets)} modules" if plan.lora_r
                else "full fine-tuning (every weight trains, no adapter)")
             + f", micro-batch {plan.micro_batch} x {plan.seq_len} tokens, "
             + ("checkpointing" if plan.checkpointing or plan.path == "fast" else "no checkpointing")
             + f", {plan.optimizer}",
             f"path: {plan.path}" + (f" ({result.choice.reason})" if result.choice else ""),
             ""]
    for name in CATEGORIES:
        if name not in OPTIONAL_CATEGORIES or result.categories[name]:
            lines.append(f"  {name:<12} {result.categories[name] / GB:8.2f} GB")
    lines.append(f"  {'total':<12} {result.total / GB:8.2f} GB")
    lines.append(f"  (peak allocated {result.peak_allocated / GB:.2f} GB, reserved {result.peak_reserved / GB:.2f}"
                 " GB: what torch.cuda reports)")
    lines.append("")
    lines.extend(phase_lines(result))
    lines.append(length_line(result))
    lines.append("")
    if result.capacity is not None:
        verdict = "fits" if result.fits else "does NOT fit"
        lines.append(f"{verdict} on {gpu_name} ({result.capacity / GB:.1f} GB); largest micro-batch that fits: "
                     f"{result.max_micro_batch}")
    if config is not None:
        lines.append(batch_line(config))
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)


def phase_lines(result: Estimate) -> list[str]:
    """Each phase of a run with its peak reserved, and which one sets the peak (core/memory/phases.py)."""
    out = [f"peak set by the {result.peak_phase} (the table is that moment's)"]
    for name, peak in result.phases.items():
        mark = "*" if name == result.peak_phase else " "
        out.append(f" {mark}{name:<16} allocated {peak.allocated / GB:6.2f} GB, reserved {peak.reserved / GB:6.2f} GB"
                   f"  ({peak.held})")
    return out


def length_line(result: Estimate) -> str:
    """Whether the step was sized from the data's token lengths or from data.max_seq_length."""
    plan = result.plan
    if plan.data_sized:
        return (f"token lengths: from the data ({len(plan.lengths)} examples, longest {plan.row_len} tokens): "
                f"a micro-batch of {plan.micro_batch} holds at most {plan.real_tokens} real tokens")
    why = ("packing fills every row" if plan.packing else "preference pairs" if plan.sequences_per_example > 1
           else "the data or the model's tokenizer is not readable here")
    return f"token lengths: every row data.max_seq_length ({plan.seq_len}) tokens long ({why})"


class EstimateFailed(Exception):
    """An estimate that could not be made; the message names the file and key, and what to do."""


@dataclass(frozen=True)
class EstimateReport:
    """What ``studio estimate`` says about a config: the estimate of the plan it would run, on which
    card, and the automatic plan (or why no plan fits)."""

    result: Estimate
    config: RunConfig
    """The config as estimated: the automatic plan's micro-batch and checkpointing filled in."""
    model: str
    gpu_name: str
    planned: autoplan.Planned
    """How ``auto`` was resolved: the plan, or why none fits (the estimate is then the smallest plan's)."""

    def text(self) -> str:
        """The table ``studio estimate`` prints."""
        return "\n".join([format_table(self.result, self.model, self.gpu_name, self.config),
                          *self.planned.lines()])

    def to_json_dict(self) -> dict:
        """What ``studio estimate --json`` prints (bytes): the estimate's shape and ``auto_plan``."""
        data = self.result.to_json_dict()  # a documented shape: the batch line is the table's
        plan, refused = self.planned.plan, self.planned.refused
        data["auto_plan"] = plan.to_json_dict() if plan else (
            {"error": str(refused), "rejected": [c.to_json_dict() for c in refused.rejected]} if refused else None)
        return data


def estimate_config(config: RunConfig, source: str, base_dir: Path | None = None, model: str | None = None,
                    gpu_gb: float | None = None) -> EstimateReport:
    """Estimate ``config`` (read from ``source``, which error messages name; relative data paths are
    read from ``base_dir``) for ``model`` (default: its base model) on a card of ``gpu_gb`` GB
    (default: the card detected, else 24 GB). Raises EstimateFailed."""
    try:
        model = model or config.model.base_model
        info = load_model_info(model, config.model.revision)
        if gpu_gb is not None:
            gpu = gpu_for_size(gpu_gb)
        else:
            detected = detect_gpus()
            gpu = detected[0] if detected else gpu_for_size(DEFAULT_GPU_GB)
        # unpacked runs are sized from the data's token lengths when the data and tokenizer are here
        lengths, _why = data_lengths(config, base_dir=base_dir) if not config.trainer.packing else ((), "")
        planned = autoplan.plan_or_smallest(config, info, gpu.capacity, lengths=lengths)
        config = planned.config  # with nothing fitting, the smallest plan's estimate, and why none fits
        result = estimate(config, info, gpu.capacity, lengths=lengths)
    except (ConfigError, ModelInfoError) as exc:
        raise EstimateFailed(str(exc)) from None
    except ValueError as exc:  # a LoRA target the model lacks
        raise EstimateFailed(f"{source}: {exc}") from None
    return EstimateReport(result, config, model, gpu.name, planned)


def main(args: argparse.Namespace) -> int:
    """Handler for ``studio estimate``: prints the table (or JSON with --json); 1 on an error a
    person can fix (the message names the file and key)."""
    try:
        config = load_config(args.config)
        report = estimate_config(config, args.config, Path(args.config).parent, getattr(args, "model", None),
                                 getattr(args, "gpu_gb", None))
    except (ConfigError, EstimateFailed) as exc:
        print(f"studio estimate: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json_dict()) if getattr(args, "json", False) else report.text())
    return 0
