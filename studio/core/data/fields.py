"""Template fields read from a dataset's columns: which fields a run's prompt needs, their values as text.

Row numbers in messages are 0-based positions in the table, as the dataset browser shows them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from studio.core import prompt as prompts
from studio.core.data.browse import arrow_table, column_values
from studio.core.data.load import DataError
from studio.core.data.pairs import is_preference
from studio.core.prompt import chat as chats

if TYPE_CHECKING:
    from studio.core.config import RunConfig


def template_fields_for(config: RunConfig) -> tuple[list[str], set[str]]:
    """The fields the prompt needs from each row, and which of them may be absent (rendered empty).

    ``input`` is optional for the alpaca and chat presets: rows without one use the no-input wording.
    (A chat dataset has one field, ``messages``: see :func:`chat_column`.)
    """
    fields, optional = _template_fields(config)
    if is_preference(config) and config.prompt.rejected_field not in fields:
        fields.append(config.prompt.rejected_field)  # the pair's other side, rendered like the response
    if config.trainer.method == "grpo":  # the model writes the response: only the prompt's fields
        fields = [f for f in fields if f != config.prompt.response_field]
    return fields, optional


def _template_fields(config: RunConfig) -> tuple[list[str], set[str]]:
    name, answer = config.prompt.template, config.prompt.response_field
    if name in ("alpaca", "chat"):
        return ["instruction", "input", answer], {"input"}
    if name == "alpaca_no_input":
        return ["instruction", answer], set()
    fields = prompts.template_fields(name)
    return fields + ([answer] if answer not in fields else []), set()


def field_columns(
    dataset: Any, fields: Sequence[str], columns: Mapping[str, str], source: str,
    optional: set[str] = frozenset(), reserved: Sequence[str] = (),
) -> dict[str, list[str]]:
    """Each template field's values (as text), read from its mapped column.

    Raises :class:`DataError` naming a missing column, the columns present, and the mapping to add.
    ``reserved`` columns (the split column) are never suggested.
    """
    table = arrow_table(dataset)
    present = table.column_names
    out: dict[str, list[str]] = {}
    for name in fields:
        column = columns.get(name, name)
        if column not in present:
            if name in optional and name not in columns:
                out[name] = [""] * table.num_rows
                continue
            # Suggest a column no other field uses: the one most like the field's name, else the first.
            used = {columns.get(f, f) for f in fields} | set(reserved)
            free = [c for c in present if c not in used]
            close = difflib.get_close_matches(column, free, n=1, cutoff=0.3)
            guess = close[0] if close else free[0] if free else "<column>"
            raise DataError(f"{source}: no column '{column}' for the template field '{name}' (columns: "
                            f"{', '.join(present)}); map it in the config with data.columns: "
                            f"{{{name}: {guess}}}")
        out[name] = [as_text(v) for v in column_values(dataset, column)]
    return out


def as_text(value: Any) -> str:
    """A cell as training text: None is empty, 3.0 is "3", other values their str()."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def chat_column(dataset: Any, columns: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The column of a chat dataset and its shape (``openai`` or ``sharegpt``), or None.

    Only each column's first non-empty value is looked at (a slice, cheap on any size).
    """
    from studio.core.data.browse import first_value

    return chats.find_chat_column(arrow_table(dataset).column_names, lambda name: first_value(dataset, name), columns)
