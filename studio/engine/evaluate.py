"""Held-out comparison: the base model's and the fine-tune's answers on held-out rows, scored.

The one place that does it: the worker serves ``ScoreHeldOut`` with :class:`HeldOutScoring`, and
both ``studio eval`` and the chat pane's Held-out table send that command. The rows are the test
split, or the validation split when the data has no test split (the report says which). Answers are
greedy, from the worker's one copy of the weights (the base through peft's ``disable_adapter()``),
prompts rendered with the run's own template; scores are exact match and difflib similarity
(studio/core/runs/scoring.py). A conversation is judged on its last assistant turn, with every turn
before it as the prompt. Results go to ``RUN_DIR/eval.json`` (totals and every row) and
``RUN_DIR/eval.csv`` (one line a row).

No torch here: answers come from the loaded model through the ``generate`` callable the worker
passes (the Trainer's), so the worker's tests can drive this with a stand-in model.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from typing import Any

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.prompt import chat
from studio.core.runs import RunDir
from studio.core.runs.scoring import Score, score, totals

EVAL_FILE = "eval.json"
EVAL_CSV = "eval.csv"

Generate = Callable[[dict[str, str], bool, int | None], str]
"""``generate(row, adapter, max_new_tokens) -> answer``: one greedy answer from the loaded model."""

Margin = Callable[[dict[str, str], bool], float]
"""``margin(row, adapter) -> log p(chosen) - log p(rejected)``: a preference run's pair, by one model."""

Rewards = Callable[[dict, str], tuple[dict[str, float | None], float]]
"""``rewards(row, answer) -> (reward label -> score, total)``: a GRPO run's rewards of one answer."""


def held_out_rows(config: RunConfig) -> tuple[str, list[dict], RunConfig, str]:
    """The test split, or the validation split when there is no test split: (name, rows, the
    config adapted to the data's shape, the shape's kind; see studio/core/data/shapes.py)."""
    from studio.core.data import load_splits

    splits = load_splits(config)
    adapted, kind = splits.shape.adapt(config), splits.shape.kind
    if splits.test:
        return "test", list(splits.test), adapted, kind
    return "validation", list(splits.validation), adapted, kind


