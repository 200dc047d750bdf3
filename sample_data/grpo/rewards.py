"""Reward functions for sample_data/grpo/grpo_config.yaml, in TRL's signature.

Each takes the completions (and whatever columns of the data row it names; the rest arrive in
``**kwargs``) and returns one number per completion. They run in Studio's worker, like any reward
you write (docs/grpo.md).
"""

from __future__ import annotations


def letters_right(completions: list[str], word: list[str], **kwargs) -> list[float]:
    """The fraction of the word's letters the completion has in their place (dashes between them):
    partial credit, so that a group whose completions are all wrong still ranks them."""
    scores = []
    for completion, answer in zip(completions, word, strict=True):
        got, want = completion.strip().split("-"), answer.split("-")
        right = sum(1 for a, b in zip(got, want, strict=False) if a == b)
        scores.append(right / max(len(got), len(want)))
    return scores
