"""GRPO's data: prompts to sample completions for, and the columns the rewards read.

A GRPO row has no answer to learn: the model writes its own completions and the rewards judge them.
Two shapes are read (docs/grpo.md):

- **instruction rows**: the prompt template's fields (any columns), rendered up to where the
  response would start; the template needs no response placeholder (a template with one is cut there);
- **conversations**: a column of ``{role, content}`` messages (TRL's conversational ``prompt``, or
  ``messages`` / ShareGPT ``conversations``) whose last turn is the user's, rendered with the
  model's chat template and its generation prompt (``prompt.template: chat``). A conversation that
  ends with an assistant turn is prompted with the turns before it.

Every other column of the row reaches the reward functions as a keyword argument, with its value
as the data holds it (a number stays a number), as TRL passes them.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from studio.core.data.fields import as_text, field_columns, template_fields_for
from studio.core.prompt import chat as chats

if TYPE_CHECKING:
    from studio.core.config import RunConfig

METHOD = "grpo"
"""The ``trainer.method`` of a GRPO run."""

NOT_COLUMNS = (chats.CHAT_FIELD, "prompt", "completion", "completion_ids")
"""Row keys never passed to rewards as columns: the prompt itself (TRL passes it as ``prompts``)
and the names TRL reserves for its own arguments."""


def is_grpo(config: RunConfig) -> bool:
    """Whether ``config`` trains with GRPO."""
    return config.trainer.method == METHOD


def table_rows(dataset: Any, config: RunConfig, source: str, chat: tuple[str, str] | None) -> list[dict[str, Any]]:
    """Every row of ``dataset`` as a GRPO row: its columns as the data holds them, plus for a
    conversation its turns under ``messages`` (the conversation column itself left out). Raises
    DataError naming a missing template field's column or a malformed conversation."""
    from studio.core.data.browse import arrow_table, column_values
    from studio.core.data.load import DataError

    names = arrow_table(dataset).column_names
    if chat is None:
        fields, optional = template_fields_for(config)
        data = config.data
        # The check only: a missing column is refused here, with the mapping to add.
        field_columns(dataset, fields, data.columns, source, optional,
                      reserved=[data.split_column] if data.split_column else [])
    values = {name: column_values(dataset, name) for name in names}
    rows = [dict(zip(values, cells, strict=True)) for cells in zip(*values.values(), strict=True)]
    if chat is None:
        return rows
    column = chat[0]
    out = []
    for index, row in enumerate(rows):
        try:
            turns = chats.parse_turns(row.pop(column), f"{source}: row {index}, column '{column}'")
        except chats.ChatFormatError as exc:
            raise DataError(str(exc)) from None
        out.append({**row, chats.CHAT_FIELD: [t.as_message() for t in prompt_turns(turns)]})
    return out


def prompt_turns(turns: list[chats.Turn]) -> list[chats.Turn]:
    """The turns a conversation prompts with: all of them, or those before a final assistant turn."""
    return list(turns[:-1]) if turns and turns[-1].role == "assistant" else list(turns)


def template_row(row: Mapping[str, Any], config: RunConfig) -> dict[str, str]:
    """An instruction row's template fields as text (``data.columns`` applied), for rendering."""
    fields, _ = template_fields_for(config)
    columns = config.data.columns
    return {name: as_text(row.get(columns.get(name, name))) for name in fields}


def conversation(row: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """A conversational row's prompt messages (``{role, content}``), or None for an instruction row."""
    value = row.get(chats.CHAT_FIELD)
    return list(value) if isinstance(value, list) else None


def reward_columns(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns as the reward functions receive them (the prompt itself excluded)."""
    return {k: v for k, v in row.items() if k not in NOT_COLUMNS}


def grpo_lint(issues: list[Any]) -> list[Any]:
    """The dataset pane's lint for a GRPO run: a row has no answer to learn, so an empty or missing
    response, several rows with one prompt, and a conversation that ends with the user (the shape
    GRPO wants) are not problems; the other findings (too long, empty turns) are kept."""
    return [i for i in issues if i.kind not in ("empty_output", "duplicate_prompt")
            and not (i.kind == "role_order" and "last turn is not the assistant's" in i.message)]
