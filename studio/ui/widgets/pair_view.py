"""A preference pair on screen: chosen and rejected side by side with their difference marked, and
both rendered through the template.

The dataset pane's row view shows :class:`PairView` under the row's fields; the template pane shows
:func:`pair_preview` (the chosen answer's training text, then the rejected one's). Chat-shaped rows
render as training renders them (studio/core/data/pairs.py): TRL's conversational pairs through
the chat template under the chat preset, flattened to text under a template of your own.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Static

from studio.core import prompt as prompts
from studio.core.config import RunConfig
from studio.core.data.pairs import Piece, conversation_pair, difference, flatten_pair, is_messages
from studio.core.data.shapes import TRL_PROMPT
from studio.core.prompt import chat as chats
from studio.ui.widgets.prompt_preview import measure, preview_content, untrained_note
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


def pair_texts(template: str, row: dict[str, Any], config: RunConfig, counter: TokenCounter) -> list[prompts.Rendered]:
    """A pair's two training texts as training renders them: TRL's conversational pairs under the
    chat preset through the chat template (loss on the answer's turns), others flattened and
    rendered through ``template`` with each answer in the response's place."""
    field, rejected = config.prompt.response_field, config.prompt.rejected_field
    prompt_column = config.data.columns.get(TRL_PROMPT, TRL_PROMPT)
    if config.prompt.template == "chat" and any(is_messages(row.get(k)) for k in (prompt_column, field, rejected)):
        pair = conversation_pair({**row, TRL_PROMPT: row.get(prompt_column)}, TRL_PROMPT, field, rejected)
        renderer = chats.ChatRenderer(counter.chat_template or "", eos_token=counter.eos_token or "")
        before = chats.parse_turns(pair[TRL_PROMPT])
        return [renderer.render(before + chats.parse_turns(pair[side]), train_from=len(before))
                for side in (field, rejected)]
    flat = pair_row(row, config, prompt_field(template, field))
    return [prompts.render(template, {**flat, field: flat.get(side)}, field) for side in (field, rejected)]


def prompt_field(template: str, response_field: str) -> str:
    """The template's first field that is not the answer's: where a flattened pair's prompt goes."""
    return next((f for f in prompts.template_fields(template) if f != response_field), "instruction")


def pair_preview(template: str, row: dict[str, Any], config: RunConfig, counter: TokenCounter) -> Content:
    """Both training texts of a pair: the row rendered with its chosen answer, then with its
    rejected one, each coloured as the template preview colours one (prompt, response, the cut),
    each marked when it trains on no token."""
    parts: list[Content] = []
    texts = pair_texts(template, row, config, counter)
    for (title, style), rendered in zip((("✓ chosen", "$success"), ("✗ rejected", "$error")), texts, strict=True):
        measured = measure(rendered, counter, config.data.max_seq_length, config.prompt.add_eos)
        parts.append(Content.styled(f"{title}\n", f"bold {style}"))
        note = untrained_note(measured)
        if note is not None:
            parts.append(note + "\n")
        parts.append(preview_content(measured, counter.eos_token))
        parts.append(Content("\n\n"))
    return Content("").join(parts[:-1])
