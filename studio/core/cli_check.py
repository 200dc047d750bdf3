"""`studio config check CONFIG [--data PATH]`: read the config, the data and the template, load no model.

Everything `studio train` would refuse before the model loads, found in a second or two and without
making a run folder: the config's keys and ranges, the data file (encoding, format, columns, split),
and the template against the data's columns. Plain Python (no torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studio.core.config import ConfigError, load_config


def main(args: argparse.Namespace) -> int:
    """Handler for ``studio config check``: 0 and a summary when training could start (after a
    ``warning:`` line for each thing the template does wrong with the data), else 2 and one line
    naming the file, line or key."""
    from studio.core import prompt
    from studio.core.chat import is_chat_row
    from studio.core.data import DataError, load_splits, template_fields_for
    from studio.core.dataload import load_table
    from studio.core.datastats import filled_counts, template_column_issues

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
    fields, _optional = template_fields_for(config)
    chat = bool(splits.train) and is_chat_row(splits.train[0])
    issues = []
    if config.prompt.template not in prompt.PRESETS:
        issues = prompt.lint_template(config.prompt.template, fields, config.prompt.response_field,
                                      config.prompt.add_eos)
        errors = [i for i in issues if i.severity == "error"]
        if errors:
            raise ConfigError(f"{args.config}: prompt.template: {errors[0].message}")
    if table is not None:
        issues += template_column_issues(config, table.column_names, conversations=chat, filled=filled_counts(table))
    for issue in issues:
        if issue.severity == "warning":
            print(f"warning: {args.config}: prompt.template: {issue.message}")
    counts = splits.counts()
    rendered = ("conversations through the model's chat template" if chat
                else f"template fields {', '.join(fields)}")
    print(f"{args.config}: ok: {counts['train']} training, {counts['validation']} validation and "
          f"{counts['test']} test rows from {config.data.path}; {rendered}")
    return 0