def prompt_and_target(row: dict, response_field: str, raw_text: bool = False) -> tuple[dict[str, str], str]:
    """A held-out row's prompt fields and target answer. A conversation's target is its last
    assistant turn and its prompt every turn before it (``messages`` and ``tools`` as JSON text); so
    is a conversational preference pair's, with its chosen answer as the last turns.
    Raw text (``raw_text``) is judged on continuing a document: its first half is the prompt, the
    rest (from a word's start) the target."""
    answer = row.get(response_field)
    if isinstance(answer, list) and not chat.is_chat_row(row):
        # A conversational preference pair: the prompt's turns, and the chosen answer's last turn.
        row = {chat.CHAT_FIELD: [*row.get("prompt", []), *answer], **{k: v for k, v in row.items()
                                                                       if k == chat.TOOLS_FIELD}}
    if chat.is_chat_row(row):
        before, answer = chat.split_last_answer(chat.messages_of(row))
        fields = {chat.CHAT_FIELD: json.dumps([t.as_message() for t in before], ensure_ascii=False)}
        tools = chat.tools_of(row)
        if tools:
            fields[chat.TOOLS_FIELD] = json.dumps(tools, ensure_ascii=False)
        return fields, answer
    if raw_text:
        text = str(row.get(response_field, ""))
        cut = text.rfind(" ", 0, len(text) // 2) + 1 or len(text) // 2
        return {response_field: text[:cut]}, text[cut:]
    return {k: str(v) for k, v in row.items() if k != response_field}, str(row.get(response_field, ""))


class HeldOutScoring:
    """One ScoreHeldOut request, answered a row at a time (:meth:`next_row`), so that the worker
    can serve training steps and chat requests in between.

    Raises DataError (from loading the data) or ValueError (no held-out rows) when built.
    """

    def __init__(self, run: RunDir, request: ev.ScoreHeldOut, generate: Generate,
                 emit: Callable[[ev.Event], object], render: Callable[[dict[str, str]], str] | None = None,
                 margin: Margin | None = None, rewards: Rewards | None = None):
        self.run, self.request, self.emit = run, request, emit
        self._generate, self._render, self._margin, self._rewards = generate, render, margin, rewards
        """A GRPO run (``rewards`` given): ``generate`` and ``render`` take the data row itself, and
        both answers are scored by the run's rewards; the target shown is the first reward's column."""
        self.split, rows, config, kind = held_out_rows(run.config())
        self.response_field = config.prompt.response_field
        self.rejected_field = config.prompt.rejected_field if margin is not None else None
        """Preference runs (``margin`` given): each row is also a pair, scored by both models' margin."""
        self.raw_text = kind == "text"
        self.target_column = next((r.column for r in config.grpo.rewards if r.column), None) if rewards else None
        self.rows = rows[:max(0, request.rows)]
        if not self.rows:
            raise ValueError(f"{config.data.path}: no held-out rows (test or validation split) to "
                             "score; set data.val_fraction, or mark rows with 2 (test) or 1 "
                             "(validation) in the data's split column")
        self.results: list[ev.HeldOutRowScored] = []
        self._start = time.monotonic()

    @property
    def done(self) -> bool:
        """Whether every row has been answered."""
        return len(self.results) >= len(self.rows)

    def next_row(self) -> bool:
        """Answer and score the next row (emits HeldOutRowScored); after the last, save the results
        and emit HeldOutFinished. Returns True once finished."""
        if self.done:
            return True
        index = len(self.results)
        row = self.rows[index]
        # The prompt never shows the rejected answer; the margin below needs the whole pair.
        fields, target = prompt_and_target({k: v for k, v in row.items() if k != self.rejected_field},
                                           self.response_field, self.raw_text)
        max_new = self.request.max_new_tokens
        source = row if self._rewards is not None else fields  # GRPO rows render from their columns
        if self._rewards is not None:
            target = str(row.get(self.target_column, "")) if self.target_column else ""
        base = self._generate(source, False, max_new).strip()
        tuned = self._generate(source, True, max_new).strip() if self.request.adapter else None
        b = score(base, target)
        t = score(tuned, target) if tuned is not None else None
        pair: dict[str, Any] = {}
        if self._margin is not None:
            pair = {"rejected": str(row.get(self.rejected_field, "")),
                    "base_margin": round(self._margin(row, False), 4),
                    "tuned_margin": round(self._margin(row, True), 4) if self.request.adapter else None}
        if self._rewards is not None:
            pair = {"base_rewards": self._scored(row, base),
                    "tuned_rewards": self._scored(row, tuned) if tuned is not None else None}
        result = ev.HeldOutRowScored(
            request_id=self.request.request_id, index=index, total=len(self.rows), split=self.split,
            fields=fields, prompt=self._render(source) if self._render else "", target=target,
            base=base, tuned=tuned, base_exact=b.exact, base_similarity=round(b.similarity, 4),
            tuned_exact=t.exact if t else None, tuned_similarity=round(t.similarity, 4) if t else None,
            **pair)
        self.results.append(result)
        self.emit(result)
        if self.done:
            self._finish()
        return self.done

    def _scored(self, row: dict, answer: str) -> dict[str, float | None]:
        assert self._rewards is not None
        scores, total = self._rewards(row, answer)
        return {**{k: (round(v, 6) if v is not None else None) for k, v in scores.items()}, "total": round(total, 6)}

    def report(self) -> dict[str, Any]:
        """Totals and rows, as saved in ``eval.json``."""
        base = totals(Score(r.base_exact, r.base_similarity) for r in self.results)
        tuned_scores = [Score(bool(r.tuned_exact), r.tuned_similarity or 0.0) for r in self.results
                        if r.tuned is not None]
        tuned = totals(tuned_scores) if tuned_scores else None
        preference = None
        if self.rejected_field is not None:
            preference = {"base_accuracy": _preferred(r.base_margin for r in self.results),
                          "fine_tuned_accuracy": _preferred(r.tuned_margin for r in self.results)}
        rewards = None
        if self._rewards is not None:
            rewards = {"base": _means(r.base_rewards for r in self.results),
                       "fine_tuned": _means(r.tuned_rewards for r in self.results) if self.request.adapter else None}
        return {
            "run": self.run.id, "split": self.split, "rows": len(self.results), "rewards": rewards,
            "seconds": round(time.monotonic() - self._start, 1),
            "base": {"exact_match": base.exact_match, "similarity": base.similarity},
            "fine_tuned": {"exact_match": tuned.exact_match, "similarity": tuned.similarity} if tuned else None,
            "preference": preference,
            "results": [{"index": r.index, "fields": r.fields, "prompt": r.prompt, "target": r.target,
                         "base": r.base, "tuned": r.tuned, "base_exact": r.base_exact,
                         "tuned_exact": r.tuned_exact, "base_similarity": r.base_similarity,
                         "tuned_similarity": r.tuned_similarity, "rejected": r.rejected,
                         "base_margin": r.base_margin, "tuned_margin": r.tuned_margin,
                         "base_rewards": r.base_rewards, "tuned_rewards": r.tuned_rewards} for r in self.results],
        }

    def _finish(self) -> None:
        report = self.report()
        path = self.run.path / EVAL_FILE
        path.write_text(json.dumps(report, indent=1) + "\n")
        self._write_csv()
        tuned = report["fine_tuned"] or {}
        preference = report["preference"] or {}
        self.emit(ev.HeldOutFinished(
            request_id=self.request.request_id, ok=True, split=self.split, rows=report["rows"],
            path=str(path), base_exact_match=report["base"]["exact_match"],
            base_similarity=report["base"]["similarity"], tuned_exact_match=tuned.get("exact_match"),
            tuned_similarity=tuned.get("similarity"), seconds=report["seconds"],
            base_preference_accuracy=preference.get("base_accuracy"),
            tuned_preference_accuracy=preference.get("fine_tuned_accuracy"),
            base_rewards=(report["rewards"] or {}).get("base"),
            tuned_rewards=(report["rewards"] or {}).get("fine_tuned")))

    def _write_csv(self) -> None:
        """One line a row: its prompt fields, the target, then each model's answer and scores."""
        records = []
        for r in self.results:
            record: dict[str, Any] = {**r.fields, "target": r.target}
            record.update(base_answer=r.base, base_exact=r.base_exact, base_similarity=r.base_similarity,
                          tuned_answer=r.tuned, tuned_exact=r.tuned_exact, tuned_similarity=r.tuned_similarity)
            if self.rejected_field is not None:
                record.update(rejected=r.rejected, base_margin=r.base_margin, tuned_margin=r.tuned_margin)
            if r.base_rewards is not None:
                record.update({f"base_{k}": v for k, v in r.base_rewards.items()})
                record.update({f"tuned_{k}": v for k, v in (r.tuned_rewards or {}).items()})
            records.append(record)
        with open(self.run.path / EVAL_CSV, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)


def _means(rows: Any) -> dict[str, float | None]:
    """Each reward's mean over the rows' scores (None where it applied to none of them)."""
    sums: dict[str, list[float]] = {}
    for scores in rows:
        for name, value in (scores or {}).items():
            sums.setdefault(name, [])
            if value is not None:
                sums[name].append(value)
    return {name: round(sum(v) / len(v), 6) if v else None for name, v in sums.items()}


def _preferred(margins: Any) -> float | None:
    """The fraction of margins above 0 (pairs whose chosen answer the model prefers); None if none."""
    known = [m for m in margins if m is not None]
    return sum(1 for m in known if m > 0) / len(known) if known else None
