"""What a dataset holds, told from its columns, and the prompt settings each shape trains with.

Five shapes:

- ``instruction``: template fields (``instruction`` / ``input`` / ``output``, or a template's own);
- ``chat``: conversations (``messages`` or ShareGPT's ``conversations``), tools and tool calls too
  (studio/core/prompt/chat.py);
- ``pairs``: preference pairs, TRL's standard shape: ``prompt``, ``chosen`` and ``rejected`` text;
- ``chat_pairs``: TRL's conversational shape: ``prompt``, ``chosen`` and ``rejected`` as lists of
  messages, or ``chosen`` and ``rejected`` whole conversations that share the prompt as their start;
- ``text``: raw text, a ``text`` column (or ``.txt`` files): continued pretraining.

A config that writes no template of its own (``prompt.template`` a preset: ``alpaca``, the
default, or ``chat``) trains TRL's shapes and raw text as they come: :meth:`DataShape.adapt` gives
the prompt settings that do. TRL's standard pairs train as ``{prompt}{chosen}``, the two texts
joined as TRL joins them, or through the model's chat template (the prompt as the user turn) when
``prompt.template`` is ``chat``; conversational pairs always go through the chat template, as in
TRL; raw text trains every token (the ``text`` preset). A literal template keeps its meaning.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core.data.pairs import CONVERSATION_COLUMNS, is_messages, is_preference
from studio.core.prompt import PRESETS, RAW_TEXT
from studio.core.prompt import chat as chats

if TYPE_CHECKING:
    from studio.core.config import PromptConfig, RunConfig

INSTRUCTION = "instruction"
CHAT = "chat"
PAIRS = "pairs"
CHAT_PAIRS = "chat_pairs"
TEXT = "text"

TRL_PROMPT = "prompt"
"""The column TRL's preference data carries its prompt in."""

TRL_STANDARD_TEMPLATE = "{prompt}{chosen}"
"""TRL's standard pairs with no template: the prompt, then the answer, joined as TRL joins them."""


@dataclass(frozen=True)
class DataShape:
    """A dataset's shape and the prompt settings it trains with."""

    kind: str
    """``instruction``, ``chat``, ``pairs``, ``chat_pairs`` or ``text``."""

    label: str
    """What the dataset pane and ``studio config check`` say it is."""

    prompt: PromptConfig | None = None
    """The prompt settings this data trains with, when they are not the config's own."""

    columns: dict[str, str] | None = None
    """The ``data.columns`` mapping it trains with, when it is not the config's own."""

    implicit_prompt: bool = False
    """Pairs whose prompt is not a column: the start ``chosen`` and ``rejected`` share."""

    def adapt(self, config: RunConfig) -> RunConfig:
        """``config`` with this shape's prompt settings and column mapping (itself when it has none)."""
        if self.prompt is None and self.columns is None:
            return config
        data = config.data if self.columns is None else dataclasses.replace(config.data, columns=dict(self.columns))
        return dataclasses.replace(config, prompt=self.prompt or config.prompt, data=data)


def detect(dataset: Any, config: RunConfig) -> DataShape:
    """The shape of ``dataset`` (a ``datasets.Dataset`` or a browser Table) for ``config``.

    Only each column's first non-empty value is read (cheap on any size).
    """
    from studio.core.data.browse import arrow_table, first_value

    names = [c for c in arrow_table(dataset).column_names if c != config.data.split_column]
    return shape_of(names, lambda name: chats.decoded(first_value(dataset, name)), config)


