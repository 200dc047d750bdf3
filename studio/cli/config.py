"""`studio config check` and `studio config dump`.

`studio config check CONFIG [--data PATH]` reads the config, the data and the template, and loads no model.

Everything `studio train` would refuse before the model loads, found in seconds and without making
a run folder: the config's keys and ranges (every mistake at once), the data file (encoding,
format, columns, split), what the data holds (studio/core/data/shapes.py: instruction rows,
conversations, TRL's preference pairs, raw text), the template against the data's columns (a
``warning:`` line for each thing it does wrong with them), and, with the model's tokenizer on this
machine (core/prompt/tokens.py, no torch), the training rows that would train on no token: counted always,
refused as the run would refuse them when all or most are such. Plain Python (no torch).

`studio config dump [CONFIG]` prints the resolved config: every default filled in, Ludwig keys translated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from studio.core.config import ConfigError, RunConfig, default_config, load_config

if TYPE_CHECKING:
    from studio.core.data.split import Splits


def dump(args: argparse.Namespace) -> int:
    """Handler for ``studio config dump``: the resolved config as YAML (the sample config without one)."""
    config = load_config(args.config) if args.config else default_config()
    sys.stdout.write(config.to_yaml())
    return 0


def check(args: argparse.Namespace) -> int:
    """Handler for ``studio config check``: 0 and a summary when training could start (after a
    ``warning:`` line for each thing the template does wrong with the data), else 2 and one line a
    problem naming the file, line or key."""
    from studio.core import prompt
    from studio.core.data import DataError, load_splits, shapes, template_fields_for
    from studio.core.data.load import load_table
    from studio.core.data.stats import filled_counts, template_column_issues

    config = load_config(args.config)
    base_dir: Path | None = Path(args.config).resolve().parent
    if getattr(args, "data", None):
        config.data.path, base_dir = args.data, None
    try:
        # The table as it is (load_splits keeps the template's fields only): its columns are linted too.
        table = load_table(config.data.path, config.data.hub_split, base_dir) if config.data.path else None
        splits = load_splits(config, base_dir, dataset=table)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    adapted = splits.shape.adapt(config)
    fields, _optional = template_fields_for(adapted)
    issues = []
    if adapted.prompt.template not in prompt.PRESETS:
        issues = prompt.lint_template(adapted.prompt.template, fields, adapted.prompt.response_field,
                                      adapted.prompt.add_eos)
        errors = [i for i in issues if i.severity == "error"]
        if errors:
            raise ConfigError(f"{args.config}: prompt.template: {errors[0].message}")
    # Columns no placeholder reads: for the shapes a template renders (pairs and raw text have theirs;
    # a GRPO run's other columns are its rewards').
    if table is not None and splits.shape.kind in (shapes.INSTRUCTION, shapes.CHAT) and config.trainer.method != "grpo":
        issues += template_column_issues(adapted, table.column_names, conversations=splits.shape.kind == shapes.CHAT,
                                         filled=filled_counts(table))
    for issue in issues:
        if issue.severity == "warning":
            print(f"warning: {args.config}: prompt.template: {issue.message}")
    # A GRPO row trains on the completions the policy samples, not on tokens of its own.
    tokens = _trained_tokens(args.config, adapted, splits) if config.trainer.method != "grpo" else ""
    if tokens is None:
        return 2
    counts = splits.counts()
    print(f"{args.config}: ok: {counts['train']} training, {counts['validation']} validation and "
          f"{counts['test']} test rows from {config.data.path}; {shapes.describe(splits.shape, config)}")
    if tokens:
        print(tokens)
    if config.trainer.method == "grpo":
        from studio.core.grpo import rewards

        try:  # the user's reward code runs here, on one row, before any model is loaded
            # reward files are relative to the config file, wherever --data points
            checked = rewards.check_on_row(config, splits.train[0], Path(args.config).resolve().parent)
        except (rewards.RewardError, rewards.RewardFailed) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.config}: rewards ok on one row: "
              + ", ".join(f"{r.label} (weight {r.weight:g})" for r in checked))
    return 0


def _trained_tokens(source: str, config: RunConfig, splits: Splits) -> str | None:
    """The line on the training rows that would train on no token, counted with the model's
    tokenizer when this machine has it; None (the run's own refusal printed) when all or most would."""
    from studio.core.data import encoding
    from studio.core.prompt import TemplateError
    from studio.core.prompt.tokens import TokenizerNotFound, load_tokenizer_info

    model = config.model
    try:
        info = load_tokenizer_info(model.base_model, model.revision)
    except (TokenizerNotFound, OSError, ValueError) as exc:
        return f"{source}: trained tokens not counted: {str(exc).splitlines()[0]}"
    encoder = encoding.RowEncoder(config, encoding.Vocab.of(info), splits.shape.kind)
    try:
        found = encoding.untrained(splits.train, encoder)
    except TemplateError as exc:
        print(f"error: {config.data.path}: {exc}", file=sys.stderr)
        return None
    if found.refused:
        print(f"error: {encoding.refusal(found, config, str(config.data.path))}", file=sys.stderr)
        return None
    if found.count:
        reasons = ", ".join(f"{n:,} by the {why}" for why, n in found.reasons.most_common())
        return (f"{source}: {found.count:,} of {found.total:,} training rows train on no token ({reasons}; "
                f"the first is training row {found.rows[0]}); too few to refuse the run, they only cost time")
    return f"{source}: every training row trains on at least one token (counted with {model.base_model}'s tokenizer)"
