"""Events as text: the one place that words and units what a run reports, for every front end.

``studio train``, ``studio attach`` and the TUI's training pane all print events through these
functions, so the same event reads the same everywhere. Memory is in decimal gigabytes
(``studio.core.memory.gpus.GB``, 10^9 bytes), the unit of the VRAM gauge's squares and of card sizes;
durations read ``2m05s``; rates ``1,234 tok/s``; losses four decimals.

Plain Python: no Textual, no torch.
"""

from __future__ import annotations

import math

from studio.core import events as ev
from studio.core.config import effective_batch
from studio.core.memory.gpus import GB
from studio.core.runs.cells import cell

MB = 10**6
"""Decimal megabyte, for sizes under a gigabyte."""

_FAILURE_LABELS = {"oom": "Out of memory", "data": "Data error", "config": "Config error",
                   "reward": "Reward error"}


def format_bytes(count: int | None) -> str:
    """Bytes as ``1.23 GB`` or ``456 MB`` (decimal units, as the gauge); ``--`` when unknown (0)."""
    if not count:
        return "--"
    if count >= GB:
        return f"{count / GB:.2f} GB"
    return f"{count / MB:.0f} MB"


def format_duration(seconds: float | None) -> str:
    """``2d03h``, ``1h02m``, ``3m05s`` or ``12s``; ``--`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_rate(tokens_per_s: float) -> str:
    """``1,234 tok/s``."""
    return f"{tokens_per_s:,.0f} tok/s"


def format_loss(loss: float | None) -> str:
    """A loss to four decimals; ``--`` when unknown."""
    return "--" if loss is None else f"{loss:.4f}"


def memory_text(event: ev.MemorySampled) -> str:
    """``3.00 GB in use, peak 4.00 GB of 80.00 GB`` (the capacity when the device has one)."""
    text = f"{format_bytes(event.allocated or event.reserved)} in use, peak {format_bytes(event.peak_allocated)}"
    if event.capacity:
        text += f" of {format_bytes(event.capacity)}"
    return text


def step_line(event: ev.StepLogged, memory: ev.MemorySampled | None = None) -> str:
    """``step 40/300  loss 1.2345  lr 2.00e-04  grad 0.512  1,234 tok/s  eta 3m05s``, ending with
    ``  mem 3.00 GB in use, peak ...`` when given the step's memory sample (the worker logs it just
    before the step): one line a step in the console, whoever prints it."""
    parts = [f"step {event.step}/{event.total_steps or '?'}", f"loss {format_loss(event.loss)}",
             f"lr {event.learning_rate:.2e}"]
    if event.grad_norm:
        parts.append(f"grad {event.grad_norm:.3f}")
    if event.tokens_per_s:
        parts.append(format_rate(event.tokens_per_s))
    if event.eta_s:
        parts.append(f"eta {format_duration(event.eta_s)}")
    if memory is not None:
        parts.append(f"mem {memory_text(memory)}")
    return "  ".join(parts)


def eval_line(event: ev.EvalLogged) -> str:
    """``eval at step 300: loss 1.2345  perplexity 3.44  token accuracy 61.0% (40 rows)``; at step 0
    ``eval of the base model (step 0): ...``, the loss before any training. A preference run's reads
    ``eval at step 30: chosen answers' perplexity 3.87  token accuracy 80.1% (60 pairs)``: its loss is
    the preference loss, which :func:`preference_line` prints, and no perplexity comes from it."""
    where = "of the base model (step 0)" if event.step == 0 else f"at step {event.step}"
    if event.method != "sft":
        return (f"eval {where}: chosen answers' perplexity {event.perplexity:.2f}  token accuracy "
                f"{event.token_accuracy:.1%} ({event.rows} pairs)")
    return (f"eval {where}: loss {format_loss(event.loss)}  perplexity {event.perplexity:.2f}  "
            f"token accuracy {event.token_accuracy:.1%} ({event.rows} rows)")


def preference_line(event: ev.PreferenceLogged) -> str:
    """``dpo step 40: loss 0.1234  train-batch accuracy 87.5%  margin 1.23  log p chosen -7.10 rejected
    -71.62 (16 pairs)``: the step's own pairs; ``dpo eval at step 40: loss ...  validation accuracy ...``
    for the validation pairs. The accuracy is the implicit reward's (DPO: against the reference),
    not ``studio eval``'s held-out preference of each model."""
    if event.split == "validation":
        where, accuracy = f"eval at step {event.step}", "validation accuracy"
    else:
        where, accuracy = f"step {event.step}", "train-batch accuracy"
    return (f"{event.method} {where}: loss {format_loss(event.loss)}  {accuracy} {event.accuracy:.1%}  "
            f"margin {event.reward_margin:.2f}  log p chosen {event.chosen_logp:.2f} rejected "
            f"{event.rejected_logp:.2f} ({event.pairs} pairs)")