def shape_of(names: list[str], first: Callable[[str], Any], config: RunConfig) -> DataShape:
    """:func:`detect` on a table's column ``names`` (split column left out) and ``first(column)``,
    its first non-empty value."""
    columns, prompt = config.data.columns, config.prompt
    preset = prompt.template in PRESETS

    def column(field: str) -> str:
        return columns.get(field, field)

    if is_preference(config):
        # The preset's prompt field is no column of the data, or is TRL's prompt (adapted already).
        if preset and prompt.template != RAW_TEXT and (column("instruction") not in names
                                                       or column("instruction") == column(TRL_PROMPT)):
            trl = _trl_pairs(names, first, config)
            if trl is not None:
                return trl
        if prompt.template == TRL_STANDARD_TEMPLATE.replace("{chosen}", "{" + prompt.response_field + "}"):
            return DataShape(PAIRS, "preference pairs (TRL standard)")  # adapted already (a run's config)
        return DataShape(PAIRS, "preference pairs")
    if prompt.template == RAW_TEXT or (preset and column(TEXT) in names and column("instruction") not in names
                                       and column(prompt.response_field) not in names
                                       and chats.find_chat_column(names, first, columns) is None):
        raw = dataclasses.replace(prompt, template=RAW_TEXT, response_field=TEXT)
        return DataShape(TEXT, "raw text (continued pretraining: every token trained)", raw)
    found = chats.find_chat_column(names, first, columns)
    if found is not None:
        kind = "ShareGPT conversations" if found[1] == "sharegpt" else "conversations (OpenAI messages)"
        tools = chats.find_tools_column(names, columns)
        return DataShape(CHAT, kind + (f" with tools ('{tools}')" if tools else ""))
    return DataShape(INSTRUCTION, "instruction rows")


def _trl_pairs(names: list[str], first: Callable[[str], Any], config: RunConfig) -> DataShape | None:
    """TRL's preference shapes, when the data has a chosen and a rejected column (mapped or named so)."""
    prompt, columns = config.prompt, config.data.columns
    chosen = prompt.response_field if prompt.response_field != "output" else "chosen"
    rejected = prompt.rejected_field
    chosen_column, rejected_column = columns.get(chosen, chosen), columns.get(rejected, rejected)
    if chosen_column not in names or rejected_column not in names:
        return None
    prompt_column = columns.get(TRL_PROMPT, TRL_PROMPT)
    if prompt_column not in names:
        prompt_column = next((c for c in CONVERSATION_COLUMNS if c in names), prompt_column)
    present = [c for c in (prompt_column, chosen_column, rejected_column) if c in names]
    if any(is_messages(first(c)) for c in present):
        settings = dataclasses.replace(prompt, template="chat", response_field=chosen, rejected_field=rejected)
        mapping = {**columns, TRL_PROMPT: prompt_column} if prompt_column in names else dict(columns)
        return DataShape(CHAT_PAIRS, "preference pairs (TRL conversational)", settings, mapping,
                         implicit_prompt=prompt_column not in names)
    implicit = prompt_column not in names
    label = "preference pairs (TRL standard" + (", prompt shared by chosen and rejected)" if implicit else ")")
    if prompt.template == "chat":
        # The prompt is the user turn: the chat preset's instruction field, read from the prompt column.
        settings = dataclasses.replace(prompt, response_field=chosen, rejected_field=rejected)
        return DataShape(PAIRS, label, settings, {**columns, "instruction": prompt_column},
                         implicit_prompt=implicit)
    template = TRL_STANDARD_TEMPLATE.replace("{chosen}", "{" + chosen + "}")
    settings = dataclasses.replace(prompt, template=template, response_field=chosen, rejected_field=rejected)
    return DataShape(PAIRS, label, settings, {**columns, TRL_PROMPT: prompt_column}, implicit_prompt=implicit)


def adapt_to_data(config: RunConfig, base_dir: str | Path | None = None) -> RunConfig:
    """``config`` with the prompt settings its data's shape brings, for the run's config.yaml to
    record what trains (exports read the template from it); unchanged when the data cannot be read
    here (the worker then says why, in its one line)."""
    from studio.core.data.load import DataError, load_table

    if not config.data.path:
        return config
    try:
        table = load_table(config.data.path, config.data.hub_split, base_dir)
    except (DataError, OSError, ValueError):
        return config
    return detect(table, config).adapt(config)


def describe(shape: DataShape, config: RunConfig) -> str:
    """One phrase for ``studio config check``: the shape and how its rows render."""
    from studio.core.data.fields import template_fields_for

    adapted = shape.adapt(config)
    if shape.kind == TEXT:
        return shape.label
    if shape.kind in (CHAT, CHAT_PAIRS) or adapted.prompt.template == "chat":
        return f"{shape.label}, through the model's chat template"
    if shape.prompt is not None and shape.prompt.template.startswith("{prompt}"):
        return f"{shape.label}, each answer after its prompt as TRL joins them"
    return f"{shape.label}, template fields {', '.join(template_fields_for(adapted)[0])}"
