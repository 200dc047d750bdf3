"""The training loop: one class you can read top to bottom.

``Trainer(config, run, emit)`` loads the model and data, then ``train()`` runs optimizer steps of
``accumulation`` micro-batches each, with warmup + schedule, gradient clipping, bf16 autocast on a
GPU, evaluation every ``eval_interval`` steps, atomic checkpoints every ``checkpoint_interval`` steps,
and the final adapter in ``runs/<id>/adapter``. Everything it has to say goes through the one
``emit`` callback as typed events (studio/core/events.py).

Exact resume: a checkpoint holds the adapter, optimizer, scheduler, RNG states and the data cursor,
and the loss of a step is averaged over the response tokens of the whole step, so that the same
units split into different micro-batches (after an out-of-memory halving) give the same step.
"""

from __future__ import annotations

import gc
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig
from studio.core.runs import RunDir
from studio.engine import checkpoint
from studio.engine import fast as fastpath
from studio.engine import generate as gen
from studio.engine.batching import IGNORE_INDEX, Cursor, DataStream, MicroBatch, eval_batches
from studio.engine.model import BaseModel, ModelLoadError, attach_lora, count_parameters, load_base

Emit = Callable[[ev.Event], None]
BetweenSteps = Callable[["Trainer"], "str | None"]

INJECT_OOM_ENV = "STUDIO_INJECT_OOM_AT_STEP"
"""Test hook: ``N`` raises one simulated CUDA out-of-memory error in step N; ``N:always`` raises it
on every attempt of step N (so the trainer gives up at micro-batch 1)."""