def grpo_metrics(event: ev.GrpoStepLogged) -> str:
    """``reward 0.812 (exact_match 0.750, format_ok 0.938)  spread 0.214  length 18.4  kl 0.0123``."""
    parts = [f"reward {event.reward:.3f}"]
    if event.rewards:
        each = ", ".join(f"{name} {'--' if value is None else f'{value:.3f}'}" for name, value in event.rewards.items())
        parts[0] += f" ({each})"
    if event.split == "train":
        parts.append(f"spread {event.reward_std:.3f}")
    parts.append(f"length {event.completion_length:.1f}")
    if event.truncated:
        parts.append(f"cut {event.truncated:.0%}")
    if event.kl is not None:
        parts.append(f"kl {event.kl:.4f}")
    return "  ".join(parts)


def grpo_line(event: ev.GrpoStepLogged) -> str:
    """``grpo step 40: reward ...`` (``grpo eval at step 40: ...`` for the held-out prompts)."""
    where = (f"eval {'of the base model (step 0)' if event.step == 0 else f'at step {event.step}'}"
             if event.split == "validation" else f"step {event.step}")
    return f"grpo {where}: {grpo_metrics(event)} ({event.prompts} prompts)"


class StepLines:
    """Lines for a stream of events, as :func:`describe` words them, except that a step's memory
    sample (rank 0's, logged just before the step) and a GRPO step's metrics (GrpoStepLogged,
    emitted just before its StepLogged) join that step's line: one line a step. Used by
    ``studio attach`` and the foreground ``studio train``."""

    def __init__(self) -> None:
        self._grpo: ev.GrpoStepLogged | None = None
        self._memory: ev.MemorySampled | None = None

    def __call__(self, event: ev.Event) -> str | None:
        """The line for ``event``; None when it has none (yet)."""
        if isinstance(event, ev.MemorySampled) and event.rank == 0:
            self._memory = event
            return None
        if isinstance(event, ev.GrpoStepLogged) and event.split == "train":
            self._grpo = event
            return None
        if isinstance(event, ev.GrpoGroupSampled):
            return None  # a group is for browsing (the TUI's group view), not a console line
        if isinstance(event, ev.StepLogged):
            grpo, self._grpo = self._grpo, None
            memory = self._memory if self._memory is not None and self._memory.step == event.step else None
            line = step_line(event, memory)
            if grpo is not None and grpo.step == event.step:
                line += "  " + grpo_metrics(grpo)
            return line
        return describe(event)


def batch_reduced_line(event: ev.BatchSizeReduced) -> str:
    """What an out-of-memory halving did, and that training goes on."""
    text = (f"step {event.step}: out of memory; micro-batch {event.old_micro_batch_size} -> "
            f"{event.micro_batch_size}, accumulation {event.gradient_accumulation_steps} "
            "(same effective batch), training continues")
    text += f" ({event.message})" if event.message else ""
    return text + estimate_miss(event.estimated_bytes, event.capacity_bytes)


def estimate_miss(estimated: int, capacity: int) -> str:
    """How wrong the estimate was about a micro-batch that ran out of memory: ``; the estimate said
    13.10 GB would fit in 15.00 GB: it did not, so it was at least 1.90 GB (15%) low``."""
    if not estimated or not capacity:
        return ""
    if estimated > capacity:
        return f"; the estimate said {format_bytes(estimated)}, more than the card's {format_bytes(capacity)}"
    short = capacity - estimated
    return (f"; the estimate said {format_bytes(estimated)} would fit in {format_bytes(capacity)}: it did not, "
            f"so it was at least {format_bytes(short)} ({short / estimated:.0%}) low")


