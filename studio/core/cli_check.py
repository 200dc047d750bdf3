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
    """Handler for ``studio config check``: 0 and a summary when training could start, else 2 and
    one line naming the file, line or key."""
    from studio.core import prompt
    from studio.core.chat import is_chat_row
    from studio.core.data import DataError, load_splits, template_fields_for

    config = load_config(args.config)
    base_dir: Path | None = Path(args.config).resolve().parent
    if getattr(args, "data", None):
        config.data.path, base_dir = args.data, None
    try:
        splits = load_splits(config, base_dir)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fields, _optional = template_fields_for(config)
    if config.prompt.template not in prompt.PRESETS:
        errors = [i for i in prompt.lint_template(config.prompt.template, fields, config.prompt.response_field,
                                                  config.prompt.add_eos) if i.severity == "error"]
        if errors:
            raise ConfigError(f"{args.config}: prompt.template: {errors[0].message}")
    counts = splits.counts()
    chat = bool(splits.train) and is_chat_row(splits.train[0])
    rendered = ("conversations through the model's chat template" if chat
                else f"template fields {', '.join(fields)}")
    print(f"{args.config}: ok: {counts['train']} training, {counts['validation']} validation and "
          f"{counts['test']} test rows from {config.data.path}; {rendered}")
    if config.trainer.method == "grpo":
        from studio.core import rewards

        try:  # the user's reward code runs here, on one row, before any model is loaded
            # reward files are relative to the config file, wherever --data points
            checked = rewards.check_on_row(config, splits.train[0], Path(args.config).resolve().parent)
        except (rewards.RewardError, rewards.RewardFailed) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{args.config}: rewards ok on one row: "
              + ", ".join(f"{r.label} (weight {r.weight:g})" for r in checked))
    return 0