class TrainingError(RuntimeError):
    """Training cannot go on; a WorkerFailed event with this ``kind`` has already been emitted."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class TrainingData:
    """Encoded splits and the template they were rendered with."""

    train: list[Any]
    validation: list[Any]
    test_rows: list[dict]
    validation_rows: list[dict]
    template: str
    truncated: int


class Trainer:
    """Fine-tunes ``config``'s model with LoRA, writing into ``run`` and reporting through ``emit``."""

    def __init__(self, config: RunConfig, run: RunDir, emit: Emit,
                 between_steps: BetweenSteps | None = None, *, device: torch.device | None = None,
                 inject_oom_at_step: str | None = None):
        self.config = config
        self.run = run
        self.emit = emit
        self.between_steps = between_steps
        self.device = device
        self.base: BaseModel | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.data: TrainingData | None = None
        self.stream: DataStream | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.step = 0
        self.total_steps = 0
        self.cursor = Cursor()
        self.micro_batch_size = config.trainer.micro_batch_size
        # Units per optimizer step stay fixed; accumulation follows the micro-batch.
        self.units_per_step = self.micro_batch_size * config.trainer.accumulation_steps()
        self.best_eval_loss: float | None = None
        self.tokens_seen = 0
        self.elapsed = 0.0
        self.state = "idle"
        """idle, loading, training, paused (set by the worker), finished, stopped or failed."""
        self._stop_requested = False
        self.fast: fastpath.FastModel | None = None
        """The fast training path (studio/engine/fast.py), or None for the plain transformers one."""
        self._flops_per_token = 0.0
        self._peak_flops = 0.0
        self._sampler = torch.Generator()
        self._fresh_lora: dict[str, torch.Tensor] | None = None
        """The LoRA's initial weights while :meth:`load_trained_adapter` has replaced them."""
        self._oom_spec = inject_oom_at_step if inject_oom_at_step is not None else os.environ.get(INJECT_OOM_ENV)

    # ------------------------------------------------------------------------------------ set-up

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step at the current micro-batch size."""
        return math.ceil(self.units_per_step / self.micro_batch_size)

    def load(self) -> None:
        """Load the model, attach a fresh LoRA (seeded) and encode the data. Emits ModelLoading,
        ModelLoaded; on a user error emits WorkerFailed and raises :class:`TrainingError`."""
        from studio.core.data import DataError, load_splits

        self.state = "loading"
        base_model = self.config.model.base_model
        try:
            # The data first: a bad path or column fails in a second, not after the model loads.
            self.emit(ev.ModelLoading(stage="reading the data", fraction=0.0))
            splits = load_splits(self.config)
            checkpoint.seed_everything(self.config.trainer.seed)
            self.base = load_base(self.config, progress=lambda stage, fraction: self.emit(
                ev.ModelLoading(stage=stage, fraction=fraction)), device=self.device)
            for warning in self.base.warnings:
                self.emit(ev.WorkerFailed(kind="config", message=warning, fatal=False))
            self.emit(ev.ModelLoading(stage="attaching LoRA", fraction=0.85))
            self.model = attach_lora(self.base, self.config)
            self.tokenizer = self.base.tokenizer
            self.device = self.base.device
            self.emit(ev.ModelLoading(stage="encoding the data", fraction=0.9))
            self.data = self._encode_data(splits)
        except ModelLoadError as exc:
            self._fail("config", str(exc))
        except ConfigError as exc:
            self._fail("config", str(exc))
        except DataError as exc:
            self._fail("data", str(exc))
        except (ValueError, FileNotFoundError) as exc:  # template and tokenizer problems
            self._fail("config", f"{base_model}: {exc}")
        tc = self.config.trainer
        self.stream = DataStream(self.data.train, tc.seed, tc.packing, self.config.data.max_seq_length)
        self._enable_fast_path()
        total, trainable = count_parameters(self.model)
        self.emit(ev.ModelLoaded(base_model=base_model, device=str(self.device),
                                 dtype=str(self.base.compute_dtype).removeprefix("torch."),
                                 quantization=self.base.quantization, total_params=total,
                                 trainable_params=trainable, load_seconds=round(self.base.seconds, 2)))
        if self.data.truncated:
            self.emit(ev.WorkerFailed(kind="data", fatal=False, message=(
                f"{self.data.truncated} training rows are longer than data.max_seq_length "
                f"({self.config.data.max_seq_length} tokens) and were truncated; raise it if answers "
                "get cut off")))
        self.state = "idle"

    def trained_adapter_dir(self) -> Path | None:
        """The run's newest trained adapter: ``adapter/`` (saved at the end of training) or the latest
        checkpoint's ``adapter/``, whichever was written last; None for a run that never trained."""
        latest = self.run.latest_checkpoint()
        candidates = [self.run.adapter_dir] + ([latest / "adapter"] if latest is not None else [])
        found = [d for d in candidates if (d / "adapter_model.safetensors").exists()]
        # A run resumed after its adapter was saved has a newer checkpoint than adapter/.
        return max(found, key=lambda d: (d / "adapter_model.safetensors").stat().st_mtime, default=None)

    def load_trained_adapter(self) -> Path | None:
        """Load the model (if not yet) and put the run's trained adapter weights
        (:meth:`trained_adapter_dir`) into its LoRA, so that generation and evaluation answer as the
        fine-tuned model: chat with a past run. Returns the folder, or None (the fresh LoRA stays) when
        the run has no adapter yet or it cannot be loaded (a non-fatal WorkerFailed says why).
        A later ``train(resume=False)`` starts again from the fresh LoRA."""
        if self.model is None:
            self.load()
        folder = self.trained_adapter_dir()
        if folder is None:
            return None
        fresh = {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}
        try:
            unmatched = checkpoint.load_adapter_weights(self.model, folder, self.device)
        except (OSError, RuntimeError, ValueError) as exc:
            self.emit(ev.WorkerFailed(kind="config", fatal=False, message=(
                f"{folder}: cannot load the trained adapter ({str(exc).splitlines()[0]}); the fine-tuned "
                "answers come from an untrained LoRA. Was config.yaml's lora section edited after training?")))
            return None
        if unmatched:
            self.emit(ev.WorkerFailed(kind="config", fatal=False, message=(
                f"{folder}: {len(unmatched)} adapter weights match no layer (e.g. {unmatched[0]}); was "
                "lora.target_modules in config.yaml changed after training?")))
        self._fresh_lora = fresh
        return folder

    def _encode_data(self, splits: Any) -> TrainingData:
        from studio.core import prompt
        chat = getattr(self.tokenizer, "chat_template", None)
        template = prompt.resolve_template(self.config.prompt, chat,
                                           bos_token=self.tokenizer.bos_token or "",
                                           eos_token=self.tokenizer.eos_token or "")
        field = self.config.prompt.response_field
        max_len = self.config.data.max_seq_length
        eos = self.tokenizer.eos_token_id if self.config.prompt.add_eos else None
        bos = gen.bos_to_add(self.tokenizer)

        def encode(rows: list[dict]) -> list[Any]:
            return [prompt.encode(prompt.render(template, row, field), self._tokenize, max_len, eos, bos)
                    for row in rows]

        train = encode(list(splits.train))
        if not train:
            raise ConfigError(f"{self.config.data.path}: no training rows after splitting; check "
                              "data.split_column / data.val_fraction")
        validation_rows = list(splits.validation)[: self.config.trainer.eval_max_rows]
        return TrainingData(train=train, validation=encode(validation_rows), test_rows=list(splits.test),
                            validation_rows=validation_rows, template=template,
                            truncated=sum(1 for e in train if e.truncated))

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _fail(self, kind: str, message: str, detail: str = "") -> None:
        self.state = "failed"
        self.emit(ev.WorkerFailed(kind=kind, message=message, detail=detail, fatal=True))
        raise TrainingError(kind, message)

    # ------------------------------------------------------------------------------------ the loop

    def request_stop(self) -> None:
        """Ask the loop to checkpoint and stop after the current optimizer step (signal-safe)."""
        self._stop_requested = True

    def train(self, resume: bool = False) -> ev.TrainingFinished:
        """Train to the end (or a stop request); with ``resume``, continue from the latest checkpoint."""
        if self.model is None:
            self.load()
        try:
            return self._train(resume)
        except TrainingError:
            raise
        except Exception as exc:
            self._fail("crash", f"training crashed: {type(exc).__name__}: {exc}; the last checkpoint is "
                       f"in {self.run.checkpoints_dir} (resume with 'studio train --resume {self.run.id}')",
                       traceback.format_exc())
            raise  # not reached: _fail raises

    def _train(self, resume: bool) -> ev.TrainingFinished:
        tc = self.config.trainer
        assert self.stream is not None and self.data is not None
        units_per_epoch = self.stream.units_per_epoch(0)
        self.total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * units_per_epoch / self.units_per_step))
        self._build_optimizer()
        resumed_from = 0
        latest = self.run.latest_checkpoint() if resume else None
        if latest is not None:
            self._restore(latest)
            resumed_from = self.step
        elif self._fresh_lora is not None:
            # The trained adapter was loaded for chat; training from scratch starts from the fresh LoRA.
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    if name in self._fresh_lora:
                        param.copy_(self._fresh_lora[name])
        self._fresh_lora = None
        self.state = "training"
        self.model.train()
        self.emit(ev.RunStarted(run_id=self.run.id, base_model=self.config.model.base_model,
                                total_steps=self.total_steps, train_rows=len(self.data.train),
                                eval_rows=len(self.data.validation), micro_batch_size=self.micro_batch_size,
                                gradient_accumulation_steps=self.accumulation_steps,
                                resumed_from_step=resumed_from))
        from studio.engine.memory import reset_peak

        window_tokens, window_start = 0, time.time()
        session_start, elapsed_before = time.time(), self.elapsed
        last_loss = 0.0
        stopped = False
        while self.step < self.total_steps:
            units, next_cursor = self.stream.take(self.cursor, self.units_per_step)
            lr = self.optimizer.param_groups[0]["lr"]
            logged = (self.step + 1) % max(1, tc.log_interval) == 0 or self.step + 1 == self.total_steps
            if logged:
                # The sample's peak (its activations) is this one step's: not loading's, evaluation's,
                # a checkpoint's or a chat answer's between steps.
                reset_peak(self.device)
            result = self._optimizer_step(units)
            if result is None:
                continue  # out of memory: the micro-batch was halved, redo the same step
            loss, grad_norm, tokens = result
            self.cursor = next_cursor
            self.step += 1
            self.tokens_seen += tokens
            window_tokens += tokens
            last_loss = loss
            self.elapsed = elapsed_before + time.time() - session_start
            if logged:
                now = time.time()
                rate = window_tokens / max(now - window_start, 1e-9)
                per_step = (now - session_start) / max(1, self.step - resumed_from)
                self.emit(self.memory_event())
                self.emit(ev.StepLogged(step=self.step, total_steps=self.total_steps,
                                        epoch=round(self.stream.epoch_progress(self.cursor), 4), loss=loss,
                                        learning_rate=lr, grad_norm=grad_norm, tokens_per_s=round(rate, 1),
                                        tokens_seen=self.tokens_seen, elapsed_s=round(self.elapsed, 2),
                                        eta_s=round(per_step * (self.total_steps - self.step), 1),
                                        mfu=round(rate * self._flops_per_token / self._peak_flops, 4)
                                        if self._peak_flops else 0.0))
                window_tokens, window_start = 0, now
            if self.step == self.total_steps or (tc.eval_interval and self.step % tc.eval_interval == 0):
                self.evaluate()
            if tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0:
                self.save_checkpoint()
            if self.between_steps is not None and self.between_steps(self) == "stop":
                self._stop_requested = True
            if self._stop_requested and self.step < self.total_steps:
                stopped = True
                break
        if self._checkpoint_step() != self.step:
            self.save_checkpoint()
        from studio.engine.model import save_adapter

        adapter = save_adapter(self.model, self.run.adapter_dir, self.config)
        self.state = "stopped" if stopped else "finished"
        finished = ev.TrainingFinished(step=self.step, stopped=stopped, adapter_path=str(adapter),
                                       train_loss=last_loss, best_eval_loss=self.best_eval_loss,
                                       elapsed_s=round(self.elapsed, 2))
        self.emit(finished)
        return finished

    def _build_optimizer(self) -> None:
        tc = self.config.trainer
        params = [p for p in self.model.parameters() if p.requires_grad]
        name = tc.optimizer
        self.optimizer = None
        if name in ("adamw_8bit", "paged_adamw_8bit"):
            try:
                import bitsandbytes as bnb

                cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
                self.optimizer = cls(params, lr=tc.learning_rate, weight_decay=tc.weight_decay)
            except Exception as exc:  # no GPU backend for 8-bit states
                self.emit(ev.WorkerFailed(kind="config", fatal=False, message=(
                    f"trainer.optimizer {name} is not available here ({str(exc).splitlines()[0]}); "
                    "using torch AdamW")))
        if self.optimizer is None:
            # fused: one kernel for all adapter tensors instead of a few per tensor.
            self.optimizer = torch.optim.AdamW(params, lr=tc.learning_rate, weight_decay=tc.weight_decay,
                                               fused=self.device.type == "cuda")
        warmup = math.ceil(tc.warmup_fraction * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda=_schedule(tc.scheduler, warmup, self.total_steps))

    def _optimizer_step(self, units: list[list[int]]) -> tuple[float, float, int] | None:
        """One optimizer step over ``units``: (loss, grad norm, tokens), or None after an OOM."""
        assert self.stream is not None and self.optimizer is not None and self.scheduler is not None
        pad = self.tokenizer.pad_token_id
        batches = [self.stream.collate(units[i:i + self.micro_batch_size], pad)
                   for i in range(0, len(units), self.micro_batch_size)]
        label_tokens = max(1, sum(b.label_tokens for b in batches))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        out_of_memory = False
        try:
            for index, batch in enumerate(batches):
                if index == 0:
                    self._maybe_inject_oom()
                loss, _correct = self._forward(batch.to(self.device))
                # Dividing by the step's token count (not the micro-batch's) makes the gradient the
                # same however the step is split into micro-batches.
                (loss / label_tokens).backward()
                loss_sum += loss.detach()
        except torch.cuda.OutOfMemoryError:
            out_of_memory = True
        if out_of_memory:
            # Outside the except block, so the traceback no longer pins the step's tensors.
            self._handle_oom()
            return None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.config.trainer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # .item() is a device sync point: once per optimizer step, not per micro-batch.
        return float(loss_sum.item()) / label_tokens, float(grad_norm.item()), sum(b.tokens for b in batches)

    def _enable_fast_path(self) -> None:
        """Switch to the fast training path where it applies, and size the MFU figures."""
        self.fast, why = fastpath.enable(self.model, self.device)
        if self.fast is None and self.device.type == "cuda":
            self.emit(ev.WorkerFailed(kind="config", fatal=False, message=(
                f"the fast training path is off ({why}); training runs on the slower plain path")))
        if self.device.type == "cuda":
            lengths = [len(e.input_ids) for e in self.data.train] or [1]
            config = self.model.get_base_model().config
            self._flops_per_token = fastpath.model_flops_per_token(config, sum(lengths) / len(lengths))
            self._peak_flops = fastpath.matmul_tflops(self.device) * 1e12

    def _forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over the response tokens, and the count of argmax hits among them."""
        if self.fast is not None and torch.is_grad_enabled():
            # Training step on the fast path: the loss only (argmax hits are an evaluation metric).
            loss = self.fast.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids,
                                  reduction="sum")
            return loss, torch.zeros((), device=loss.device)
        if self.fast is not None:  # evaluation: chunked over the vocabulary, never full fp32 logits
            return self.fast.score(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        autocast = torch.autocast(device_type=self.device.type, dtype=self.base.compute_dtype,
                                  enabled=self.device.type == "cuda" and self.base.compute_dtype != torch.float32)
        with autocast:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, use_cache=False).logits
        targets = batch.labels[:, 1:]
        logits = logits[:, :-1]
        keep = targets != IGNORE_INDEX
        # Only response positions go through the fp32 softmax: a large vocabulary makes the full
        # logits tensor one of the biggest allocations of the step.
        picked = logits[keep].float()
        wanted = targets[keep]
        loss = F.cross_entropy(picked, wanted, reduction="sum")
        correct = (picked.argmax(-1) == wanted).sum()
        return loss, correct

    def _maybe_inject_oom(self) -> None:
        spec = self._oom_spec
        if not spec:
            return
        at, _, mode = spec.partition(":")
        if int(at) == self.step + 1:
            if mode != "always":
                self._oom_spec = None
            raise torch.cuda.OutOfMemoryError(f"simulated out of memory at step {at} ({INJECT_OOM_ENV})")

    def _handle_oom(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.micro_batch_size <= 1:
            self._fail("oom", (
                f"out of GPU memory at step {self.step + 1} even with micro_batch_size 1; lower "
                f"data.max_seq_length (now {self.config.data.max_seq_length}), turn on "
                "trainer.gradient_checkpointing, use quantization.bits: 4, a smaller lora.r, or a "
                "smaller model"))
        old = self.micro_batch_size
        self.micro_batch_size = max(1, old // 2)
        self.emit(ev.BatchSizeReduced(
            step=self.step + 1, old_micro_batch_size=old, micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.accumulation_steps,
            message=(f"out of memory at step {self.step + 1}: micro-batch {old} -> {self.micro_batch_size}, "
                     f"gradient accumulation -> {self.accumulation_steps} (same effective batch); set "
                     f"trainer.micro_batch_size: {self.micro_batch_size} to start there next time")))

    # ------------------------------------------------------------------------------- evaluation

    def evaluate(self) -> ev.EvalLogged:
        """Loss, perplexity and next-token accuracy on the validation rows' responses; emits EvalLogged."""
        assert self.data is not None
        examples = self.data.validation
        if not examples:
            event = ev.EvalLogged(step=self.step, loss=float("nan"), perplexity=float("nan"), rows=0)
            return event
        was_training = self.model.training
        self.model.eval()
        total = correct = 0
        loss_sum = 0.0
        try:
            with torch.no_grad():
                for batch in eval_batches(examples, self.micro_batch_size, self.tokenizer.pad_token_id):
                    loss, hits = self._forward(batch.to(self.device))
                    loss_sum += float(loss)
                    correct += int(hits)
                    total += batch.label_tokens
        finally:
            if was_training:
                self.model.train()
        loss = loss_sum / max(1, total)
        if self.best_eval_loss is None or loss < self.best_eval_loss:
            self.best_eval_loss = loss
        event = ev.EvalLogged(step=self.step, loss=loss, perplexity=math.exp(min(loss, 50.0)),
                              token_accuracy=correct / max(1, total), rows=len(examples))
        self.emit(event)
        return event

    # ------------------------------------------------------------------------------- generation

    def render_prompt(self, prompt: str | dict) -> str:
        """The text the model is given for ``prompt``: a row (dict) or a plain instruction rendered
        through the run's template, up to where the response starts."""
        from studio.core.prompt import render, template_fields

        template = self.data.template if self.data else self.config.prompt.template
        field = self.config.prompt.response_field
        if isinstance(prompt, str):
            fields = [f for f in template_fields(template) if f != field]
            prompt = {fields[0] if fields else "instruction": prompt}
        return render(template, {**prompt, field: ""}, field).prompt

    def generate(self, prompt: str | dict, adapter: bool = True, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 on_text: Callable[[str], None] | None = None) -> gen.GenerationResult:
        """Answer ``prompt`` with the adapter (or the base model through ``disable_adapter()``),
        streaming pieces of text to ``on_text``. Safe between training steps."""
        g = self.config.generation
        ids = gen.prompt_ids(self.tokenizer, self.render_prompt(prompt))
        return gen.generate(self.model, self.tokenizer, ids, adapter=adapter,
                            max_new_tokens=max_new_tokens or g.max_new_tokens,
                            temperature=g.temperature if temperature is None else temperature,
                            top_p=g.top_p if top_p is None else top_p, on_text=on_text,
                            generator=self._sampler, device=self.device,
                            autocast_dtype=self.base.compute_dtype if self.base else None)

    # ------------------------------------------------------------------------------- checkpoints

    def _checkpoint_step(self) -> int | None:
        latest = self.run.latest_checkpoint()
        return int(latest.name.split("-")[1]) if latest is not None else None

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step-N`` atomically (studio/engine/checkpoint.py); keep the newest K."""
        assert self.optimizer is not None and self.scheduler is not None
        state = {
            "total_steps": self.total_steps,
            "cursor": {"epoch": self.cursor.epoch, "offset": self.cursor.offset},
            "micro_batch_size": self.micro_batch_size, "units_per_step": self.units_per_step,
            "gradient_accumulation_steps": self.accumulation_steps, "best_eval_loss": self.best_eval_loss,
            "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed, "seed": self.config.trainer.seed,
        }
        final = checkpoint.save(self.run, self.step, self.model, self.optimizer, self.scheduler, state,
                                self.config.trainer.keep_checkpoints)
        self.emit(ev.CheckpointSaved(step=self.step, path=str(final)))
        return final

    def _restore(self, path: Path) -> None:
        assert self.optimizer is not None and self.scheduler is not None
        state = checkpoint.load(path, self.model, self.optimizer, self.scheduler, self.device)
        self.step = int(state["step"])
        self.cursor = Cursor(int(state["cursor"]["epoch"]), int(state["cursor"]["offset"]))
        self.micro_batch_size = int(state["micro_batch_size"])
        self.units_per_step = int(state["units_per_step"])
        self.best_eval_loss = state.get("best_eval_loss")
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.elapsed = float(state.get("elapsed_s", 0.0))

    # ------------------------------------------------------------------------------------ memory

    def memory_event(self) -> ev.MemorySampled:
        """Device memory now, by category (studio/engine/memory.py) and allocator totals; activations
        and the peaks are those since the last ``reset_peak`` (the training loop resets it before
        each logged step)."""
        from studio.engine.memory import device_totals, measure_memory

        categories = measure_memory(self.model, self.optimizer, self.device)
        if self.device is not None and self.device.type == "cuda":
            totals = device_totals(self.device)
            name = torch.cuda.get_device_name(self.device)
        else:
            # No allocator counters on CPU: what the model and optimizer hold is the best figure.
            held = sum(categories.values())
            totals = {"allocated": held, "reserved": held, "peak_allocated": held, "peak_reserved": held,
                      "capacity": 0}
            name = "cpu"
        return ev.MemorySampled(step=self.step, device=name, categories=categories, **totals)


def _schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier at a step: linear warmup, then cosine, linear or constant."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor
