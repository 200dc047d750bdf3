"""A GRPO prompt as the policy sees it: what the template pane shows for a ``trainer.method: grpo`` run.

The row rendered up to where the model starts writing (an instruction row through the template,
without the response; a conversation through the chat template with its generation prompt), a
marker where the completion begins, the token counts against the room ``data.max_seq_length``
leaves beside ``grpo.max_completion_length`` (a longer prompt loses its start, as training cuts it),
and the columns the reward functions receive with this row's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from textual.content import Content

from studio.core import prompt as prompts
from studio.core.config import RunConfig
from studio.core.grpo import rows as grpo_rows
from studio.core.prompt import chat as chats
from studio.core.runs.cells import cell
from studio.ui.widgets.token_counter import TokenCounter


def policy_text(template: str, row: dict[str, Any], config: RunConfig, counter: TokenCounter,
                turns: Sequence[chats.Turn] | None) -> str:
    """The prompt text the policy is given for ``row`` (``turns``: its conversation, if it is one)."""
    if turns is not None:
        renderer = chats.ChatRenderer(counter.chat_template or "", eos_token=counter.eos_token or "")
        return renderer.prompt(grpo_rows.prompt_turns(list(turns)))
    field = config.prompt.response_field
    fields = grpo_rows.template_row(row, config)
    return prompts.render(template, {**fields, field: ""}, field).prompt


def policy_preview(template: str, row: dict[str, Any], config: RunConfig, counter: TokenCounter,
                   turns: Sequence[chats.Turn] | None, conversation_column: str | None = None) -> Content:
    """The preview: counts, the prompt (its cut start struck through), the marker, the reward columns."""
    text = policy_text(template, row, config, counter, turns)
    g = config.grpo
    room = max(1, config.data.max_seq_length - g.max_completion_length)
    offsets = counter.offsets(text)
    tokens = (1 if counter.bos_id is not None else 0) + len(offsets)
    head = Content.from_markup(
        "[b]$line[/b]\n", line=(f"the policy reads {tokens:,} tokens (room {room:,}: data.max_seq_length "
                                f"{config.data.max_seq_length:,} less grpo.max_completion_length "
                                f"{g.max_completion_length:,}), then writes {g.num_generations} completions"))
    parts: list[Content] = [head]
    cut = 0
    if tokens > room:
        dropped = tokens - room
        cut = offsets[min(dropped, len(offsets) - 1)][0]
        parts.append(Content.styled(text[:cut], "$studio-truncated strike"))
        parts.append(Content.styled("✂", "bold $studio-truncated"))
    parts.append(Content.styled(text[cut:], "$studio-prompt"))
    parts.append(Content.styled(f"▌the policy writes from here (up to {g.max_completion_length} tokens)",
                                "bold reverse $studio-response"))
    skip = {conversation_column} if conversation_column else set()
    columns = {k: v for k, v in grpo_rows.reward_columns(row).items() if k not in skip}
    if columns:
        listed = "  ".join(f"{name}={cell(repr(value), 40)}" for name, value in columns.items())
        parts.append(Content.from_markup("\n\n[dim]the rewards also get:[/] $listed", listed=listed))
    return Content("").join(parts)
