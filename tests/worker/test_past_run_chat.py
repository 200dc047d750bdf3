"""Chat with a past run: a worker started later for a trained run answers with the trained adapter,
not with a fresh (untrained) LoRA."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers.worker import wait_for

from studio.core import events as ev
from studio.core.runs import RunDir, create_run
from studio.engine.session import Session
from studio.worker.client import WorkerClient, start_worker

ROW = {"instruction": "Reverse the letters of the word.", "input": "s-t-o-n-e"}


def _answers(session: Session) -> dict[bool, str]:
    return {adapter: session.generate(ROW, adapter=adapter).text for adapter in (True, False)}


@pytest.fixture
def trained_run(tiny_config, tmp_path: Path) -> tuple[RunDir, dict[bool, str], float]:
    """A run trained in-process (30 steps, greedy answers), its answers with and without the adapter,
    and its first step's loss."""
    from studio.engine.tiny import reverse_word_rows

    rows = tmp_path / "reverse.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in reverse_word_rows(400, seed=0)))
    tiny_config.data.path = str(rows)
    tiny_config.trainer.max_steps = 30
    tiny_config.trainer.eval_interval = 0
    tiny_config.generation.temperature = 0.0
    run = create_run(tiny_config, tmp_path / "runs")
    losses: list[float] = []
    session = Session(tiny_config, run, lambda e: losses.append(e.loss) if isinstance(e, ev.StepLogged) else None)
    # As a worker writes a run (umask 077): files this in-process training makes are private too,
    # so the worker below has no loose modes to tighten (and no note to log about them).
    previous = os.umask(0o077)
    try:
        session.train()
    finally:
        os.umask(previous)
    answers = _answers(session)
    assert answers[True] != answers[False], "30 steps must move the adapter's answer"
    return run, answers, losses[0]


def test_new_worker_for_a_past_run_answers_with_its_trained_adapter(
        trained_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, before, _ = trained_run
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "5")
    start_worker(run)  # neither --train nor --resume: a worker for chat
    client = WorkerClient(run)
    try:
        client.connect(timeout=30)
        client.send(ev.LoadModel())
        for adapter in (True, False):
            client.send(ev.Generate(request_id=f"adapter-{adapter}", row=ROW, adapter=adapter))
        answers: dict[bool, str] = {}
        while len(answers) < 2:
            done = wait_for(client, lambda e: isinstance(e, ev.GenerationFinished), timeout=120)
            answers[done.adapter] = done.text
        client.send(ev.Shutdown())
    finally:
        client.close()
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)
    assert answers == before
    assert not any(isinstance(e, ev.WorkerFailed) for e in run.events())


def test_checkpoint_stands_in_for_a_missing_adapter_and_fresh_training_starts_untrained(
        trained_run) -> None:
    run, before, first_loss = trained_run
    shutil.rmtree(run.adapter_dir)  # killed before the end: only checkpoints/step-30 is left
    losses: list[float] = []
    session = Session(run.config(), run, lambda e: losses.append(e.loss) if isinstance(e, ev.StepLogged) else None,
                      between_steps=lambda t: "stop")
    assert session.load_trained_adapter() == run.checkpoints_dir / "step-30" / "adapter"
    assert _answers(session) == before

    # Training from scratch after chatting starts from the fresh LoRA: step 1's loss is the
    # untrained model's, as in the first run, not the trained adapter's much lower one.
    session.train(resume=False)
    assert losses[0] == pytest.approx(first_loss, rel=1e-4)
