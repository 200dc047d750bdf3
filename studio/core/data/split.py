"""Rows for training: template fields read from their columns, split into train / validation / test.

Row numbers in messages are 0-based positions in the table, as the dataset browser shows them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core import prompt as prompts
from studio.core.data import shapes
from studio.core.data.browse import arrow_table, column_values
from studio.core.data.fields import as_text, chat_column, field_columns, template_fields_for
from studio.core.data.load import SPLIT_NAMES, DataError, load_table
from studio.core.data.pairs import conversation_pair, flatten_table, is_preference, shared_prompt
from studio.core.prompt import chat as chats

if TYPE_CHECKING:
    import datasets

    from studio.core.config import RunConfig


@dataclass
class Splits:
    """Rows for training, validation and test; each row a dict keyed by template field names (text),
    or for a chat dataset ``{"messages": [{"role", "content"}, ...]}``."""

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]
    test: list[dict[str, Any]]
    indices: dict[str, list[int]] = field(default_factory=dict)
    """Each split's row positions in the loaded table (for the browser and for lint)."""
    shape: shapes.DataShape = shapes.DataShape(shapes.INSTRUCTION, "instruction rows")
    """What the data holds; ``shape.adapt(config)`` is the config its rows were read for."""

    def counts(self) -> dict[str, int]:
        """Rows per split."""
        return {"train": len(self.train), "validation": len(self.validation), "test": len(self.test)}


def load_splits(config: RunConfig, base_dir: str | Path | None = None,
                dataset: datasets.Dataset | None = None) -> Splits:
    """Load ``config.data`` and split it: by the split column when the data has one (0 train,
    1 validation, 2 test), otherwise a shuffle seeded by ``trainer.seed`` into ``val_fraction`` /
    ``test_fraction``; then ``sample_ratio`` of the training rows are kept.

    ``base_dir`` is the config file's folder (relative data paths are tried there after the working
    directory); ``dataset`` skips loading when the caller already has the table. A template with a
    brace that is no placeholder raises :class:`DataError` (see :func:`studio.core.prompt.syntax_issues`).
    """
    data = config.data
    if dataset is None:
        if not data.path:
            raise DataError("data.path is not set; name a CSV/JSON/JSONL/Parquet file, a saved dataset "
                            "folder or a hub id (or pass --data PATH)")
        dataset = load_table(data.path, data.hub_split, base_dir)
    source = str(data.path or "dataset")
    if len(dataset) == 0:
        raise DataError(f"{source}: the dataset has no rows; add some")
    problems = prompts.syntax_issues(config.prompt.template)
    if problems:
        # A config built in memory (the TUI's editor) has not been through config.validate; a brace
        # that is no placeholder would drop its field from every example.
        raise DataError(f"prompt.template: {problems[0].message}")
    shape = shapes.detect(dataset, config)
    config = shape.adapt(config)  # TRL's preference shapes and raw text with no template of their own
    data = config.data
    preference = is_preference(config)
    if shape.kind == shapes.PAIRS and shape.implicit_prompt:
        dataset = shared_prompt(dataset, config, source)
    elif preference and shape.kind == shapes.PAIRS:
        # Chat-shaped pairs under a template of your own become text columns: a transcript prompt.
        dataset = flatten_table(dataset, config, template_fields_for(config)[0][0])
    total = len(dataset)
    chat = None if preference or shape.kind == shapes.TEXT else chat_column(dataset, data.columns)
    if chat is not None and config.prompt.template != "chat":
        raise DataError(f"{source}: column '{chat[0]}' holds conversations ({chat[1]} shape); they are "
                        "rendered with the model's chat template: set prompt.template: chat")
    if config.trainer.method == "grpo":
        from studio.core.grpo import rows as grpo_rows

        table_rows = grpo_rows.table_rows(dataset, config, source, chat)
    elif shape.kind == shapes.CHAT_PAIRS:
        table_rows = conversation_pairs(dataset, config, source)
    elif chat is not None:
        table_rows = chat_rows(dataset, chat[0], source, chats.find_tools_column(dataset.column_names, data.columns))
    else:
        fields, optional = template_fields_for(config)
        values = field_columns(dataset, fields, data.columns, source, optional,
                               reserved=[data.split_column] if data.split_column else [])
        table_rows = [dict(zip(values, row, strict=True)) for row in zip(*values.values(), strict=True)]

    if data.split_column and data.split_column in dataset.column_names:
        parts: dict[str, list[int]] = {"train": [], "validation": [], "test": []}
        for index, value in enumerate(column_values(dataset, data.split_column)):
            name = SPLIT_NAMES.get(as_text(value).strip().lower())
            if name is None:
                raise DataError(f"{source}: row {index}, column '{data.split_column}': split value {value!r} "
                                "is not 0/1/2 (train/validation/test); fix it or set data.split_column: null")
            parts[name].append(index)
    else:
        order = list(range(total))
        random.Random(config.trainer.seed).shuffle(order)
        n_test = _share(total, data.test_fraction)
        n_val = min(_share(total, data.val_fraction), total - n_test - 1)
        parts = {"test": sorted(order[:n_test]), "validation": sorted(order[n_test:n_test + n_val]),
                 "train": sorted(order[n_test + n_val:])}
    if not parts["train"]:
        raise DataError(f"{source}: no training rows after splitting (split column "
                        f"'{data.split_column}' has no 0s?); mark some rows 0 or lower the fractions")
    if data.sample_ratio < 1:
        keep = max(1, round(len(parts["train"]) * data.sample_ratio))
        rng = random.Random(config.trainer.seed + 1)
        parts["train"] = sorted(rng.sample(parts["train"], keep))
    return Splits(
        train=[table_rows[i] for i in parts["train"]],
        validation=[table_rows[i] for i in parts["validation"]],
        test=[table_rows[i] for i in parts["test"]],
        indices=parts,
        shape=shape,
    )