def autoplan_line(event: ev.AutoPlanChosen) -> str:
    """``automatic plan: micro-batch 8 x 2 accumulation, checkpointing, fast path: 9.25 GB estimated of
    16.10 GB less 1.61 GB headroom; rejected micro-batch 16 x 1, checkpointing: needs ...``."""
    what = (f"micro-batch {event.micro_batch_size} x {event.gradient_accumulation_steps} accumulation "
            f"(effective batch {event.effective_batch_size}), "
            + ("checkpointing" if event.gradient_checkpointing else "no checkpointing"))
    if event.message:
        return f"automatic plan: {what} ({event.message})"
    if event.recorded:
        return f"automatic plan: {what}, as planned at the start of this run"
    text = (f"automatic plan: {what}, {event.path} path: {format_bytes(event.estimated_bytes)} estimated of "
            f"{format_bytes(event.capacity_bytes)} less {format_bytes(event.headroom_bytes)} headroom")
    return text + "".join(f"; rejected {why}" for why in event.rejected)


def failure_line(event: ev.WorkerFailed) -> str:
    """The headline of a failure, as the training pane shows it: ``Data error: <what to do>``; a
    request that failed while the worker goes on reads ``Worker error (Generate): ...``. A console
    line is :func:`describe`'s ``error (data): <what to do>``, which a script can grep for."""
    if not event.fatal:
        return f"{_FAILURE_LABELS.get(event.kind, 'Worker error')} ({event.request or 'a request'}): {event.message}"
    if event.kind == "disk":
        return event.message[:1].upper() + event.message[1:]  # "Disk full at <path>: ..."
    return f"{_FAILURE_LABELS.get(event.kind, 'Worker error')}: {event.message}"


def warning_line(event: ev.WarningRaised) -> str:
    """``warning (data): 6 training rows are longer than ...``: the same words in the console, the
    training pane and the trackers."""
    return f"warning ({event.kind}): {event.message}"


def path_line(event: ev.ModelLoaded) -> str:
    """Which training path a run takes and why, as ``studio train``, ``studio attach`` and the
    training pane say it ("fast path: ..." or "plain path: ...")."""
    return f"{event.path} path: {event.path_reason}" if event.path_reason else f"{event.path} path"


def finished_line(event: ev.TrainingFinished) -> str:
    """``training finished at step 300: train loss 0.1234, best eval loss 0.2345, adapter -> DIR (5m02s)``."""
    how = "stopped" if event.stopped else "finished"
    best = f", best eval loss {format_loss(event.best_eval_loss)}" if event.best_eval_loss is not None else ""
    return (f"training {how} at step {event.step}: train loss {format_loss(event.train_loss)}{best}, "
            f"adapter -> {event.adapter_path} ({format_duration(event.elapsed_s)})")


def batch_text(event: ev.RunStarted) -> str:
    """"micro-batch 4 x 2 accumulation", with " x 2 GPUs = effective batch 16" on several GPUs."""
    text = f"micro-batch {event.micro_batch_size} x {event.gradient_accumulation_steps} accumulation"
    if event.gpus > 1:
        text += f" x {event.gpus} GPUs"
    effective = event.effective_batch_size or \
        effective_batch(event.micro_batch_size, event.gradient_accumulation_steps, event.gpus)
    return f"{text} = effective batch {effective}"


