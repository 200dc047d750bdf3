"""One curve of the training pane: optimizer steps and values, kept in step order (a resumed run
replaces the steps it redoes). Every fold of events into curves (metrics.py, grpo_metrics.py) is
made of these."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Series:
    """One curve: x (optimizer steps) and y values, kept in step order."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, step: float, value: float) -> None:
        """Append a point; a point at or before the last step replaces the tail (a resumed run)."""
        while self.steps and self.steps[-1] >= step:
            self.steps.pop()
            self.values.pop()
        self.steps.append(step)
        self.values.append(value)

    def truncate(self, after_step: float) -> None:
        """Drop points past ``after_step`` (a run resumed from an earlier checkpoint redoes them)."""
        while self.steps and self.steps[-1] > after_step:
            self.steps.pop()
            self.values.pop()

    def __len__(self) -> int:
        return len(self.steps)

    def last(self) -> float | None:
        """The newest value, or None when empty."""
        return self.values[-1] if self.values else None
