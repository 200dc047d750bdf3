"""The training loop: one class you can read top to bottom.

``Trainer(session)`` trains the model a :class:`~studio.engine.session.Session` loaded: ``train()``
runs optimizer steps of ``accumulation`` micro-batches each, with warmup + schedule, gradient
clipping, bf16 autocast on a GPU, evaluation before the first step (the base model's loss) and every
``eval_interval`` steps, atomic checkpoints every
``checkpoint_interval`` steps, and the final adapter in ``runs/<id>/adapter`` (a full fine-tune,
``lora: null``: every weight trains, and the whole model goes to ``runs/<id>/model``). Everything it has to
say goes through the session's ``emit`` callback as typed events (studio/core/events.py). Loading,
generation and adapter swapping for chat are the session's.

Exact resume: a checkpoint holds the adapter, optimizer, scheduler, RNG states and the data cursor,
and the loss of a step is averaged over the response tokens of the whole step, so that the same
units split into different micro-batches (after an out-of-memory halving) give the same step.

Data parallel (torchrun, studio/engine/distributed.py): every rank draws the same step from the data
stream and trains on its share of the units; the gradients are summed across ranks before clipping,
so a step on N processes is the step one process would take on all the units. Rank 0 alone writes
events, evaluates, checkpoints and saves the adapter, and decides after each step whether to go on.

The evaluation during training (SFT loss, preference margins, GRPO rewards) is the Trainer's part
in studio/engine/validation.py.

Past ~500 lines on purpose: each out-of-memory recovery (step, optimizer step, checkpoint) and the
resume fallback change the loop's own state (micro-batch, optimizer settings, step and cursor); kept
beside the loop they read in the order they happen.
"""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from studio.core import events as ev
from studio.core.grpo.rewards import RewardError, RewardFailed
from studio.core.prompt import IGNORE_INDEX
from studio.core.runs import ADAPTER_STEP_FILE
from studio.core.runs.storage import DiskFull, is_disk_full
from studio.engine import checkpoint, oom
from studio.engine import distributed as dist
from studio.engine import fast as fastpath
from studio.engine.batching import Cursor, DataStream, MicroBatch
from studio.engine.grpo_prompts import PromptStream
from studio.engine.memory import MemorySampler
from studio.engine.optim import build_optimizer, build_scheduler
from studio.engine.preference import PairStream
from studio.engine.validation import Validation

if TYPE_CHECKING:
    from studio.engine.session import Session

phase = torch.profiler.record_function
"""A labelled range of the step for torch's profiler (bench/speed.py's ``--trainer-profile`` puts the
GPU's idle time between kernels under them); next to nothing when no profiler runs."""


class TrainingError(ev.ReportedFailure):
    """The engine cannot go on; a WorkerFailed event with this ``kind`` has already been emitted."""


BetweenSteps = Callable[["Trainer"], "str | None"]
"""Called after every optimizer step (the worker checks its commands there); ``"stop"`` ends training."""


