"""A stand-in for studio.engine.session.Session (what the worker drives), so the worker's machinery
(detach, lock, socket, commands, event log) is tested in seconds without torch. The worker loads it when
$STUDIO_WORKER_TRAINER is "helpers.worker_fakes:FakeTrainer" (with tests/ on PYTHONPATH).

It implements the worker's EngineSession (studio/worker/engine_session.py), as the engine's Session
does: load(), train(resume), generate(...), evaluate(), ..., and calls between_steps after every step
("stop" = checkpoint + TrainingFinished(stopped)).
Knobs: $FAKE_STEP_S (seconds a step), $FAKE_FAIL_AT_STEP (raise there), $FAKE_CHECKPOINT_EVERY.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir
from studio.worker.engine_session import BetweenSteps


def fake_loss(step: int) -> float:
    """The loss the fake reports at ``step``: decreasing, and a pure function of the step, so a
    resumed run's curve can be compared with an uninterrupted one."""
    return round(3.0 / (1.0 + 0.1 * step), 6)


@dataclass
class FakeAnswer:
    text: str
    new_tokens: int
    tokens_per_s: float


class FakeTrainer:
    """Trains nothing; reports steps, checkpoints and answers as the engine's Session does."""

    preference = None
    """An SFT run: no preference pairs to score."""

    grpo = None
    """Nor a GRPO run: no rewards to score answers with."""

    def __init__(self, config: RunConfig, run: RunDir, emit: Callable[[ev.Event], object],
                 between_steps: BetweenSteps | None = None):
        self.config, self.run, self.emit, self.between_steps = config, run, emit, between_steps
        self.step = 0
        self.step_s = float(os.environ.get("FAKE_STEP_S", "0.05"))
        self.fail_at = int(os.environ.get("FAKE_FAIL_AT_STEP", "0"))
        self.checkpoint_every = int(os.environ.get("FAKE_CHECKPOINT_EVERY", "5"))

    def load(self) -> None:
        if self.config.model.base_model == "no-such-model":
            raise OSError("no-such-model: not a local folder and not on the hub; check model.base_model")
        self.emit(ev.ModelLoading(stage="weights", fraction=1.0))
        self.emit(ev.ModelLoaded(base_model=self.config.model.base_model))

    def load_trained_adapter(self) -> None:
        """Nothing to load: the fake's answers depend only on ``adapter`` and the step."""

    def keep_alive(self) -> None:
        """One process: no other rank waits while paused."""

    def render_prompt(self, prompt: str | dict) -> str:
        """A row's instruction and input (or the message itself), one a line."""
        if isinstance(prompt, str):
            return prompt
        return "\n".join(str(prompt[key]) for key in ("instruction", "input") if prompt.get(key))

    def _save(self, step: int) -> Path:
        path = self.run.checkpoints_dir / f"step-{step}"
        tmp = self.run.checkpoints_dir / f".tmp-step-{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:  # atomic, as the engine's: a full disk half way leaves no checkpoint that does not load
            tmp.mkdir(parents=True)
            (tmp / "state.json").write_text(json.dumps({"step": step}))
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        self.emit(ev.CheckpointSaved(step=step, path=str(path)))
        return path

    def train(self, resume: bool = False) -> None:
        total = self.config.trainer.max_steps or 10
        latest = self.run.latest_checkpoint() if resume else None
        self.step = json.loads((latest / "state.json").read_text())["step"] if latest else 0
        self.emit(ev.RunStarted(run_id=self.run.id, total_steps=total, resumed_from_step=self.step))
        while self.step < total:
            time.sleep(self.step_s)
            if self.step + 1 == self.fail_at:
                raise RuntimeError(f"fake failure at step {self.fail_at}")
            self.step += 1
            self.emit(ev.StepLogged(step=self.step, total_steps=total, loss=fake_loss(self.step)))
            if self.step % self.checkpoint_every == 0:
                self._save(self.step)
            if self.between_steps is not None and self.between_steps(self) == "stop":
                self._finish(stopped=True)
                return
        self._finish(stopped=False)

    def _finish(self, stopped: bool) -> None:
        self._save(self.step)
        self.run.adapter_dir.mkdir(exist_ok=True)
        (self.run.adapter_dir / "adapter_config.json").write_text(json.dumps({"step": self.step}))
        self.emit(ev.TrainingFinished(step=self.step, stopped=stopped, adapter_path=str(self.run.adapter_dir),
                                      train_loss=fake_loss(self.step)))

    def generate(self, prompt: str | dict, adapter: bool = True, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 on_text: Callable[[str], None] | None = None) -> FakeAnswer:
        if isinstance(prompt, dict):
            # A dataset row (held-out scoring): the "fine-tune" reverses the input, the base echoes it.
            word = str(prompt.get("input", ""))
            text = word[::-1] if adapter else word
        else:
            text = f"{'adapter' if adapter else 'base'}@{self.step}:{prompt[::-1]}"
        for piece in (text[i:i + 4] for i in range(0, len(text), 4)):
            if on_text is not None:
                on_text(piece)
        return FakeAnswer(text=text, new_tokens=len(text), tokens_per_s=100.0)

    def evaluate(self) -> ev.EvalLogged:
        return ev.EvalLogged(step=self.step, loss=fake_loss(self.step) + 0.1, rows=3)
