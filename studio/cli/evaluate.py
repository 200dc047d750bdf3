"""``studio eval [RUN]``: base vs fine-tuned answers on held-out rows, scored by the run's worker.

A client of the worker like every front end: it connects to the run's worker (starting one, under
the device lock, when none runs), sends ``ScoreHeldOut`` and prints the per-row progress the worker
streams, then the table (or the JSON report). The worker writes ``eval.json`` and ``eval.csv`` in
the run directory (studio/engine/evaluate.py). A worker this command started is shut down at the
end; a running one (training, or up for chat) is left as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from studio.core import events as ev
from studio.core.runs import RunDir, find_run
from studio.core.runs.cells import cell
from studio.worker.client import WorkerClient, WorkerStartError, WorkerUnavailable, connect_or_start
from studio.worker.launch import GpuLock


def format_table(report: dict[str, Any], width: int = 28) -> str:
    """The report as a plain-text table: target, base answer, fine-tuned answer, marks (a GRPO run:
    :func:`rewards_table`)."""
    if report.get("rewards"):
        return rewards_table(report, width)
    # Answers start after a two-character mark column (a tick for an exact match).
    lines = [f"{'#':>3}  {'target':<{width}}  {'  base':<{width}}  {'  fine-tuned':<{width}}  sim b/t"]
    for r in report["results"]:
        base = ("✓ " if r["base_exact"] else "  ") + cell(r["base"], width - 2)
        tuned = ("✓ " if r["tuned_exact"] else "  ") + cell(r["tuned"], width - 2)
        tuned_sim = f"{r['tuned_similarity']:.2f}" if r["tuned_similarity"] is not None else "-"
        lines.append(f"{r['index']:>3}  {cell(r['target'], width):<{width}}  {base:<{width}}  "
                     f"{tuned:<{width}}  {r['base_similarity']:.2f}/{tuned_sim}")
    b, t = report["base"], report["fine_tuned"] or {"exact_match": 0.0, "similarity": 0.0}
    lines.append("")
    lines.append(f"{report['rows']} {report['split']} rows   exact match: base {b['exact_match']:.1%} -> "
                 f"fine-tuned {t['exact_match']:.1%}   similarity: base {b['similarity']:.2f} -> "
                 f"fine-tuned {t['similarity']:.2f}")
    preference = report.get("preference")
    if preference:
        lines.append(_preference_table(report["results"], preference, report["split"]))
    return "\n".join(lines)


def rewards_table(report: dict[str, Any], width: int = 28) -> str:
    """A GRPO run's held-out prompts: each model's answer with its total reward, then each reward's
    mean, base -> fine-tuned."""
    lines = [f"{'#':>3}  {'prompt':<{width}}  {'base':<{width}}  {'reward':>6}  {'fine-tuned':<{width}}  "
             f"{'reward':>6}"]
    prompts = _varying([r.get("prompt") or _fields_text(r["fields"]) for r in report["results"]])
    for r, prompt in zip(report["results"], prompts, strict=True):
        base, tuned = r.get("base_rewards") or {}, r.get("tuned_rewards") or {}
        lines.append(f"{r['index']:>3}  {cell(prompt, width):<{width}}  "
                     f"{cell(r['base'], width):<{width}}  {_reward(base.get('total')):>6}  "
                     f"{cell(r['tuned'], width):<{width}}  {_reward(tuned.get('total')):>6}")
    rewards = report["rewards"]
    base, tuned = rewards["base"], rewards.get("fine_tuned") or {}
    lines.append("")
    lines.append(f"{report['rows']} {report['split']} prompts, mean reward base -> fine-tuned:")
    for name in base:
        lines.append(f"  {name:<24} {_reward(base[name]):>8} -> {_reward(tuned.get(name))}")
    return "\n".join(lines)


def _reward(value: float | None) -> str:
    """A reward as a table shows it; ``-`` where it did not apply."""
    return "-" if value is None else f"{value:.3f}"


def _varying(texts: list[str]) -> list[str]:
    """Each text without what every one of them starts and ends with (a template's scaffolding),
    so a narrow column shows what differs; several texts only, and never down to nothing."""
    if len(texts) < 2:
        return texts
    head = len(os.path.commonprefix(texts))
    tail = len(os.path.commonprefix([t[head:][::-1] for t in texts]))
    cut = [t[head:len(t) - tail] for t in texts]
    return cut if all(c.strip() for c in cut) else texts


def _fields_text(fields: dict[str, str]) -> str:
    return " ".join(str(v) for v in fields.values())


def _preference_table(results: list[dict[str, Any]], preference: dict[str, Any], split: str) -> str:
    """A preference run's pairs: chosen, rejected, and each model's log-prob margin (+ prefers chosen),
    then the held-out preference accuracy of each model (its raw log-probs, no reference)."""
    lines = ["", f"{'#':>3}  {'chosen':<24}  {'rejected':<24}  margin base -> fine-tuned"]
    for r in results:
        tuned = f"{r['tuned_margin']:+.2f}" if r.get("tuned_margin") is not None else "-"
        lines.append(f"{r['index']:>3}  {cell(r['target'], 24):<24}  {cell(r.get('rejected') or '', 24):<24}  "
                     f"{r['base_margin']:+.2f} -> {tuned}")
    tuned = preference.get("fine_tuned_accuracy")
    lines.append(f"held-out accuracy ({len(results)} {split} pairs), prefers the chosen answer: base "
                 f"{preference['base_accuracy']:.1%} -> fine-tuned " + (f"{tuned:.1%}" if tuned is not None else "-"))
    return "\n".join(lines)


RowScored = Callable[[ev.HeldOutRowScored], None]
"""Told of each held-out row as the worker answers it (a progress line, a progress notification)."""


class EvalFailed(Exception):
    """Held-out scoring that could not be done; the message is the one line a person reads."""


class EvalInterrupted(Exception):
    """Ctrl-C while the worker scores: it finishes the rows and saves them anyway."""


def _score(client: WorkerClient, rows: int, on_row: RowScored | None) -> ev.HeldOutFinished:
    """Send ScoreHeldOut and follow the worker until its answer."""
    request = f"eval-{time.time_ns()}"
    client.send(ev.ScoreHeldOut(request_id=request, rows=rows))
    while True:
        for event in client.poll(0.5):
            if isinstance(event, ev.HeldOutRowScored) and event.request_id == request and on_row is not None:
                on_row(event)
            elif isinstance(event, ev.HeldOutFinished) and event.request_id == request:
                return event
            elif isinstance(event, ev.WorkerFailed) and event.fatal:
                print(f"error ({event.kind}): {event.message}", file=sys.stderr)
            elif isinstance(event, ev.WorkerStopped):
                return ev.HeldOutFinished(request_id=request, ok=False,
                                          message=f"the worker stopped ({event.reason}) before answering")
        if not client.connected and client.run.worker_pid() is None:
            return ev.HeldOutFinished(request_id=request, ok=False, message=(
                f"the worker of run {client.run.id} went away; see {client.run.log_path}"))


def evaluate_run(run: RunDir, rows: int = 50, on_row: RowScored | None = None) -> tuple[dict[str, Any], Path]:
    """Base vs fine-tuned answers on up to ``rows`` held-out rows of ``run``, scored by its worker
    (started for this and shut down afterwards when none runs; a running one is left as it was).
    Returns the report (``eval.json``'s contents) and the path of ``eval.json``. Raises EvalFailed,
    or EvalInterrupted on Ctrl-C once the rows were asked for."""
    if run.adapter() is None and run.latest_checkpoint() is None:
        raise EvalFailed(f"{run.path}: no adapter yet; wait for training to finish, or stop it "
                         f"('studio stop {run.ref}') to save one")
    started_here = run.worker_pid() is None
    try:
        client = connect_or_start(run, timeout=60)
    except (WorkerStartError, WorkerUnavailable) as exc:
        raise EvalFailed(str(exc)) from None
    try:
        client.catch_up()  # the run's past events: only this request's answers matter below
        finished = _score(client, rows, on_row)
        if started_here:
            _shut_down(client)
    except KeyboardInterrupt:
        raise EvalInterrupted(f"interrupted; the worker finishes the rows and saves {run.path / 'eval.json'}") \
            from None
    finally:
        client.close()
    if not finished.ok:
        raise EvalFailed(finished.message)
    return json.loads(Path(finished.path).read_text()), Path(finished.path)


def _progress_line(event: ev.HeldOutRowScored) -> None:
    sys.stderr.write(f"\ranswering held-out rows: {event.index + 1}/{event.total}")
    sys.stderr.flush()


def _clear_progress(tty: bool) -> None:
    if tty:
        sys.stderr.write("\r\033[K")


def main(args: argparse.Namespace) -> int:
    """``studio eval [RUN] [--rows N] [--json]``."""
    run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
    tty = sys.stderr.isatty()
    try:
        report, path = evaluate_run(run, getattr(args, "rows", None) or 50, _progress_line if tty else None)
    except EvalInterrupted as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 130
    except EvalFailed as exc:
        _clear_progress(tty)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _clear_progress(tty)
    if getattr(args, "json", False):
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        print(f"saved: {path} and {path.with_suffix('.csv').name}")
    return 0


def _shut_down(client: WorkerClient, timeout: float = 30.0) -> None:
    """Shut down the worker this command started, and wait until it has let the device go (the
    next command, or the next test, may want it at once)."""
    pid = client.run.worker_pid()
    try:
        client.send(ev.Shutdown())
    except WorkerUnavailable:
        return
    deadline = time.monotonic() + timeout
    while client.connected and time.monotonic() < deadline:
        if any(isinstance(e, ev.WorkerStopped) for e in client.poll(0.2)):
            break
    lock = GpuLock()
    while lock.busy() and lock.holder().get("pid") == pid and time.monotonic() < deadline:
        time.sleep(0.05)
