"""What the worker asks of the engine: the one interface between studio/worker and studio/engine.

The engine's :class:`studio.engine.session.Session` implements it; so does the torch-free stand-in
the tests drive the worker with (tests/helpers/worker_fakes.py), which is why it is written down here as a
Protocol rather than read off the engine's class.

Plain Python: the worker imports this before the engine (and torch) is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir


class Answer(Protocol):
    """A finished answer to a prompt."""

    @property
    def text(self) -> str:
        """The answer's text."""
        ...

    @property
    def new_tokens(self) -> int:
        """Tokens generated."""
        ...

    @property
    def tokens_per_s(self) -> float:
        """Generation speed."""
        ...


class PreferenceMargin(Protocol):
    """A preference run's (DPO / ORPO) pair scorer."""

    def margin(self, row: dict, adapter: bool) -> float:
        """``log p(chosen) - log p(rejected)`` for ``row``, by the fine-tune or (``adapter`` False)
        the base model."""
        ...


class StepHook(Protocol):
    """The trainer, as the worker's between-steps hook sees it."""

    def keep_alive(self) -> None:
        """While training is paused: tell a data-parallel run's other ranks to keep waiting (on one
        GPU there is nobody to tell)."""
        ...


BetweenSteps = Callable[[StepHook], "str | None"]
"""The worker's hook after every optimizer step; ``"stop"`` ends the training with a checkpoint."""


class EngineSession(Protocol):
    """One run's model, loaded once and then trained, asked and evaluated by the worker's control
    thread. A failure it has already reported as a WorkerFailed is raised as
    :class:`~studio.core.events.ReportedFailure`."""

    @property
    def preference(self) -> PreferenceMargin | None:
        """A preference run's pair scorer; None for SFT."""
        ...

    def load(self) -> None:
        """Load the model and the data."""
        ...

    def load_trained_adapter(self) -> object:
        """Put the run's trained adapter (if it has one) into the model: answers come from the
        fine-tune (chat with a past run)."""
        ...

    def train(self, resume: bool = False) -> object:
        """Train to the end, or until the between-steps hook says ``"stop"``; ``resume`` continues
        from the latest checkpoint."""
        ...

    def evaluate(self) -> object:
        """The validation loss now (an EvalLogged event, emitted)."""
        ...

    def render_prompt(self, prompt: str | dict) -> str:
        """The text the model is given for ``prompt`` (a dataset row or a plain message)."""
        ...

    def generate(self, prompt: str | dict, adapter: bool = True, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 on_text: Callable[[str], None] | None = None) -> Answer:
        """Answer ``prompt`` with the fine-tune (or the base model), streaming text to ``on_text``."""
        ...


class SessionFactory(Protocol):
    """How the worker makes its session (the engine's Session class, or a test's stand-in)."""

    def __call__(self, config: RunConfig, run: RunDir, emit: Callable[[ev.Event], object],
                 between_steps: BetweenSteps | None = None) -> EngineSession:
        """A session of ``config`` for ``run``, reporting through ``emit``."""
        ...
