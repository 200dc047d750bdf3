"""A preference pair on screen: chosen and rejected side by side with their difference marked, and
both rendered through the template.

The dataset pane's row view shows :class:`PairView` under the row's fields; the template pane shows
:func:`pair_preview` (the chosen answer's training text, then the rejected one's). Chat-shaped rows
are flattened first (studio/core/preference.py), as training reads them.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Static

from studio.core import prompt as prompts
from studio.core.config import RunConfig
from studio.core.preference import Piece, difference, flatten_pair
from studio.ui.widgets.prompt_preview import measure, preview_content
from studio.ui.widgets.token_counter import TokenCounter


def pair_row(row: dict[str, Any], config: RunConfig, prompt_field: str) -> dict[str, Any]:
    """A raw dataset row as template fields (``data.columns`` applied) with a chat-shaped pair
    flattened; text answers as they are."""
    out = dict(row)
    for name in (prompt_field, config.prompt.response_field, config.prompt.rejected_field):
        column = config.data.columns.get(name, name)
        if column in row:
            out[name] = row[column]
    return flatten_pair(out, prompt_field, config.prompt.response_field, config.prompt.rejected_field)


def _marked(title: str, style: str, pieces: list[Piece]) -> Content:
    parts = [Content.styled(title + "\n", f"bold {style}")]
    parts += [Content.styled(p.text, f"reverse {style}") if p.changed else Content(p.text) for p in pieces]
    if not pieces:
        parts.append(Content.styled("(empty)", "italic"))
    return Content("").join(parts)


class PairView(Horizontal):
    """Two columns: the chosen and the rejected answer; the words where they differ in reverse."""

    DEFAULT_CSS = """
    PairView { height: auto; margin-top: 1; display: none; }
    PairView > Static { width: 1fr; height: auto; padding-right: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static("", classes="pair-chosen")
        yield Static("", classes="pair-rejected")

    def show(self, chosen: str, rejected: str, names: tuple[str, str] = ("chosen", "rejected")) -> None:
        """Show one pair."""
        left, right = difference(chosen, rejected)
        self.query_one(".pair-chosen", Static).update(_marked(f"✓ {names[0]}", "$success", left))
        self.query_one(".pair-rejected", Static).update(_marked(f"✗ {names[1]}", "$error", right))


def pair_preview(template: str, row: dict[str, Any], config: RunConfig, counter: TokenCounter) -> Content:
    """Both training texts of a pair: the row rendered with its chosen answer, then with its
    rejected one, each coloured as the template preview colours one (prompt, response, the cut)."""
    field, rejected = config.prompt.response_field, config.prompt.rejected_field
    parts: list[Content] = []
    for title, style, answer in (("✓ chosen", "$success", row.get(field)),
                                 ("✗ rejected", "$error", row.get(rejected))):
        rendered = prompts.render(template, {**row, field: answer}, field)
        measured = measure(rendered, counter, config.data.max_seq_length, config.prompt.add_eos)
        parts.append(Content.styled(f"{title}\n", f"bold {style}"))
        parts.append(preview_content(measured, counter.eos_token))
        parts.append(Content("\n\n"))
    return Content("").join(parts[:-1])
