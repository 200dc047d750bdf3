"""``studio eval RUN``: the base model's and the fine-tuned model's answers on held-out rows, scored.

One copy of the weights answers both ways (the base through peft's ``disable_adapter()``), greedy,
with the run's own prompt template. Scores are exact match and difflib similarity
(studio/core/scoring.py, shared with the chat pane). The results are printed as a table (or JSON)
and saved as ``runs/<id>/eval.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from studio.core.config import ConfigError, RunConfig
from studio.core.runs import RunDir, find_run
from studio.core.scoring import score, totals

EVAL_FILE = "eval.json"


@dataclass(frozen=True)
class RowResult:
    """One held-out row: its target and both answers with their scores."""

    index: int
    prompt: str
    target: str
    base: str
    tuned: str
    base_exact: bool
    tuned_exact: bool
    base_similarity: float
    tuned_similarity: float


def held_out_rows(config: RunConfig) -> tuple[str, list[dict]]:
    """The test split, or the validation split when there is no test split: (name, rows)."""
    from studio.core.data import load_splits

    splits = load_splits(config)
    if splits.test:
        return "test", list(splits.test)
    return "validation", list(splits.validation)


def evaluate_run(run: RunDir, rows: int = 50, progress: Any = None) -> dict[str, Any]:
    """Answer up to ``rows`` held-out rows with the base and the fine-tuned model; returns the report
    (also written to ``eval.json`` in the run)."""
    from studio.core import prompt as prompts
    from studio.engine import generate as gen
    from studio.engine.model import load_adapter, load_base

    config = run.config()
    adapter = run.adapter()
    if adapter is None:
        raise FileNotFoundError(f"{run.path}: no adapter yet; wait for training to finish, or stop it "
                                f"('studio stop {run.id}') to save one")
    split, held_out = held_out_rows(config)
    held_out = held_out[:rows]
    if not held_out:
        raise FileNotFoundError(f"{config.data.path}: no held-out rows (test or validation split) to "
                                "evaluate on; set data.val_fraction or mark rows with split 1 or 2")
    start = time.time()
    base = load_base(config)
    model = load_adapter(base, adapter)
    tokenizer = base.tokenizer
    template = prompts.resolve_template(config.prompt, getattr(tokenizer, "chat_template", None),
                                        bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    field = config.prompt.response_field
    max_new = config.generation.max_new_tokens
    results: list[RowResult] = []
    for index, row in enumerate(held_out):
        text = prompts.render(template, {**row, field: ""}, field).prompt
        ids = gen.prompt_ids(tokenizer, text)
        answers = {}
        for adapter in (False, True):
            answers[adapter] = gen.generate(model, tokenizer, ids, adapter=adapter, max_new_tokens=max_new,
                                            temperature=0.0, device=base.device,
                                            autocast_dtype=base.compute_dtype).text.strip()
        target = row.get(field, "")
        b, t = score(answers[False], target), score(answers[True], target)
        results.append(RowResult(index, text, target, answers[False], answers[True], b.exact, t.exact,
                                 round(b.similarity, 4), round(t.similarity, 4)))
        if progress is not None:
            progress(index + 1, len(held_out))
    base_totals = totals(score(r.base, r.target) for r in results)
    tuned_totals = totals(score(r.tuned, r.target) for r in results)
    report = {
        "run": run.id, "split": split, "rows": len(results), "seconds": round(time.time() - start, 1),
        "base": {"exact_match": base_totals.exact_match, "similarity": base_totals.similarity},
        "fine_tuned": {"exact_match": tuned_totals.exact_match, "similarity": tuned_totals.similarity},
        "results": [asdict(r) for r in results],
    }
    (run.path / EVAL_FILE).write_text(json.dumps(report, indent=1))
    return report


def _cell(text: str, width: int) -> str:
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= width else text[: width - 1] + "…"


def format_table(report: dict[str, Any], width: int = 28) -> str:
    """The report as a plain-text table: target, base answer, fine-tuned answer, marks."""
    # Answers start after a two-character mark column (a tick for an exact match).
    lines = [f"{'#':>3}  {'target':<{width}}  {'  base':<{width}}  {'  fine-tuned':<{width}}  sim b/t"]
    for r in report["results"]:
        base = ("✓ " if r["base_exact"] else "  ") + _cell(r["base"], width - 2)
        tuned = ("✓ " if r["tuned_exact"] else "  ") + _cell(r["tuned"], width - 2)
        lines.append(f"{r['index']:>3}  {_cell(r['target'], width):<{width}}  {base:<{width}}  "
                     f"{tuned:<{width}}  {r['base_similarity']:.2f}/{r['tuned_similarity']:.2f}")
    b, t = report["base"], report["fine_tuned"]
    lines.append("")
    lines.append(f"{report['rows']} {report['split']} rows   exact match: base {b['exact_match']:.1%} -> "
                 f"fine-tuned {t['exact_match']:.1%}   similarity: base {b['similarity']:.2f} -> "
                 f"fine-tuned {t['similarity']:.2f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``studio eval [RUN] [--rows N] [--json]``."""
    from studio.core.data import DataError

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\ranswering held-out rows: {done}/{total}")
            sys.stderr.flush()

    try:
        run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
        report = evaluate_run(run, rows=getattr(args, "rows", None) or 50, progress=progress)
    except (ConfigError, DataError, FileNotFoundError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        print(f"saved: {run.path / EVAL_FILE}")
    return 0
