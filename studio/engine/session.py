"""One loaded model and everything done with it: the engine side of a worker.

``Session(config, run, emit)`` owns what loading makes: the base model with its LoRA, the
tokenizer, the encoded data and the fast training path. It answers prompts with the adapter or
with the base model (through peft's ``disable_adapter()``), puts a run's saved adapter in place for
chat with a past run, and runs training as a :class:`~studio.engine.train.Trainer` on itself. The
worker talks to the session only; the Trainer only trains.

A full fine-tune (``lora: null``) has no adapter: every weight of the loaded base trains, a past
run's saved weights are copied into it in place, and base answers come from a second, untouched
copy of the base loaded on the first such answer (:meth:`Session.original_model`). Past ~400 lines
for those branches: each sits beside the LoRA step it stands in for.

Everything it has to say goes through the one ``emit`` callback as typed events
(studio/core/events.py).

Data parallel (torchrun): rank 0's session is the worker's; the other ranks run :func:`follow`, a
session of their own that trains whenever rank 0's does (studio/engine/distributed.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from studio.core import events as ev
from studio.core.config import ConfigError, RunConfig
from studio.core.data.pairs import is_preference
from studio.core.grpo.rows import is_grpo
from studio.core.plan import choose_path
from studio.core.runs import RunDir
from studio.engine import checkpoint, oom, planning
from studio.engine import distributed as dist
from studio.engine import fast as fastpath
from studio.engine import generate as gen
from studio.engine.fast.build import path_facts
from studio.engine.model import (
    BaseModel,
    ModelLoadError,
    attach_lora,
    count_parameters,
    load_base,
    pick_device,
    prepare_full_finetune,
)
from studio.engine.preference import Pair, PreferenceObjective
from studio.engine.train import BetweenSteps, Trainer, TrainingError

if TYPE_CHECKING:
    from studio.engine.grpo import GrpoObjective

Emit = Callable[[ev.Event], None]


@dataclass
class TrainingData:
    """Encoded splits and the template they were rendered with."""

    train: list[Any]
    validation: list[Any]
    test_rows: list[dict]
    validation_rows: list[dict]
    template: str
    truncated: int
    chat: bool = False
    """Whether the rows are conversations (rendered with the tokenizer's chat template)."""
    kind: str = "instruction"
    """The data's shape (studio/core/data/shapes.py): instruction, chat, pairs, chat_pairs or text."""


class Session:
    """``config``'s model loaded for ``run``; reports through ``emit``. ``between_steps`` is what
    every Trainer made by :meth:`new_trainer` calls after each optimizer step (the worker serves
    its commands there)."""

    def __init__(self, config: RunConfig, run: RunDir, emit: Emit,
                 between_steps: BetweenSteps | None = None, *, device: torch.device | None = None):
        self.config = config
        self.run = run
        self.emit = emit
        self.between_steps = between_steps
        self.group = dist.current()
        """This process's place in a data-parallel run (a group of one without torchrun)."""
        self.device = device or self.group.device
        self.base: BaseModel | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.data: TrainingData | None = None
        self.fast: fastpath.FastModel | None = None
        """The fast training path (studio/engine/fast.py), or None for the plain transformers one."""
        self.preference: PreferenceObjective | None = None
        """A DPO / ORPO run's loss (studio/engine/preference.py); None for SFT."""
        self.grpo: GrpoObjective | None = None
        """A GRPO run's sampling, rewards and loss (studio/engine/grpo.py); None otherwise."""
        self.trainer: Trainer | None = None
        """The Trainer of the latest :meth:`train`, or None before any."""
        self.auto_plan: Any = None
        """The plan that resolved ``auto`` in the config at load (core/memory/autoplan.py's AutoPlan), or None."""
        self._sampler = torch.Generator()
        self._chat: Any = None
        """The chat template renderer for conversation rows, made on first use."""
        self._fresh_lora: dict[str, torch.Tensor] | None = None
        """The LoRA's initial weights (on the CPU) while :meth:`load_trained_adapter` has replaced them
        (a full fine-tune's: every weight of the base)."""
        self._original: Any = None
        """A full fine-tune's untouched base, loaded on the first base answer (there is no adapter to
        switch off: the trained weights are the base's own)."""
        self._shape: Any = None
        """The base model's ModelInfo (core/model/info.py) for the answer's memory plan, read once;
        False when it cannot be read."""

    # ------------------------------------------------------------------------------------ loading

    @property
    def loaded(self) -> bool:
        """True once :meth:`load` has succeeded."""
        return self.model is not None and self.data is not None

    def load(self) -> None:
        """Load the model, attach a fresh LoRA (seeded) and encode the data. Emits ModelLoading,
        ModelLoaded; on a user error emits WorkerFailed and raises :class:`TrainingError`."""
        from studio.core.data import DataError, load_splits
        from studio.engine.quiet import send_library_output_to

        send_library_output_to(self.run.log_path)  # before bitsandbytes, which speaks at import
        base_model = self.config.model.base_model
        if self.config.full_finetune and self.group.world > 1:  # --gpus N after the config was checked
            self.fail("config", f"'lora' is null (full fine-tuning) and this run has {self.group.world} GPUs: "
                      "Studio trains a full fine-tune on one GPU; run it with --gpus 1, or give a lora section")
        try:
            # The data first: a bad path or column fails in a second, not after the model loads.
            self.emit(ev.ModelLoading(stage="reading the data", fraction=0.0))
            splits = load_splits(self.config)
            # TRL's preference shapes and raw text bring their own prompt settings (core/data/shapes.py).
            self.config = splits.shape.adapt(self.config)
            if is_grpo(self.config):
                self._check_rewards(splits.train[0] if splits.train else {})
            checkpoint.seed_everything(self.config.trainer.seed)
            # auto micro-batch / checkpointing: numbers before the model is prepared (engine/planning.py)
            self.config, self.auto_plan = planning.resolve(
                self.config, self.run, self.device or pick_device(), self.emit, self.group.leader,
                rows=splits.train)
            self.base = load_base(self.config, progress=lambda stage, fraction: self.emit(
                ev.ModelLoading(stage=stage, fraction=fraction)), device=self.device)
            for warning in self.base.warnings:
                self.emit(ev.WarningRaised(kind="config", message=warning))
            if self.config.full_finetune:
                self.emit(ev.ModelLoading(stage="every weight trains (full fine-tuning)", fraction=0.85))
                self.model = prepare_full_finetune(self.base, self.config)
            else:
                self.emit(ev.ModelLoading(stage="attaching LoRA", fraction=0.85))
                self.model = attach_lora(self.base, self.config)
            self.tokenizer = self.base.tokenizer
            self.device = self.base.device
            self.emit(ev.ModelLoading(stage="encoding the data", fraction=0.9))
            self.data = self._encode_data(splits)
        except (ModelLoadError, ConfigError, planning.PlanRefused) as exc:
            self.fail("config", str(exc))
        except DataError as exc:
            self.fail("data", str(exc))
        except (ValueError, FileNotFoundError) as exc:  # template and tokenizer problems
            self.fail("config", f"{base_model}: {exc}")
        trainer = self.config.trainer
        self.fast, why = fastpath.enable(self.model, self.device, trainer.method, trainer.fast_path,
                                         trainer.router_aux_loss_coef)
        if self.fast is None and self.device.type == "cuda":
            self.emit(ev.WarningRaised(kind="config", message=(
                f"the fast training path is off ({why}); training runs on the slower plain path")))
        if self.fast is not None:
            why = choose_path(path_facts(self.model, self.device, trainer.method, trainer.fast_path,
                                         trainer.router_aux_loss_coef)).reason
        if self.preference is not None:
            self.preference.fast = self.fast  # DPO / ORPO's log-probs through the fast layers
        total, trainable = count_parameters(self.model)
        self.emit(ev.ModelLoaded(base_model=base_model, device=str(self.device),
                                 dtype=str(self.base.compute_dtype).removeprefix("torch."),
                                 quantization=self.base.quantization, total_params=total,
                                 trainable_params=trainable, load_seconds=round(self.base.seconds, 2),
                                 path="plain" if self.fast is None else "fast", path_reason=why))
        if self.data.truncated and self.grpo is not None:
            room = self.config.data.max_seq_length - self.config.grpo.max_completion_length
            self.emit(ev.WarningRaised(kind="data", message=(
                f"{self.data.truncated} training prompts are longer than data.max_seq_length minus "
                f"grpo.max_completion_length ({room} tokens) and lost their start; raise data.max_seq_length "
                "if the prompts' beginnings matter")))
        elif self.data.truncated:
            self.emit(ev.WarningRaised(kind="data", message=(
                f"{self.data.truncated} training rows are longer than data.max_seq_length "
                f"({self.config.data.max_seq_length} tokens) and were truncated; raise it if answers "
                "get cut off")))

    def _check_rewards(self, row: dict) -> None:
        """Import the rewards and call each on one training row, before the model loads: a reward
        that cannot run fails the run in a second, not after the load."""
        from studio.core.grpo import rewards

        try:
            rewards.check_on_row(self.config, row)
        except (rewards.RewardError, rewards.RewardFailed) as exc:
            self.fail(ev.FailureKind.REWARD, f"{exc}; fix it and train again (the model did not load)")

    def _encode_grpo(self, splits: Any, template: str) -> TrainingData:
        """A GRPO run's prompts (studio/engine/grpo.py), and its objective."""
        from studio.core import prompt
        from studio.core.grpo import rows as grpo_rows
        from studio.engine.grpo import GrpoObjective

        field = self.config.prompt.response_field

        def render(row: dict) -> str:
            if grpo_rows.conversation(row) is not None:
                return self.render_prompt(row)  # the chat template and its generation prompt
            fields = grpo_rows.template_row(row, self.config)
            return prompt.render(template, {**fields, field: ""}, field).prompt

        self.grpo = GrpoObjective(self.config, self.model, self.tokenizer, self.device, self.base.compute_dtype,
                                  self.emit, gen.stop_ids(self.model, self.tokenizer), render,
                                  gen.bos_to_add(self.tokenizer))
        train = self.grpo.encode(list(splits.train))
        validation_rows = list(splits.validation)[: self.config.trainer.eval_max_rows]
        return TrainingData(train=train, validation=self.grpo.encode(validation_rows),
                            test_rows=list(splits.test), validation_rows=validation_rows, template=template,
                            truncated=sum(1 for e in train if e.truncated),
                            chat=any(grpo_rows.conversation(row) is not None for row in splits.train[:1]))

    def _encode_data(self, splits: Any) -> TrainingData:
        """The splits as training examples (core/data/encoding.py's RowEncoder with this tokenizer); a
        run whose training rows would train on no token is refused here, before any step."""
        from studio.core import prompt
        from studio.core.data import DataError, encoding
        from studio.core.prompt import chat

        kind = splits.shape.kind
        encoder = self.row_encoder(kind)
        # Conversational pairs render through the chat template itself (and say so if there is none).
        template = encoder.template if kind != "chat_pairs" else self.config.prompt.template
        if is_grpo(self.config):
            return self._encode_grpo(splits, template)
        if is_preference(self.config):
            tc = self.config.trainer
            self.preference = PreferenceObjective(tc.method, tc.beta, self.model, self.device, self.base.compute_dtype,
                                                  lambda row: Pair(*encoder.encode(row)))
        untrained = encoding.Untrained(total=len(splits.train))

        def encode(rows: list[dict], split: str) -> list[Any]:
            out = []
            for number, row in enumerate(rows):
                try:
                    texts = encoder.render(row)
                    examples = [encoder.encode_rendered(r) for r in texts]
                except prompt.TemplateError as exc:
                    raise DataError(f"{self.config.data.path}: {split} row {number}: {exc}") from None
                if split == "training":
                    reason = next((why for r, e in zip(texts, examples, strict=True)
                                   if (why := encoding.why_untrained(r, e, encoder)) is not None), None)
                    if reason is not None:
                        untrained.reasons[reason] += 1
                        untrained.rows.append(number)
                if self.preference is not None:
                    out.append(Pair(examples[0][0], examples[1][0]))
                else:
                    out.extend(e for block in examples for e in block)
            return out

        train = encode(list(splits.train), "training")
        if untrained.refused:
            raise DataError(encoding.refusal(untrained, self.config, str(self.config.data.path)))
        if not train:
            raise ConfigError(f"{self.config.data.path}: no training rows after splitting; check "
                              "data.split_column / data.val_fraction")
        validation_rows = list(splits.validation)[: self.config.trainer.eval_max_rows]
        return TrainingData(train=train, validation=encode(validation_rows, "validation"),
                            test_rows=list(splits.test), validation_rows=validation_rows, template=template,
                            truncated=sum(1 for e in train if e.truncated),
                            chat=kind == "chat_pairs" or any(chat.is_chat_row(row) for row in splits.train[:1]),
                            kind=kind)

    def row_encoder(self, kind: str = "instruction") -> Any:
        """core/data/encoding.py's RowEncoder for this run's config and tokenizer: how a row is rendered
        and encoded, the same code ``studio config check`` counts trained tokens with."""
        from studio.core.data.encoding import RowEncoder, Vocab

        tok = self.tokenizer

        def tokenize(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        vocab = Vocab(tokenize, tok.eos_token_id, tok.eos_token, gen.bos_to_add(tok), tok.bos_token,
                      getattr(tok, "chat_template", None))
        return RowEncoder(self.config, vocab, kind)

    def chat_renderer(self) -> Any:
        """The tokenizer's chat template as a :class:`~studio.core.prompt.chat.ChatRenderer` (made once)."""
        from studio.core.prompt.chat import ChatRenderer

        if self._chat is None:
            tok = self.tokenizer
            self._chat = ChatRenderer(getattr(tok, "chat_template", None) or "", bos_token=tok.bos_token or "",
                                      eos_token=tok.eos_token or "")
        return self._chat

    def fail(self, kind: str, message: str, detail: str = "") -> None:
        """Emit a fatal WorkerFailed and raise :class:`TrainingError` (never returns)."""
        self.emit(ev.WorkerFailed(kind=kind, message=message, detail=detail, fatal=True))
        raise TrainingError(kind, message)

    # ------------------------------------------------------------------------------------ adapters

    def load_trained_adapter(self) -> Path | None:
        """Load the model (if not yet) and put the run's adapter (:meth:`RunDir.adapter`) into its
        LoRA, so that generation and evaluation answer as the fine-tuned model: chat with a past
        run. Returns the folder, or None (the fresh LoRA stays) when the run has no adapter yet or
        it cannot be loaded (a WarningRaised says why). A later training from scratch
        starts again from the fresh LoRA (:meth:`restore_fresh_lora`)."""
        if not self.loaded:
            self.load()
        folder = self.run.adapter()
        if folder is None:
            return None
        fresh = {name: p.detach().to("cpu", copy=True)
                 for name, p in self.model.named_parameters() if p.requires_grad}
        if self.config.full_finetune:
            try:
                checkpoint.load_model_weights(self.model, folder)
            except (OSError, RuntimeError, ValueError) as exc:
                self.emit(ev.WarningRaised(kind="config", message=(
                    f"{folder}: cannot load the fine-tuned weights ({str(exc).splitlines()[0]}); the "
                    "fine-tuned answers come from the base")))
                return None
            self._fresh_lora = self._fresh_lora or fresh
            return folder
        try:
            unmatched = checkpoint.load_adapter_weights(self.model, folder, self.device)
        except (OSError, RuntimeError, ValueError) as exc:
            self.emit(ev.WarningRaised(kind="config", message=(
                f"{folder}: cannot load the trained adapter ({str(exc).splitlines()[0]}); the fine-tuned "
                "answers come from an untrained LoRA. Was config.yaml's lora section edited after training?")))
            return None
        if unmatched:
            self.emit(ev.WarningRaised(kind="config", message=(
                f"{folder}: {len(unmatched)} adapter weights match no layer (e.g. {unmatched[0]}); was "
                "lora.target_modules in config.yaml changed after training?")))
        self._fresh_lora = self._fresh_lora or fresh
        return folder

    def restore_fresh_lora(self) -> None:
        """Put back the LoRA's initial weights if :meth:`load_trained_adapter` replaced them, in
        place (the optimizer and the fast path keep pointing at the same tensors)."""
        if self._fresh_lora is None:
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self._fresh_lora:
                    param.copy_(self._fresh_lora[name])
        self._fresh_lora = None

    def original_model(self) -> Any:
        """A full fine-tune's base as it was before training (its own copy, frozen, loaded on first
        use): what base answers come from. It costs the weights' memory once more."""
        if self._original is None:
            self.emit(ev.ModelLoading(stage="loading the original base for base answers", fraction=0.5))
            original = load_base(self.config, device=self.device).model
            original.requires_grad_(False)
            self._original = original.eval()
        return self._original

    # ------------------------------------------------------------------------------------ training

    def new_trainer(self) -> Trainer:
        """A Trainer on this session (a test wraps this to install hooks on the trainer)."""
        return Trainer(self, self.between_steps)

    def train(self, resume: bool = False) -> ev.TrainingFinished:
        """Train to the end or a stop request with a new Trainer; with ``resume``, continue from the
        run's latest checkpoint. Rank 0 of a data-parallel run first tells the other ranks to train
        too. A crash there ends every rank (one alone could not finish a step; torchrun ends the rest)."""
        self.group.instruct({"do": "train", "resume": resume})
        self.trainer = self.new_trainer()
        try:
            return self.trainer.train(resume=resume)
        except TrainingError as exc:
            if self.group.active and exc.kind == ev.FailureKind.CRASH:
                sys.stderr.flush()
                os._exit(1)
            raise

    def evaluate(self) -> ev.EvalLogged:
        """Validation loss now (EvalLogged), at the latest Trainer's step and micro-batch size."""
        return (self.trainer or self.new_trainer()).evaluate()

    # ------------------------------------------------------------------------------------ answers

    def render_prompt(self, prompt: str | dict) -> str:
        """The text the model is given for ``prompt``: a row (dict) or a plain instruction rendered
        through the run's template, up to where the response starts. A chat row (``messages``, with
        its ``tools``) and, on chat data, a plain message are rendered with the chat template plus its
        generation prompt. On raw text the prompt is a document's start, given as it is."""
        from studio.core.prompt import chat, render, template_fields

        template = self.data.template if self.data else self.config.prompt.template
        field = self.config.prompt.response_field
        if isinstance(prompt, dict) and chat.is_chat_row(prompt):
            return self.chat_renderer().prompt(chat.messages_of(prompt), chat.tools_of(prompt))
        if isinstance(prompt, str) and self.data is not None and self.data.chat:
            return self.chat_renderer().prompt([chat.Turn("user", prompt)])
        if self.data is not None and self.data.kind == "text":
            # Raw text (continued pretraining): the prompt is the start of a document to continue.
            return prompt if isinstance(prompt, str) else str(prompt.get(field, ""))
        if isinstance(prompt, str):
            fields = [f for f in template_fields(template) if f != field]
            prompt = {fields[0] if fields else "instruction": prompt}
        return render(template, {**prompt, field: ""}, field).prompt

    def generate(self, prompt: str | dict, adapter: bool = True, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 on_text: Callable[[str], None] | None = None) -> gen.GenerationResult:
        """Answer ``prompt`` with the adapter (or the base model through ``disable_adapter()``),
        streaming pieces of text to ``on_text``. Safe between training steps."""
        if not self.loaded:
            self.load()
        ids = gen.prompt_ids(self.tokenizer, self.render_prompt(prompt))
        streamed = False

        def stream(text: str) -> None:
            nonlocal streamed
            streamed = True
            if on_text is not None:
                on_text(text)

        model = self.model
        if not adapter and self.config.full_finetune:
            model, adapter = self.original_model(), True  # no adapter to switch off: the untouched base
        g = self.config.generation
        kv_on_host = self.answer_kv_on_host(len(ids), max_new_tokens or g.max_new_tokens)
        oom.between_phases(self.device)  # (a training step's cached activations, if one ran)
        try:
            for attempt in (1, 2):
                failed = False
                try:
                    return gen.generate(model, self.tokenizer, ids, adapter=adapter,
                                        max_new_tokens=max_new_tokens or g.max_new_tokens,
                                        temperature=g.temperature if temperature is None else temperature,
                                        top_p=g.top_p if top_p is None else top_p, on_text=stream,
                                        generator=self._sampler, device=self.device,
                                        autocast_dtype=self.base.compute_dtype if self.base else None,
                                        kv_on_host=kv_on_host)
                except oom.OutOfMemory:
                    failed = True
                if failed:  # outside the except block: the traceback no longer pins the cache
                    oom.free(self.device)
                    if attempt == 1 and not streamed:
                        oom.warn(self.emit, (f"out of memory answering a prompt of {len(ids)} tokens: freed "
                                             "memory and answering again"))
                        continue
                    message = (f"out of memory answering a prompt of {len(ids)} tokens"
                               f"{', again after freeing memory' if attempt == 2 else ' part way'}: no answer; "
                               "training goes on. Try a shorter prompt or a smaller max_new_tokens")
                    oom.warn(self.emit, message)
                    raise TrainingError("oom", message)
        finally:
            oom.between_phases(self.device)  # the answer's blocks, before the next training step
        raise AssertionError("not reached")

    def answer_kv_on_host(self, prompt_tokens: int, new_tokens: int) -> bool:
        """Whether an answer of ``new_tokens`` after ``prompt_tokens`` keeps its KV cache on the host
        (engine/generate.py): when on the card it would need more memory than this run's training
        step, as the estimate's generation phase says (core/memory/phases.py) for the run's plan on the
        path this session trains on. Only on CUDA; never when the model's shape cannot be read."""
        from dataclasses import replace

        from studio.core.memory import estimate_plan, plan_for
        from studio.core.model.info import ModelInfoError, load_model_info

        if self.device is None or self.device.type != "cuda":
            return False
        if self._shape is None:
            try:
                self._shape = load_model_info(self.config.model.base_model, self.config.model.revision)
            except (ModelInfoError, ValueError):
                self._shape = False
        if self._shape is False:
            return False
        try:
            plan = replace(plan_for(self.config, info=self._shape), path="fast" if self.fast is not None else "plain",
                           generate_prompt_tokens=prompt_tokens, generate_new_tokens=new_tokens)
            return estimate_plan(self._shape, plan).phases["generation"].host_kv
        except ValueError:  # a LoRA target the shape does not know: the estimate cannot say
            return False


def follow(run: RunDir) -> None:
    """A rank other than 0 of a data-parallel run: a session of its own that loads and trains
    whenever rank 0's worker says so, until it says exit. Its events stay here (rank 0 writes the
    run's); failures go to stderr, which is the run's worker.log."""

    def emit(event: ev.Event) -> None:
        if isinstance(event, ev.WorkerFailed):
            print(f"rank {group.rank}: {event.message}", file=sys.stderr, flush=True)

    group = dist.current()
    session = Session(run.config(), run, emit)
    while (order := group.next_instruction())["do"] == "train":
        if not session.loaded:
            try:
                session.load()
            except TrainingError:
                sys.exit(1)  # rank 0 loaded, so it waits for this rank: torchrun ends the run instead
        try:
            session.train(resume=bool(order.get("resume")))
        except TrainingError:
            pass  # every rank met it together (an OOM at micro-batch 1); wait for rank 0's next word
    group.close()