def describe(event: ev.Event) -> str | None:
    """One readable line for any event; None for streamed tokens (their answer gets a line)."""
    match event:
        case ev.StepLogged():
            return step_line(event)
        case ev.EvalLogged():
            return eval_line(event)
        case ev.PreferenceLogged():
            return preference_line(event)
        case ev.GrpoStepLogged():
            return grpo_line(event)
        case ev.GrpoGroupSampled():
            best = max(event.completions, key=lambda c: c.get("total", 0.0), default=None)
            return (f"grpo group at step {event.step}: {cell(event.prompt, 40)!r} -> best {best['total']:.3f} "
                    f"{cell(best.get('text', ''), 60)!r}") if best else f"grpo group at step {event.step}: empty"
        case ev.TokenGenerated():
            return None
        case ev.GenerationStarted():
            return f"generate [{'adapter' if event.adapter else 'base'}] {event.request_id}: {cell(event.prompt, 60)}"
        case ev.GenerationFinished():
            return (f"answer [{'adapter' if event.adapter else 'base'}] {event.request_id} ({event.new_tokens} "
                    f"tokens, {format_rate(event.tokens_per_s)}): {cell(event.text, 200)}")
        case ev.RunStarted():
            start = f"resumed from step {event.resumed_from_step}" if event.resumed_from_step else "started"
            return (f"training {start}: {event.total_steps} steps, {event.train_rows} train / "
                    f"{event.eval_rows} eval rows, {batch_text(event)}")
        case ev.ModelLoading():
            return f"loading model: {event.stage} {event.fraction:.0%}"
        case ev.ModelLoaded():
            quant = f", {event.quantization}" if event.quantization else ""
            line = (f"model loaded: {event.base_model} on {event.device or '?'} ({event.dtype or '?'}{quant}), "
                    f"{event.trainable_params:,} trainable of {event.total_params:,} params, "
                    f"{format_duration(event.load_seconds)}")
            return line + (f"; {path_line(event)}" if event.path else "")
        case ev.MemorySampled():
            card = f", GPU {event.rank}" if event.rank else ""
            return f"memory at step {event.step} ({event.device}{card}): {memory_text(event)}"
        case ev.CheckpointSaved():
            return f"checkpoint at step {event.step} -> {event.path}"
        case ev.TrainingPaused():
            return f"paused after step {event.step}"
        case ev.TrainingResumed():
            return f"resumed at step {event.step}"
        case ev.BatchSizeReduced():
            return batch_reduced_line(event)
        case ev.AutoPlanChosen():
            return autoplan_line(event)
        case ev.TrainingFinished():
            return finished_line(event)
        case ev.WorkerFailed():
            request = f", {event.request}" if event.request else ""
            return f"error ({event.kind}{request}): {event.message}"
        case ev.WarningRaised():
            return warning_line(event)
        case ev.WorkerStarted():
            return f"worker started (pid {event.pid})"
        case ev.WorkerStopped():
            return f"worker stopped: {event.reason}"
        case ev.HeldOutRowScored():
            tuned = f"  fine-tuned {cell(event.tuned, 30)!r}" if event.tuned is not None else ""
            if event.base_margin is not None:
                tuned += f"  margin base {event.base_margin:+.2f}" + (
                    f" fine-tuned {event.tuned_margin:+.2f}" if event.tuned_margin is not None else "")
            return (f"held-out {event.index + 1}/{event.total} ({event.split}): target "
                    f"{cell(event.target, 30)!r}  base {cell(event.base, 30)!r}{tuned}")
        case ev.HeldOutFinished():
            if not event.ok:
                return f"held-out scoring failed: {event.message}"
            tuned = (f", fine-tuned exact {event.tuned_exact_match:.1%} similarity {event.tuned_similarity:.2f}"
                     if event.tuned_exact_match is not None and event.tuned_similarity is not None else "")
            if event.base_preference_accuracy is not None:
                tuned += f", prefers chosen: base {event.base_preference_accuracy:.1%}" + (
                    f" fine-tuned {event.tuned_preference_accuracy:.1%}"
                    if event.tuned_preference_accuracy is not None else "")
            if event.base_rewards is not None:  # GRPO: the rewards' total, base -> fine-tuned
                after = (event.tuned_rewards or {}).get("total")
                return (f"held-out: {event.rows} {event.split} prompts, mean reward base "
                        f"{event.base_rewards.get('total') or 0:.3f}"
                        + (f" -> fine-tuned {after:.3f}" if after is not None else "") + f" -> {event.path}")
            return (f"held-out: {event.rows} {event.split} rows, base exact {event.base_exact_match:.1%} "
                    f"similarity {event.base_similarity:.2f}{tuned} -> {event.path}")
        case ev.StatusReported():
            return f"status: {event.state}, step {event.step}/{event.total_steps}"
    fields = {k: v for k, v in event.to_dict().items() if k not in ("type", "seq", "time")}
    return f"{type(event).__name__} " + " ".join(f"{k}={v}" for k, v in fields.items())
