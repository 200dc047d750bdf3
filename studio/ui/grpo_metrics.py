"""A GRPO run's events reduced to what the training pane draws: plain Python, testable without Textual.

:class:`GrpoCurves` folds GrpoStepLogged and GrpoGroupSampled events (studio/core/events.py): per
logged step each reward's mean, the total, its spread within groups, the completion length, the
share cut at the length limit and the KL, the held-out totals per evaluation, and every sampled group
the run logged, so the group view can go back through the run's history. Replaying ``events.jsonl``
and following the run live give the same curves (studio/ui/metrics.py's TrainingState holds one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from studio.core import events as ev
from studio.core.runs import report
from studio.ui.series import Series


@dataclass
class GrpoCurves:
    """A GRPO run's curves and groups (empty for other runs)."""

    rewards: dict[str, Series] = field(default_factory=dict)
    """Each reward's mean per logged step, by label, in the order the run names them."""
    total: Series = field(default_factory=Series)
    spread: Series = field(default_factory=Series)
    length: Series = field(default_factory=Series)
    truncated: Series = field(default_factory=Series)
    kl: Series = field(default_factory=Series)
    eval_total: Series = field(default_factory=Series)
    """The held-out prompts' mean total reward per evaluation (step 0: the base model)."""
    last: ev.GrpoStepLogged | None = None
    last_eval: ev.GrpoStepLogged | None = None
    groups: list[ev.GrpoGroupSampled] = field(default_factory=list)
    """Every group the run logged, oldest first (one a logged step)."""

    @property
    def active(self) -> bool:
        """Whether the run logged any GRPO metrics (it is a GRPO run)."""
        return self.last is not None or self.last_eval is not None or bool(self.groups)

    def add(self, event: ev.GrpoStepLogged) -> None:
        """Fold a step's (or an evaluation's) metrics in."""
        if event.split == "validation":
            self.last_eval = event
            self.eval_total.add(event.step, event.reward)
            return
        self.last = event
        for name, value in event.rewards.items():
            if value is not None:
                self.rewards.setdefault(name, Series()).add(event.step, value)
        self.total.add(event.step, event.reward)
        self.spread.add(event.step, event.reward_std)
        self.length.add(event.step, event.completion_length)
        self.truncated.add(event.step, event.truncated)
        if event.kl is not None:
            self.kl.add(event.step, event.kl)

    def add_group(self, event: ev.GrpoGroupSampled) -> None:
        """Keep a sampled group (a step logged again after a resume replaces the later ones)."""
        while self.groups and self.groups[-1].step >= event.step:
            self.groups.pop()
        self.groups.append(event)

    def truncate(self, after_step: float) -> None:
        """Drop what comes after ``after_step`` (a resumed run redoes those steps)."""
        for series in (*self.rewards.values(), self.total, self.spread, self.length, self.truncated, self.kl,
                       self.eval_total):
            series.truncate(after_step)
        while self.groups and self.groups[-1].step > after_step:
            self.groups.pop()

    def eval_line(self) -> str:
        """The newest evaluation's rewards (the newest step's before any evaluation)."""
        event = self.last_eval or self.last
        return report.grpo_line(event) if event is not None else ""
