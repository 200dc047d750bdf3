"""What a template renders: the text, where the response starts, and where each field landed.

One :class:`Rendered` drives both the preview (its spans) and the loss (its response, or a
conversation's loss spans); every renderer in this package (``template``, ``chat``) returns one, and
``labels`` encodes it. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass


class TemplateError(ValueError):
    """A template that cannot be used (an unknown preset, a chat template that fails to render)."""


@dataclass(frozen=True)
class Span:
    """Where one field's text sits in the rendered text (character offsets, end exclusive)."""

    field: str
    start: int
    end: int


@dataclass(frozen=True)
class Rendered:
    """A row rendered through a template."""

    text: str
    """The full training text: prompt then response."""

    response_start: int
    """Character offset where the response begins; loss is computed from here to the end."""

    spans: tuple[Span, ...] = ()
    """Where each field's text landed, for colouring the preview."""

    template: str = ""
    """The literal template actually used (the no-input variant on rows without input); ``chat`` for
    a conversation rendered by :class:`studio.core.prompt.chat.ChatRenderer`."""

    loss_spans: tuple[tuple[int, int], ...] = ()
    """A conversation's assistant turns (character offsets, end exclusive): loss is taken on these
    only. Empty for a single-turn row, whose response runs from ``response_start`` to the end."""

    @property
    def prompt(self) -> str:
        """The part the model is given."""
        return self.text[: self.response_start]

    @property
    def response(self) -> str:
        """The part the model learns to produce."""
        return self.text[self.response_start:]