def chat_rows(dataset: Any, column: str, source: str, tools_column: str | None = None) -> list[dict[str, Any]]:
    """Every row's conversation as ``{"messages": [{"role", "content", ...}, ...]}`` (OpenAI's
    roles), with ``"tools"`` (JSON schemas) when ``tools_column`` gives the row any.

    A row that is no conversation raises :class:`DataError` with its 0-based position.
    """
    tools = column_values(dataset, tools_column) if tools_column else None
    out: list[dict[str, Any]] = []
    for index, value in enumerate(column_values(dataset, column)):
        try:
            turns = chats.parse_turns(value, f"{source}: row {index}, column '{column}'")
            offered = chats.parse_tools(tools[index], f"{source}: row {index}, column '{tools_column}'") \
                if tools is not None else None
        except chats.ChatFormatError as exc:
            raise DataError(str(exc)) from None
        row: dict[str, Any] = {chats.CHAT_FIELD: [t.as_message() for t in turns]}
        if offered:
            row[chats.TOOLS_FIELD] = offered
        out.append(row)
    return out


def conversation_pairs(dataset: Any, config: RunConfig, source: str) -> list[dict[str, Any]]:
    """TRL's conversational pairs as rows ``{"prompt": [messages], chosen: [messages], rejected:
    [messages]}`` (field names: ``prompt.response_field`` / ``rejected_field``), the shared start of
    ``chosen`` and ``rejected`` taken as the prompt where the data has no prompt column, and
    ``"tools"`` when the data offers any. A row that is no conversation raises :class:`DataError`."""
    columns, p = config.data.columns, config.prompt
    names = dataset.column_names
    fields = {shapes.TRL_PROMPT: columns.get(shapes.TRL_PROMPT, shapes.TRL_PROMPT),
              p.response_field: columns.get(p.response_field, p.response_field),
              p.rejected_field: columns.get(p.rejected_field, p.rejected_field)}
    values = {f: column_values(dataset, c) if c in names else None for f, c in fields.items()}
    tools_column = chats.find_tools_column(names, columns)
    tools = column_values(dataset, tools_column) if tools_column else None
    out: list[dict[str, Any]] = []
    for index in range(len(dataset)):
        try:
            row = conversation_pair({f: v[index] if v is not None else None for f, v in values.items()},
                                    shapes.TRL_PROMPT, p.response_field, p.rejected_field,
                                    f"{source}: row {index}")
            offered = chats.parse_tools(tools[index], f"{source}: row {index}, column '{tools_column}'") \
                if tools is not None else None
        except chats.ChatFormatError as exc:
            raise DataError(str(exc)) from None
        if offered:
            row[chats.TOOLS_FIELD] = offered
        out.append(row)
    return out


def _share(total: int, fraction: float) -> int:
    """Rows for a held-out fraction: at least one when asked for any, never all."""
    if fraction <= 0 or total < 2:
        return 0
    return min(total - 1, max(1, round(total * fraction)))


def split_counts(dataset: Any, split_column: str = "split") -> dict[str, int] | None:
    """Rows per split named by the split column, or None when the data has no such column."""
    table = arrow_table(dataset)
    if split_column not in table.column_names:
        return None
    counts = {"train": 0, "validation": 0, "test": 0, "other": 0}
    for value in column_values(dataset, split_column):
        counts[SPLIT_NAMES.get(as_text(value).strip().lower(), "other")] += 1
    return counts