class Trainer(Validation):
    """Fine-tunes the LoRA of ``session``'s model, writing into its run; ``between_steps`` (default:
    the session's) is called after every optimizer step, and a return of "stop" ends training."""

    def __init__(self, session: Session, between_steps: BetweenSteps | None = None):
        self.session = session
        self.config = session.config
        self.run = session.run
        self.emit = session.emit
        self.between_steps = between_steps if between_steps is not None else session.between_steps
        self.group: dist.Group = session.group
        self.stream: DataStream | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.step = 0
        self.total_steps = 0
        self.cursor = Cursor()
        self._size_batch()
        self.best_eval_loss: float | None = None
        self.tokens_seen = 0
        self.elapsed = 0.0
        self.state = "idle"
        """idle, loading, training, finished, stopped or failed."""
        self._stop_requested = False
        self._graph_failure_reported = False
        self._eval_batch_cap: int | None = None
        """Rows per evaluation batch after an out-of-memory there (None: the micro-batch size)."""
        self._flops_per_token = 0.0
        self._peak_flops = 0.0
        self._saved_step: int | None = None
        self._sampler: MemorySampler | None = None
        self._step_sample: ev.MemorySampled | None = None
        """The last step's memory sample, taken before its figures were read (_optimizer_step)."""
        self._prepared: tuple[tuple[Cursor, int], list[MicroBatch], Cursor] | None = None
        """The next step's batches, collated while the GPU ran the last one: ((cursor, micro-batch
        size) they are for, batches, cursor after them)."""

    # ------------------------------------------------------------------------------------ set-up

    @property
    def model(self) -> Any:
        """The session's PEFT model."""
        return self.session.model

    @property
    def tokenizer(self) -> Any:
        """The session's tokenizer."""
        return self.session.tokenizer

    @property
    def device(self) -> torch.device | None:
        """Where the model is (None until loaded)."""
        return self.session.device

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (on each rank) at the current micro-batch size."""
        return math.ceil(math.ceil(self.units_per_step / self.group.world) / self.micro_batch_size)

    def _size_batch(self) -> None:
        self.config = self.session.config
        self.micro_batch_size = self.config.trainer.micro_batch()
        # Units per optimizer step (over every rank) stay fixed; accumulation follows the micro-batch.
        self.units_per_step = self.config.trainer.effective_batch(self.group.world)

    def load(self) -> None:
        """Load the session if it is not yet, and set up the data stream. On a user error a
        WorkerFailed is emitted and :class:`TrainingError` raised."""
        if not self.session.loaded:
            self.state = "loading"
            try:
                self.session.load()
            except TrainingError:
                self.state = "failed"
                raise
            self.state = "idle"
            self._size_batch()  # loading resolved trainer.micro_batch_size: auto (engine/planning.py)
        if self.stream is None:
            tc = self.config.trainer
            if self.session.preference is not None:
                self.stream = PairStream(self.session.data.train, tc.seed, self.config.data.max_seq_length)
            elif self.session.grpo is not None:
                self.stream = PromptStream(self.session.data.train, tc.seed, self.config.data.max_seq_length,
                                           self.session.grpo.per_prompt)
            else:
                self.stream = DataStream(self.session.data.train, tc.seed, tc.packing, self.config.data.max_seq_length)

    def _fail(self, kind: str, message: str, detail: str = "") -> None:
        self.state = "failed"
        self.session.fail(kind, message, detail)

    # ------------------------------------------------------------------------------------ the loop

    def train(self, resume: bool = False) -> ev.TrainingFinished:
        """Train to the end (or a stop request); with ``resume``, continue from the latest checkpoint."""
        self.load()
        try:
            return self._train(resume)
        except TrainingError:
            raise
        except Exception as exc:
            if is_disk_full(exc, self.run.path):
                raise  # the worker reports it in one line and exits; the checkpoints are whole
            latest = self.run.latest_checkpoint()
            then = (f"the last checkpoint is {latest} (resume with 'studio train --resume {self.run.id}')"
                    if latest is not None else "no checkpoint was saved yet: fix the cause and train again")
            self._fail("crash", f"training crashed: {type(exc).__name__}: {exc}; {then}", traceback.format_exc())
            raise  # not reached: _fail raises

    def _train(self, resume: bool) -> ev.TrainingFinished:
        tc = self.config.trainer
        assert self.stream is not None
        self._size_mfu()
        units_per_epoch = self.stream.units_per_epoch(0)
        self.total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * units_per_epoch / self.units_per_step))
        self.optimizer = build_optimizer(self.model, tc, self.device, self.emit)
        self.scheduler = build_scheduler(self.optimizer, tc, self.total_steps)
        if self.session.grpo is not None:
            try:  # imported again at every start: a reward fixed since a failure is read anew
                self.session.grpo.load_rewards()
            except RewardError as exc:
                self._fail(ev.FailureKind.REWARD, str(exc))
        resumed_from = 0
        if resume:
            self._restore_newest_loadable()
            resumed_from = self.step
        else:
            # A trained adapter loaded for chat must not be where training from scratch starts.
            self.session.restore_fresh_lora()
            if self.group.rank > 0:
                torch.manual_seed(tc.seed + self.group.rank)  # each rank its own dropout masks
        # Every rank starts from rank 0's LoRA (a restored checkpoint's, or the fresh one).
        self.group.broadcast_parameters([p for p in self.model.parameters() if p.requires_grad])
        self.state = "training"
        self.model.train()
        if self.session.fast is not None and self.stream.packing:
            self.session.fast.expect_examples(self.stream.most_examples(self.micro_batch_size))
        self.emit(ev.RunStarted(run_id=self.run.id, base_model=self.config.model.base_model,
                                total_steps=self.total_steps, train_rows=len(self.session.data.train),
                                eval_rows=len(self.session.data.validation), micro_batch_size=self.micro_batch_size,
                                gradient_accumulation_steps=self.accumulation_steps,
                                resumed_from_step=resumed_from, gpus=self.group.world,
                                effective_batch_size=self.units_per_step))
        if self.step == 0 and self.group.leader:
            # The base model's loss, perplexity and accuracy: the "before" of the loss plot.
            self.evaluate(record_best=False)
        from studio.engine.memory import reset_peak

        # tokens/s counts the steps' own time: not the evaluations, checkpoints and pauses between
        # them. The ETA counts evaluations and checkpoints (they come again), not pauses or the
        # commands the worker served between steps.
        window_tokens, window_time, held = 0, 0.0, 0.0
        session_start, elapsed_before = time.time(), self.elapsed
        last_loss = 0.0
        stopped = False
        self._sampler = MemorySampler(self.model, self.device, self.group.rank)
        self._prepared = None
        while self.step < self.total_steps:
            step_start = time.time()
            batches, next_cursor = self._batches(self.cursor)
            lr = self.optimizer.param_groups[0]["lr"]
            logged = (self.step + 1) % max(1, tc.log_interval) == 0 or self.step + 1 == self.total_steps
            if logged:
                # The sample's peak (its activations) is this one step's: not loading's, evaluation's,
                # a checkpoint's or a chat answer's between steps.
                reset_peak(self.device)
            if self.session.preference is not None:
                self.session.preference.start_step()
            if self.session.grpo is not None:
                self.session.grpo.start_step(self.step)
            # The next step's batches are collated while the GPU still runs this one.
            ahead = next_cursor if self.step + 1 < self.total_steps else None
            result = self._optimizer_step(batches, prepare=ahead, sample=logged)
            if result is None:
                continue  # out of memory: the micro-batch was halved, redo the same step
            loss, grad_norm, tokens = result
            self._report_graph_failure()
            self.cursor = next_cursor
            self.step += 1
            self.tokens_seen += tokens
            window_tokens += tokens
            last_loss = loss
            now = time.time()
            window_time += now - step_start
            self.elapsed = elapsed_before + now - session_start
            if logged:
                rate = window_tokens / max(window_time, 1e-9)
                per_step = (now - session_start - held) / max(1, self.step - resumed_from)
                sampled, self._step_sample = self._step_sample, None
                for sample in self.group.gather(sampled if sampled is not None else self.memory_event()) or []:
                    self.emit(sample)
                if self.session.grpo is not None:  # before StepLogged: a console line joins them
                    every_rank = self.group.gather(self.session.grpo.sums())
                    for event in self.session.grpo.logged(self.step, every_rank) if self.group.leader else []:
                        self.emit(event)
                self.emit(ev.StepLogged(step=self.step, total_steps=self.total_steps,
                                        epoch=round(self.stream.epoch_progress(self.cursor), 4), loss=loss,
                                        learning_rate=lr, grad_norm=grad_norm, tokens_per_s=round(rate, 1),
                                        tokens_seen=self.tokens_seen, elapsed_s=round(self.elapsed, 2),
                                        eta_s=round(per_step * (self.total_steps - self.step), 1),
                                        mfu=round(rate * self._flops_per_token / self._peak_flops, 4)
                                        if self._peak_flops else 0.0,
                                        expert_tokens=self.session.fast.take_expert_tokens()
                                        if self.session.fast is not None else []))
                if self.session.preference is not None:
                    self.emit(self.session.preference.logged(self.step))
                window_tokens, window_time = 0, 0.0
            if self.step == self.total_steps and self.session.fast is not None:
                # No step follows: the graphs' pools go before the final evaluation, whose eager
                # passes would otherwise sit on top of them (4096-token rows: 0.36 GiB over the step).
                self.session.fast.release_graphs()
            if self.group.leader and (self.step == self.total_steps or
                                      (tc.eval_interval and self.step % tc.eval_interval == 0)):
                self.evaluate()  # the other ranks wait for the verdict below meanwhile
            if tc.checkpoint_interval and self.step % tc.checkpoint_interval == 0:
                self.save_checkpoint()
            with phase("studio.between_steps"):
                waited = time.time()
                self._stop_requested = self.group.verdict(self._decide) == dist.STOP
                held += time.time() - waited
            if self._stop_requested and self.step < self.total_steps:
                stopped = True
                break
        if self._saved_step != self.step:
            self.save_checkpoint()
        from studio.engine.model import save_adapter

        full = self.config.full_finetune
        # A full fine-tune's result is the whole model with its tokenizer (runs/<id>/model).
        adapter = self.run.model_dir if full else self.run.adapter_dir
        if self.group.leader:
            try:
                # RunDir.adapter() compares the step file with the checkpoints' steps (a later resume
                # may pass it).
                adapter = save_adapter(self.model, adapter, self.config,
                                       extra={ADAPTER_STEP_FILE: json.dumps({"step": self.step})},
                                       tokenizer=self.tokenizer if full else None)
            except Exception as exc:
                if is_disk_full(exc, self.run.path):
                    raise DiskFull(adapter, self.run.id) from exc
                raise
        self.state = "stopped" if stopped else "finished"
        self._release_training_state()
        finished = ev.TrainingFinished(step=self.step, stopped=stopped, adapter_path=str(adapter),
                                       train_loss=last_loss, best_eval_loss=self.best_eval_loss,
                                       elapsed_s=round(self.elapsed, 2))
        self.emit(finished)
        return finished

    def _release_training_state(self) -> None:
        """Give back what only training needs once it has ended (saved in the last checkpoint, which a
        resume reads): the optimizer's state, and the CUDA graphs with their private pools. What comes
        next (answers, evaluation, export) then fits in less than the training step did."""
        self.optimizer = self.scheduler = None
        if self.session.fast is not None:
            self.session.fast.release_graphs()
        oom.between_phases(self.device)

    def _report_graph_failure(self) -> None:
        """Once: a failed CUDA graph capture leaves training correct but slower (every later step
        eager), which the user should hear about rather than find in the tokens/s."""
        fast = self.session.fast
        why = fast.graphs_failed if fast is not None else ""
        if why and not self._graph_failure_reported:
            self._graph_failure_reported = True
            self.emit(ev.WarningRaised(kind="crash", detail=why, message=(
                "a CUDA graph capture failed; training goes on without CUDA graphs (same results, "
                "fewer tokens/s). Please report it with the detail below")))

    def _decide(self) -> int:
        """Rank 0's verdict after a step: the worker's hook (it serves commands, and blocks while
        paused) or a stop request say STOP, else GO."""
        if self.between_steps is not None and self.between_steps(self) == "stop":
            self._stop_requested = True
        return dist.STOP if self._stop_requested else dist.GO

    def keep_alive(self) -> None:
        """Called by the worker while training is paused: the other ranks keep waiting."""
        self.group.still_paused()

    def _batches(self, cursor: Cursor) -> tuple[list[MicroBatch], Cursor]:
        """This rank's micro-batches of the optimizer step that starts at ``cursor``, on the host
        (pinned on CUDA), and the cursor after the step: the ones collated ahead when they are for
        this cursor and micro-batch size (an out-of-memory error halves it; a resume moves the
        cursor)."""
        assert self.stream is not None
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == (cursor, self.micro_batch_size):
            return prepared[1], prepared[2]
        with phase("studio.collate"):
            units, next_cursor = self.stream.take(cursor, self.units_per_step)
            units = self.group.shard(units)
            pad = self.tokenizer.pad_token_id
            batches = [self.stream.collate(units[i:i + self.micro_batch_size], pad)
                       for i in range(0, len(units), self.micro_batch_size)]
            if self.device is not None and self.device.type == "cuda":
                batches = [b.pin() for b in batches]
        return batches, next_cursor

    def _optimizer_step(self, batches: list[MicroBatch], prepare: Cursor | None = None, sample: bool = False
                        ) -> tuple[float, float, int] | None:
        """One optimizer step over ``batches`` (this rank's share): (loss, grad norm, tokens) of the
        whole step over every rank, or None after an OOM. With ``prepare``, the step's work is
        queued on the GPU, then the batches of the step at that cursor are collated (the host's
        share of a step, done while the GPU computes this one), then the step's figures are read.
        With ``sample``, the step's memory sample is taken there too (``_step_sample``): the
        allocator counted the step's allocations as its work was queued, so its peaks are final
        before the GPU has run it, and the sampling overlaps the GPU's work instead of following it
        while the GPU waits for the next step."""
        assert self.stream is not None and self.optimizer is not None and self.scheduler is not None
        # Every rank divides by the whole step's count, so the summed gradients are one process's.
        label_tokens, step_tokens = self.group.sum_counts(sum(b.label_tokens for b in batches),
                                                          sum(b.tokens for b in batches))
        label_tokens = max(1, label_tokens)
        if self.session.grpo is not None:  # its scored pass backpropagates its chunks itself (engine/grpo.py)
            self.session.grpo.loss_divisor = label_tokens
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        out_of_memory = False
        reward_failed = ""
        try:
            for batch in batches:
                with phase("studio.forward_backward"):
                    loss, _correct = self.forward(batch.to(self.device, non_blocking=True))
                    # Dividing by the step's token count (not the micro-batch's) makes the gradient
                    # the same however the step is split into micro-batches.
                    (loss / label_tokens).backward()
                    loss_sum += loss.detach()
                # The spent graph goes now, not when the next micro-batch's loss replaces it: alive,
                # it keeps the adapters' gradient accumulators from this forward, and a CUDA graph
                # captured in the next forward (a layout not seen before) would wait on their stream,
                # the default one, and fail (docs/speed.md).
                del loss
        except torch.cuda.OutOfMemoryError:
            out_of_memory = True
        except RewardFailed as exc:
            reward_failed = str(exc)
        if self.session.grpo is not None:
            if self.group.any(bool(reward_failed)):
                self._reward_failed(reward_failed)
            step_tokens = self.group.sum_counts(self.session.grpo.step_tokens)[0]  # known once sampled
        if self.group.any(out_of_memory):  # every rank halves, and redoes the step, together
            # Outside the except block, so the traceback no longer pins the step's tensors.
            self._handle_oom()
            return None
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Outside the fast path's CUDA graphs: they wrote the gradients; this sums them over ranks.
        loss_sum = self.group.reduce_gradients(params, loss_sum)
        with phase("studio.update"):
            grad_norm = self._update_or_retry(params)
            self.optimizer.zero_grad(set_to_none=True)
        if prepare is not None:
            batches_ahead, cursor_after = self._batches(prepare)
            self._prepared = ((prepare, self.micro_batch_size), batches_ahead, cursor_after)
        if sample:
            self._step_sample = self.memory_event(step=self.step + 1)
        # .item() is a device sync point: once per optimizer step, not per micro-batch.
        with phase("studio.read_figures"):
            return float(loss_sum.item()) / label_tokens, float(grad_norm.item()), step_tokens

    def update(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Clip the gradients, step the optimizer and the schedule; returns the gradient norm. Every
        optimizer step goes through here, so a test can wrap it (e.g. to raise an out-of-memory)."""
        assert self.optimizer is not None and self.scheduler is not None
        max_norm = self.config.trainer.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm

    def _update_or_retry(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """:meth:`update`; out of memory there, it is retried once with the optimizer working one
        tensor at a time (foreach off: a smaller peak). The usual place is the first step, where
        AdamW allocates its moments lazily before touching any weight, so the retry is exact."""
        assert self.optimizer is not None
        for attempt in (1, 2):
            failed = False
            try:
                return self.update(params)
            except oom.OutOfMemory:
                failed = True
            if failed:  # outside the except block: the traceback no longer pins the tensors
                oom.free(self.device)
                if attempt == 2:
                    self._fail("oom", (f"out of GPU memory in the optimizer step at step {self.step + 1}, even "
                                       "one tensor at a time; use trainer.optimizer: adamw_8bit or paged_adamw_8bit, "
                                       "a smaller lora.r, or a smaller model"))
                for group in self.optimizer.param_groups:
                    group["foreach"] = False
                oom.warn(self.emit, (f"out of memory in the optimizer step at step {self.step + 1}: freed memory, "
                                     "switched the optimizer to one tensor at a time and retried the step; "
                                     "training goes on"))
        raise AssertionError("not reached")

    def _size_mfu(self) -> None:
        """The FLOPs a token costs and the GPU's measured matmul rate, for StepLogged's MFU."""
        if self.device.type != "cuda" or self._peak_flops:
            return
        lengths = [len(e.input_ids) for e in self.session.data.train] or [1]
        full = self.config.full_finetune
        config = (self.model if full else self.model.get_base_model()).config
        self._flops_per_token = fastpath.model_flops_per_token(config, sum(lengths) / len(lengths), full=full)
        self._peak_flops = fastpath.matmul_tflops(self.device) * 1e12

    def forward(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy over the response tokens of one micro-batch, and the count of argmax
        hits among them. Every micro-batch of a step and of an evaluation goes through here, so a
        test can wrap it (``trainer.forward = ...``), e.g. to raise a simulated out-of-memory."""
        if self.session.preference is not None:
            return self.session.preference.forward(batch)  # DPO / ORPO: studio/engine/preference.py
        if self.session.grpo is not None:
            return self.session.grpo.forward(batch)  # GRPO: studio/engine/grpo.py
        fast = self.session.fast
        if fast is not None and torch.is_grad_enabled():
            # Training step on the fast path: the loss only (argmax hits are an evaluation metric).
            loss = fast.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids,
                                  reduction="sum")
            return loss, torch.zeros((), device=loss.device)
        if fast is not None:  # evaluation: chunked over the vocabulary, never full fp32 logits
            return fast.score(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        dtype = self.session.base.compute_dtype
        autocast = torch.autocast(device_type=self.device.type, dtype=dtype,
                                  enabled=self.device.type == "cuda" and dtype != torch.float32)
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

    def _reward_failed(self, message: str) -> None:
        """A reward function failed on this rank or another: the step is dropped, the state before
        it saved as a checkpoint (the sampler is counter-based, so a resume samples the same step
        again), and the run fails in one line naming the reward, the prompt and the problem."""
        assert self.optimizer is not None
        messages = self.group.gather(message)
        self.optimizer.zero_grad(set_to_none=True)
        if self._saved_step != self.step:
            self.save_checkpoint()
        first = next((m for m in messages or [message] if m),
                     "a reward function failed on another GPU (see worker.log)")
        self._fail(ev.FailureKind.REWARD, (
            f"{first}; the run is saved at step {self.step}: fix the reward, then continue with "
            f"'studio train --resume {self.run.id}'"))

    def _handle_oom(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.micro_batch_size <= 1 and self.session.grpo is not None:
            g = self.config.grpo
            self._fail("oom", (
                f"out of GPU memory at step {self.step + 1} even with micro_batch_size 1 (one prompt, "
                f"{g.num_generations} completions); lower grpo.num_generations (now {g.num_generations}), "
                f"grpo.max_completion_length (now {g.max_completion_length}) or data.max_seq_length (now "
                f"{self.config.data.max_seq_length}), turn on trainer.gradient_checkpointing, or use a smaller model"))
        if self.micro_batch_size <= 1:
            c = self.config
            advice = [f"lower data.max_seq_length (now {c.data.max_seq_length})"]
            if c.trainer.gradient_checkpointing is False:
                advice.append("turn on trainer.gradient_checkpointing")
            if c.quantization.bits != 4:
                advice.append("use quantization.bits: 4")
            if c.lora is not None:
                advice.append("a smaller lora.r")
            self._fail("oom", (f"out of GPU memory at step {self.step + 1} even with micro_batch_size 1; "
                               f"{', '.join(advice)}, or a smaller model"))
        old = self.micro_batch_size
        self.micro_batch_size = max(1, old // 2)
        plan = getattr(self.session, "auto_plan", None)
        estimated, capacity = oom.estimate_for(self.config, old, self.device, plan.capacity if plan else 0)
        self.emit(ev.BatchSizeReduced(
            step=self.step + 1, old_micro_batch_size=old, micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.accumulation_steps, estimated_bytes=estimated, capacity_bytes=capacity,
            message=(f"out of memory at step {self.step + 1}: micro-batch {old} -> {self.micro_batch_size}, "
                     f"gradient accumulation -> {self.accumulation_steps} (same effective batch); set "
                     f"trainer.micro_batch_size: {self.micro_batch_size} to start there next time")))

    # ------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step-N`` atomically (studio/engine/checkpoint.py); keep the newest K.
        Every rank calls it (their RNG states go in); rank 0 writes. Out of memory twice, the
        checkpoint is skipped (a warning says so) and None returned."""
        assert self.optimizer is not None and self.scheduler is not None
        final = self.run.checkpoints_dir / f"step-{self.step}"
        rank_rng = self.group.gather(checkpoint.rng_state())
        self._saved_step = self.step
        if not self.group.leader:
            return final
        state = {
            "total_steps": self.total_steps,
            "cursor": {"epoch": self.cursor.epoch, "offset": self.cursor.offset},
            "micro_batch_size": self.micro_batch_size, "units_per_step": self.units_per_step,
            "gradient_accumulation_steps": self.accumulation_steps, "best_eval_loss": self.best_eval_loss,
            "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed, "seed": self.config.trainer.seed,
            "processes": self.group.world,
        }
        if self.session.grpo is not None:
            state["grpo_sampler"] = self.session.grpo.sampler_state()
        for attempt in (1, 2):
            failed = False
            try:
                final = checkpoint.save(self.run, self.step, self.model, self.optimizer, self.scheduler, state,
                                        self.config.trainer.keep_checkpoints, rank_rng=(rank_rng or [])[1:])
                break
            except oom.OutOfMemory:
                failed = True
            except Exception as exc:
                if is_disk_full(exc, self.run.checkpoints_dir):
                    raise DiskFull(self.run.checkpoints_dir / f"step-{self.step}", self.run.id) from exc
                raise
            if failed:
                oom.free(self.device)
                latest = self.run.latest_checkpoint()
                kept = f"the last checkpoint is {latest.name}" if latest is not None else "no checkpoint yet"
                oom.warn(self.emit, (f"out of memory saving the checkpoint at step {self.step}: " + (
                    "freed memory, saving it again" if attempt == 1 else
                    f"skipped it ({kept}); training goes on")))
        else:
            self._saved_step = None  # skipped: the end of training tries again
            return None
        self.emit(ev.CheckpointSaved(step=self.step, path=str(final)))
        return final

    def _restore_newest_loadable(self) -> Path:
        """Restore the newest checkpoint that loads; each newer one that does not is skipped with a
        warning saying why. None at all, or none that loads, fails the run in one line."""
        found = list(reversed(self.run.checkpoints()))
        rid = self.run.id
        if not found:
            self._fail("config", f"run {rid} has no checkpoint to resume from; start it again from step 0 "
                                 f"with 'studio train --resume {rid} --from-scratch'")
        skipped = []
        for path in found:
            try:
                files = checkpoint.read(path, self.device, rank=self.group.rank)
            except Exception as exc:  # a truncated or missing file: whatever the reader raises
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                skipped.append(f"{path.name}: {reason}")
                self.emit(ev.WarningRaised(kind="config", message=(
                    f"checkpoint {path} does not load ({reason}); skipped it, trying the one before")))
                continue
            self._restore(files)
            if skipped:
                self.emit(ev.WarningRaised(kind="config", message=(
                    f"resuming from {path.name} (step {self.step}); skipped {', '.join(skipped)}")))
            return path
        self._fail("config", (f"no checkpoint of run {rid} loads ({'; '.join(skipped)}); train it again as "
                              f"a new run with 'studio train {self.run.config_path}'"))
        raise AssertionError("not reached: _fail raises")

    def _restore(self, files: dict[str, Any]) -> None:
        assert self.optimizer is not None and self.scheduler is not None
        state = checkpoint.apply(files, self.model, self.optimizer, self.scheduler)
        self.step = self._saved_step = int(state["step"])
        self.cursor = Cursor(int(state["cursor"]["epoch"]), int(state["cursor"]["offset"]))
        self.micro_batch_size = int(state["micro_batch_size"])
        # The effective batch (units over every rank) is the run's: on another number of processes
        # each rank's share and accumulation change, the steps' data do not.
        self.units_per_step = int(state["units_per_step"])
        saved_on = int(state.get("processes", 1))
        if saved_on != self.group.world:
            self.emit(ev.WarningRaised(kind="config", message=dist.resume_note(
                saved_on, self.group.world, self.units_per_step, self.accumulation_steps)))
        self.best_eval_loss = state.get("best_eval_loss")
        if self.session.grpo is not None:
            self.session.grpo.restore_sampler(state.get("grpo_sampler"))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.elapsed = float(state.get("elapsed_s", 0.0))

    # ------------------------------------------------------------------------------------ memory

    def memory_event(self, step: int | None = None) -> ev.MemorySampled:
        """This rank's device memory now (studio/engine/memory.py:sample), as of ``step`` (the current
        one by default); activations and the peaks are those since the last ``reset_peak`` (the loop
        resets it before each logged step)."""
        if self._sampler is None:
            self._sampler = MemorySampler(self.model, self.device, self.group.rank)
        with phase("studio.memory_sample"):
            return self._sampler(self.optimizer, self.step if step is None else step)
