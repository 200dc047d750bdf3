"""GRPO (group relative policy optimisation): sample a group of completions per prompt, score them
with the run's rewards, and push each completion's tokens up or down by how it did in its group.

The Trainer's loop is the same as for SFT: a step takes ``effective_batch_size`` prompts (its
units), each micro-batch is ``micro_batch_size`` prompts, and :meth:`GrpoObjective.forward` stands
in for the cross-entropy. For a micro-batch it

1. samples ``num_generations`` completions of every prompt with the policy (the model with its
   LoRA, eval mode, no gradients), all rows at once with a KV cache (engine/sampler.py);
2. scores them with every reward (studio/core/grpo/rewards.py), one group at a time;
3. turns each completion's total into its advantage within its group,
   ``A = (r - mean(group)) / (std(group) + 1e-4)``;
4. runs the scored pass: prompt + completion through the policy (training mode), each completion
   token's log-prob ``log p`` (the decoder, then the output head a chunk of tokens at a time:
   engine/chunked_head.py; no logits of every completion token); with ``beta`` > 0, the same
   through the base (the adapters switched off, no gradients) for the KL term
   ``exp(ref - log p) - (ref - log p) - 1``. On a GPU it goes a chunk of completions at a time
   (:meth:`GrpoObjective.scored_rows`, the estimate's choice), each chunk's backward before the
   next chunk's forward;
5. returns the summed loss of the tokens ``-A * exp(log p - stopgrad(log p)) + beta * KL`` (one
   policy update per sampling, so the ratio is 1 with the gradient of ``log p``): ``grpo`` sums
   each completion's mean over its tokens, ``dr_grpo`` every token. The micro-batch's
   ``label_tokens`` is its completions (``grpo``) or completions x ``max_completion_length``
   (``dr_grpo``), so the Trainer's step loss is the mean over the step however it is split.

Sampling is counter-based (engine/sampler.py): each completion's noise is a function of (the run's
seed, the step, the prompt's place in the step, the completion's number in its group), so a step
redone after an out-of-memory halving, split over GPUs, or resumed from a checkpoint samples the
same completions; the checkpoint carries the sampler's seed and step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.grpo import rewards as rw
from studio.core.grpo import rows as grpo_rows
from studio.core.grpo.metrics import StepSums, step_event
from studio.core.memory import plan_for
from studio.core.memory.estimate import grpo_scored_rows
from studio.core.model.info import ModelInfoError, load_model_info
from studio.engine.chunked_head import find_head
from studio.engine.grpo_prompts import PromptBatch, PromptExample, encode_prompts
from studio.engine.sampler import GroupSampler, Sampled, step_seed
from studio.engine.token_logps import token_logps

ADVANTAGE_EPS = 1e-4
"""Added to a group's standard deviation before dividing (TRL's value): a group whose rewards barely
differ does not blow its advantages up."""

GROUP_TEXT_CHARS = 1000
"""Most characters of a completion kept in a GrpoGroupSampled event (the run's log stays small)."""


class GrpoObjective:
    """A GRPO run's sampling, rewards and loss on a session's model, and its metrics and events."""

    def __init__(self, config: RunConfig, model: Any, tokenizer: Any, device: torch.device,
                 compute_dtype: torch.dtype, emit: Callable[[ev.Event], Any], stops: Sequence[int],
                 render: Callable[[dict], str], bos: int | None, base_dir: str | Path | None = None):
        self.config = config
        self.settings = config.grpo
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.compute_dtype = compute_dtype
        self.emit = emit
        self.base_dir = base_dir
        self.render = render
        """A data row -> the prompt text the policy reads (the session's template or chat template)."""
        self.bos = bos
        self.rewards: list[rw.Reward] = []
        self._head, _ = find_head(model)
        """The decoder and output head of the scored pass (engine/chunked_head.py); None: the
        model's own logits instead."""
        self.sampler = GroupSampler(model, device, tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                    else (tokenizer.eos_token_id or 0), stops, compute_dtype)
        self.seed = config.trainer.seed
        """The sampler's seed: the run's, or a restored checkpoint's."""
        self._step = 0
        self._sums = StepSums()
        self._group: ev.GrpoGroupSampled | None = None
        self._graph_failure_reported = False
        self.step_tokens = 0
        """Real tokens (prompts and completions) of the current step's scored passes, for tokens/s."""
        self.loss_divisor = 1.0
        """What the Trainer divides a micro-batch's loss by before its backward (the step's
        ``label_tokens`` over every rank): the scored pass's chunks backpropagated here
        (:meth:`_scored_pass`) are divided by the same."""
        self._scored_rows: dict[int, int] = {}

    # ------------------------------------------------------------------------------ set-up

    @property
    def per_prompt(self) -> int:
        """What one prompt adds to the loss's divisor: its completions (grpo), or completions x
        the most tokens one may have (dr_grpo)."""
        g = self.settings
        return g.num_generations * (g.max_completion_length if g.loss == "dr_grpo" else 1)

    def load_rewards(self) -> None:
        """Import the reward functions (again: a file fixed since the last start is read anew)."""
        self.rewards = rw.load_rewards(self.config, self.base_dir)

    def sampler_state(self) -> dict[str, int]:
        """What a checkpoint keeps of the sampler: its seed (the step is the checkpoint's own)."""
        return {"seed": self.seed}

    def restore_sampler(self, state: dict[str, Any] | None) -> None:
        """Continue the sampler a checkpoint kept (:meth:`sampler_state`)."""
        if state and "seed" in state:
            self.seed = int(state["seed"])

    # ------------------------------------------------------------------------------ a step

    def start_step(self, step: int) -> None:
        """Forget the metrics so far; the next micro-batches belong to optimizer step ``step`` + 1
        (``step`` steps done). A step redone after an out-of-memory error starts again here."""
        self._step = step
        self._sums = StepSums()
        self._group = None
        self.step_tokens = 0

    @property
    def _autocast_on(self) -> bool:
        return self.device.type == "cuda" and self.compute_dtype != torch.float32

    def _autocast(self) -> Any:
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype, enabled=self._autocast_on)

    def forward(self, batch: PromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample, score and return the summed loss of one micro-batch of prompts (and a zero in
        place of SFT's argmax hits). A reward that fails raises RewardFailed."""
        g = self.settings.num_generations
        prompts = [example.input_ids for example in batch.examples for _ in range(g)]
        keys = [place * g + j for place in batch.positions for j in range(g)]
        sampled = self.sampler.sample(prompts, keys, step_seed(self.seed, self._step),
                                      self.settings.max_completion_length, self.settings.temperature)
        self._report_graph_failure()
        texts = self._texts(sampled)
        totals, scores = self._score(batch.examples, sampled, texts)
        advantages = _advantages(totals, g)
        loss, kl = self._scored_pass(prompts, sampled, advantages)
        self._record(batch.examples, sampled, texts, totals, scores, advantages, kl)
        return loss, torch.zeros((), device=loss.device)

    def _texts(self, sampled: Sampled) -> list[str]:
        """Each completion as text, its stop token left out."""
        texts = []
        for r, length in enumerate(sampled.lengths):
            ids = sampled.row(r)[: length - 1 if sampled.stopped[r] else length]
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return texts

    def _score(self, examples: Sequence[PromptExample], sampled: Sampled, texts: list[str]
               ) -> tuple[list[float], list[rw.GroupScores]]:
        """Every group's rewards (studio/core/grpo/rewards.py): each completion's total, and per group
        each reward's values."""
        g = len(sampled.lengths) // max(1, len(examples))
        totals: list[float] = []
        scores: list[rw.GroupScores] = []
        for i, example in enumerate(examples):
            group = texts[i * g:(i + 1) * g]
            conversational = grpo_rows.conversation(example.row) is not None
            completions: list[Any] = [[{"role": "assistant", "content": t}] for t in group] if conversational \
                else group
            result = rw.score_group(self.rewards, example.prompt, completions, grpo_rows.reward_columns(example.row),
                                    [sampled.row(r) for r in range(i * g, (i + 1) * g)], shown_prompt=example.text)
            totals.extend(result.totals)
            scores.append(result)
        return totals, scores

    def _rows(self, prompts: Sequence[Sequence[int]], sampled: Sampled
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scored pass's input: each prompt left-padded to the longest, its completion after it
        (right-padded); the attention mask, the positions, and the mask of completion tokens."""
        width = max(len(p) for p in prompts)
        pad = self.sampler.pad_id
        completion = sampled.tokens.to(self.device)
        rows, length = completion.shape
        ids = torch.full((rows, width), pad, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
            attention[r, width - len(prompt):] = 1
        lengths = torch.tensor(sampled.lengths, device=self.device)
        answer = (torch.arange(length, device=self.device)[None, :] < lengths[:, None]).long()
        ids = torch.cat([ids.to(self.device), completion], 1)
        attention = torch.cat([attention.to(self.device), answer], 1)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        return ids, attention, positions, answer

    def _completion_logps(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                          answer: torch.Tensor) -> torch.Tensor:
        """Log-probs (fp32) of the completion tokens, the last ``answer.shape[1]`` of every row; 0
        where ``answer`` marks no token. Through the decoder and the output head a chunk of tokens at
        a time (engine/chunked_head.py) where the model allows, else from the model's logits of the
        completion positions."""
        length = answer.shape[1]
        if self._head is None:
            return self._logits_logps(ids, attention, positions, length)
        with self._autocast():
            hidden = self._head.hidden(ids, attention, positions)
        wanted = answer.bool()
        # position t's hidden state predicts token t + 1: the completion's tokens are predicted from
        # the last prompt token on, and the row's last position predicts nothing
        h = hidden[:, -(length + 1):-1][wanted]
        dtype = self.compute_dtype if self._autocast_on else self._head.head.weight.dtype
        logps = self._head.logps(h, ids[:, -length:][wanted], dtype)
        return torch.zeros(wanted.shape, dtype=torch.float32, device=logps.device).masked_scatter(wanted, logps)

    def _logits_logps(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                      length: int) -> torch.Tensor:
        """:meth:`_completion_logps` from the model's own forward: the logits of the completion
        positions (``logits_to_keep``), whose log-softmax engine/token_logps.py takes in slices."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        keep = {"logits_to_keep": length + 1} if "logits_to_keep" in inspect.signature(base.forward).parameters \
            else {}
        with self._autocast():
            logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                                use_cache=False, **keep).logits
        logits = logits[:, -(length + 1):]
        # The last position predicts past the end: its target is a dummy, dropped after (no copy of
        # the logits to cut it off first).
        targets = torch.cat([ids[:, -length:], torch.zeros_like(ids[:, :1])], 1)
        return token_logps(logits, targets)[:, :length]

    def _reference_logps(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
                         answer: torch.Tensor) -> torch.Tensor:
        """The base model's log-probs of the completions: adapters off, no gradients, no dropout."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.model.disable_adapter():
                return self._completion_logps(ids, attention, positions, answer)
        finally:
            if was_training:
                self.model.train()

    def scored_rows(self, rows: int) -> int:
        """Completions the scored pass of a micro-batch of ``rows`` takes in one forward and backward:
        on a CUDA card, what the estimate chooses for this run's plan (core/memory/estimate.py's
        ``grpo_scored_rows``: halved while the scored pass is the largest phase); elsewhere, or when the
        model's shape cannot be read, all of them. Every scored pass asks here, so a test can
        replace it."""
        if rows not in self._scored_rows:
            self._scored_rows[rows] = self._planned_rows(rows)
        return self._scored_rows[rows]

    def _planned_rows(self, rows: int) -> int:
        if self.device.type != "cuda":
            return rows
        try:
            info = load_model_info(self.config.model.base_model, self.config.model.revision)
            prompts = max(1, rows // self.settings.num_generations)
            plan = replace(plan_for(self.config, micro_batch=prompts, info=info), path="plain")
            return grpo_scored_rows(info, plan) or rows
        except (ModelInfoError, ValueError):  # no shape, or a LoRA target it lacks: the estimate cannot say
            return rows

    def _scored_pass(self, prompts: Sequence[Sequence[int]], sampled: Sampled, advantages: torch.Tensor
                     ) -> tuple[torch.Tensor, tuple[float, int] | None]:
        """The micro-batch's summed loss and, with ``beta`` > 0, its summed KL and token count.

        The completions go through :meth:`scored_rows` at a time. Every chunk but the last is
        backpropagated here, divided by :attr:`loss_divisor` as the Trainer divides the loss it is
        handed, so that one chunk's activations are alive at a time; the loss returned is the last
        chunk's (the Trainer's backward takes it) plus the earlier chunks' values, detached. The
        gradients are the sum of the chunks', which is the whole micro-batch's: both losses are
        sums over completions (``grpo``) or tokens (``dr_grpo``) over the step's one divisor."""
        ids, attention, positions, answer = self._rows(prompts, sampled)
        self.step_tokens += int(attention.sum())
        rows = ids.shape[0]
        per = self.scored_rows(rows)
        backward = torch.is_grad_enabled()
        earlier = torch.zeros((), device=ids.device)
        kl_sum, kl_tokens = 0.0, 0
        loss = earlier
        for start in range(0, rows, per):
            part = range(start, min(rows, start + per))
            loss, kl = self._chunk_loss(*self._chunk(part, prompts, sampled, ids, attention, positions, answer),
                                        advantages[start:part.stop])
            if kl is not None:
                kl_sum, kl_tokens = kl_sum + kl[0], kl_tokens + kl[1]
            if part.stop < rows:
                if backward:
                    (loss / self.loss_divisor).backward()
                earlier = earlier + loss.detach()
        return loss + earlier, ((kl_sum, kl_tokens) if self.settings.beta > 0 else None)

    @staticmethod
    def _chunk(part: range, prompts: Sequence[Sequence[int]], sampled: Sampled, ids: torch.Tensor,
               attention: torch.Tensor, positions: torch.Tensor, answer: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows ``part`` of the scored pass's input (:meth:`_rows`), without the columns that are
        padding in all of them (the prompts' left, the completions' right): a chunk of short rows
        computes no more than it holds."""
        width = max(len(p) for p in prompts)
        prompt = max(len(prompts[r]) for r in part)
        completion = max(1, max(sampled.lengths[r] for r in part))
        rows, columns = slice(part.start, part.stop), slice(width - prompt, width + completion)
        return ids[rows, columns], attention[rows, columns], positions[rows, columns], answer[rows, :completion]

    def _chunk_loss(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, answer: torch.Tensor,
                    advantages: torch.Tensor) -> tuple[torch.Tensor, tuple[float, int] | None]:
        """Some completions' summed loss and, with ``beta`` > 0, their summed KL and token count."""
        beta = self.settings.beta
        reference = self._reference_logps(ids, attention, positions, answer) if beta > 0 else None
        logps = self._completion_logps(ids, attention, positions, answer)
        mask = answer.float()
        per_token = -torch.exp(logps - logps.detach()) * advantages.to(logps.device)[:, None]
        kl = None
        if reference is not None:
            delta = reference - logps
            divergence = torch.exp(delta) - delta - 1
            per_token = per_token + beta * divergence
            kl = (float((divergence.detach() * mask).sum()), int(mask.sum()))
        if self.settings.loss == "dr_grpo":
            loss = (per_token * mask).sum()
        else:
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
        return loss, kl

    def _record(self, examples: Sequence[PromptExample], sampled: Sampled, texts: list[str], totals: list[float],
                scores: list[rw.GroupScores], advantages: torch.Tensor, kl: tuple[float, int] | None) -> None:
        """Add a micro-batch to the step's metrics, and keep its last group for the group event."""
        s = self._sums
        g = len(totals) // max(1, len(examples))
        for result in scores:
            for name, values in result.scores.items():
                known = [v for v in values if v is not None]
                s.reward_sum[name] = s.reward_sum.get(name, 0.0) + sum(known)
                s.reward_count[name] = s.reward_count.get(name, 0) + len(known)
            s.spread += _std(result.totals)
            s.flat_groups += max(result.totals) - min(result.totals) < 1e-12
        s.total += sum(totals)
        s.groups += len(examples)
        s.completions += len(totals)
        s.length += sum(sampled.lengths)
        s.truncated += sum(1 for stopped in sampled.stopped if not stopped)
        if kl is not None:
            s.kl += kl[0]
            s.kl_tokens += kl[1]
        last = len(examples) - 1
        result = scores[last]
        completions = [{"text": text[:GROUP_TEXT_CHARS], "total": round(total, 6),
                        "scores": {name: values[j] for name, values in result.scores.items()},
                        "advantage": round(float(advantages[last * g + j]), 6),
                        "tokens": sampled.lengths[last * g + j], "stopped": sampled.stopped[last * g + j]}
                       for j, (text, total) in enumerate(zip(texts[last * g:], result.totals, strict=True))]
        self._group = ev.GrpoGroupSampled(step=self._step + 1, prompt=examples[last].text, completions=completions)

    def _report_graph_failure(self) -> None:
        """Once: a failed capture leaves sampling correct but slower, which the user should hear of."""
        why = self.sampler.graphs_failed
        if why and not self._graph_failure_reported:
            self._graph_failure_reported = True
            self.emit(ev.WarningRaised(kind="crash", detail=why, message=(
                "capturing GRPO's decode step as a CUDA graph failed; sampling goes on without it (same "
                "completions, slower). Please report it with the detail below")))

    # ------------------------------------------------------------------------------ metrics

    def sums(self) -> StepSums:
        """This rank's metrics of the current step (rank 0 merges every rank's: :meth:`logged`)."""
        return self._sums

    def logged(self, step: int, every_rank: Sequence[StepSums] | None = None, split: str = "train"
               ) -> list[ev.Event]:
        """The step's GrpoStepLogged (every rank's sums merged) and its newest group."""
        total = StepSums()
        for sums in every_rank or [self._sums]:
            total.merge(sums)
        event = step_event(total, step, split)
        return [event] + ([self._group] if self._group is not None and split == "train" else [])

    # ------------------------------------------------------------------------------ evaluation

    def complete(self, examples: Sequence[PromptExample], batch_rows: int, adapter: bool = True
                 ) -> list[tuple[str, Sampled, int]]:
        """One greedy completion per prompt (in batches of ``batch_rows``): (text, batch, row)."""
        out: list[tuple[str, Sampled, int]] = []
        for start in range(0, len(examples), max(1, batch_rows)):
            chunk = examples[start:start + batch_rows]
            sampled = self.sampler.sample([e.input_ids for e in chunk], list(range(len(chunk))), 0,
                                          self.settings.max_completion_length, 0.0, adapter=adapter)
            out.extend((text, sampled, r) for r, text in enumerate(self._texts(sampled)))
        return out

    def score_answers(self, examples: Sequence[PromptExample], texts: Sequence[str]
                      ) -> list[rw.GroupScores]:
        """Each prompt's one answer scored by every reward (a group of one)."""
        results = []
        for example, text in zip(examples, texts, strict=True):
            conversational = grpo_rows.conversation(example.row) is not None
            completion: Any = [{"role": "assistant", "content": text}] if conversational else text
            results.append(rw.score_group(self.rewards, example.prompt, [completion],
                                          grpo_rows.reward_columns(example.row), shown_prompt=example.text))
        return results

    def encode(self, rows: Sequence[dict[str, Any]]) -> list[PromptExample]:
        """Data rows as prompts (:func:`encode_prompts` with the run's renderer and tokenizer)."""
        return encode_prompts(rows, self.config, self.tokenizer, self.render, self.bos)

    def answer(self, row: dict[str, Any], adapter: bool = True) -> str:
        """The greedy completion of one data row's prompt, by the fine-tune or (``adapter`` False) the
        base through ``disable_adapter()`` (held-out scoring)."""
        return self.complete(self.encode([row]), 1, adapter=adapter)[0][0]

    def score_row(self, row: dict[str, Any], answer: str) -> tuple[dict[str, float | None], float]:
        """One answer to a data row's prompt, scored by every reward: (reward label -> score, total)."""
        if not self.rewards:
            self.load_rewards()
        result = self.score_answers(self.encode([row]), [answer])[0]
        return {name: values[0] for name, values in result.scores.items()}, result.totals[0]

    def evaluate(self, examples: Sequence[PromptExample], step: int, batch_prompts: int) -> ev.GrpoStepLogged:
        """The rewards of one greedy completion per held-out prompt (GrpoStepLogged, split validation)."""
        if not self.rewards:
            self.load_rewards()
        rows = max(1, batch_prompts * self.settings.num_generations)
        answers = self.complete(examples, rows)
        results = self.score_answers(examples, [text for text, _, _ in answers])
        sums = StepSums()
        for (_, sampled, r), result in zip(answers, results, strict=True):
            for name, values in result.scores.items():
                if values[0] is not None:
                    sums.reward_sum[name] = sums.reward_sum.get(name, 0.0) + values[0]
                    sums.reward_count[name] = sums.reward_count.get(name, 0) + 1
                else:
                    sums.reward_sum.setdefault(name, 0.0)
                    sums.reward_count.setdefault(name, 0)
            sums.total += result.totals[0]
            sums.groups += 1
            sums.completions += 1
            sums.length += sampled.lengths[r]
            sums.truncated += not sampled.stopped[r]
        return step_event(sums, step, "validation")


def _std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1), as torch.std and TRL take it; 0 for one value."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _advantages(totals: Sequence[float], group: int) -> torch.Tensor:
    """Each completion's total against its group: ``(r - mean) / (std + eps)``."""
    r = torch.tensor(totals, dtype=torch.float32).view(-1, group)
    spread = r.std(-1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])
    return ((r - r.mean(-1, keepdim=True)) / (spread + ADVANTAGE_EPS)).view(-1)
