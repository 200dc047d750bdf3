"""What a GRPO step (or an evaluation of the policy) tallies over its micro-batches and ranks, and the
event its means make (engine/grpo.py fills the sums in; plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from studio.core import events as ev


@dataclass
class StepSums:
    """A step's (or an evaluation's) metrics, summed; :func:`step_event` averages them."""

    reward_sum: dict[str, float] = field(default_factory=dict)
    reward_count: dict[str, int] = field(default_factory=dict)
    total: float = 0.0
    spread: float = 0.0
    flat_groups: int = 0
    groups: int = 0
    completions: int = 0
    length: int = 0
    truncated: int = 0
    kl: float = 0.0
    kl_tokens: int = 0

    def merge(self, other: StepSums) -> None:
        """Add another rank's sums."""
        for name, value in other.reward_sum.items():
            self.reward_sum[name] = self.reward_sum.get(name, 0.0) + value
            self.reward_count[name] = self.reward_count.get(name, 0) + other.reward_count.get(name, 0)
        for name in ("total", "spread", "flat_groups", "groups", "completions", "length", "truncated", "kl",
                     "kl_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def step_event(s: StepSums, step: int, split: str) -> ev.GrpoStepLogged:
    """The means of ``s`` as the event a step (``split`` "train") or an evaluation logs."""
    n = max(1, s.completions)
    rewards = {name: (s.reward_sum[name] / s.reward_count[name] if s.reward_count.get(name) else None)
               for name in s.reward_sum}
    return ev.GrpoStepLogged(
        step=step, split=split, rewards=rewards, reward=s.total / n,
        reward_std=s.spread / max(1, s.groups) if split == "train" else 0.0,
        zero_spread=s.flat_groups / max(1, s.groups) if split == "train" else 0.0,
        completion_length=s.length / n, truncated=s.truncated / n,
        kl=s.kl / s.kl_tokens if s.kl_tokens else None, completions=s.completions, prompts=s.groups)
