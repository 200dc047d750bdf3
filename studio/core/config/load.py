"""A config file or text -> a checked :class:`RunConfig`: Studio's layout or Ludwig's, every problem at once.

:func:`load_config` reads a file, :func:`parse_config` YAML text; both detect a Ludwig LLM config
(``model_type: llm``, ``base_model``, ...) and translate it, read other tools' key names as Studio's
(each with a :class:`ConfigNote`), and :func:`validate` the result: choices, ranges, and the rules
between keys (GRPO, full fine-tuning, ``auto``, the template). Errors name the file, the line and the
key, and suggest the nearest known key. Plain Python and PyYAML only.
"""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path
from typing import Any

from studio.core.config.ludwig import from_ludwig
from studio.core.config.reader import ConfigError, KeyLines, Reader
from studio.core.config.sections import AUTO, RunConfig

_CHOICES = {
    ("quantization", "bits"): (4, 8, None),
    ("quantization", "quant_type"): ("nf4", "fp4"),
    ("quantization", "compute_dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("quantization", "on_cpu"): ("full", "keep"),
    ("trainer", "scheduler"): ("cosine", "linear", "constant"),
    ("trainer", "optimizer"): ("adamw", "adamw_8bit", "paged_adamw", "paged_adamw_8bit"),
    ("trainer", "method"): ("sft", "dpo", "orpo", "grpo"),
    ("grpo", "loss"): ("grpo", "dr_grpo"),
}

_SEED_LIMIT = 2**32
"""Seeds must fit numpy's and torch's generators."""

# (section, key, test, what the value must be). None values are skipped: they mean "not set".
_RANGES: list[tuple[str, str, typing.Callable[[Any], bool], str]] = [
    ("lora", "r", lambda v: v > 0, "greater than 0"),
    ("lora", "alpha", lambda v: v > 0, "greater than 0"),
    ("lora", "dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("data", "max_seq_length", lambda v: v >= 2, "at least 2 (tokens)"),
    ("data", "val_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("data", "test_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("data", "sample_ratio", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("trainer", "learning_rate", lambda v: 0 < v < 1, "in (0, 1) (typical: 1e-4 to 5e-4)"),
    ("trainer", "epochs", lambda v: v > 0, "greater than 0"),
    ("trainer", "max_steps", lambda v: v > 0, "greater than 0 (or null to train for trainer.epochs)"),
    ("trainer", "micro_batch_size", lambda v: v == AUTO or (isinstance(v, int) and v > 0),
     "greater than 0 (or auto)"),
    ("trainer", "effective_batch_size", lambda v: v > 0, "greater than 0 (or null)"),
    ("trainer", "gradient_accumulation_steps", lambda v: v > 0, "greater than 0 (or null)"),
    ("trainer", "warmup_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer", "weight_decay", lambda v: v >= 0, "0 or more"),
    ("trainer", "max_grad_norm", lambda v: v >= 0, "0 (no clipping) or more"),
    ("trainer", "eval_interval", lambda v: v >= 0, "0 (no evaluation) or more"),
    ("trainer", "eval_max_rows", lambda v: v > 0, "greater than 0"),
    ("trainer", "checkpoint_interval", lambda v: v >= 0, "0 (only at the end) or more"),
    ("trainer", "keep_checkpoints", lambda v: v > 0, "greater than 0"),
    ("trainer", "log_interval", lambda v: v > 0, "greater than 0"),
    ("trainer", "seed", lambda v: 0 <= v < _SEED_LIMIT, f"in [0, {_SEED_LIMIT})"),
    ("trainer", "beta", lambda v: v > 0, "greater than 0 (typical: 0.1)"),
    ("generation", "max_new_tokens", lambda v: v > 0, "greater than 0"),
    ("generation", "temperature", lambda v: 0 <= v <= 100, "in [0, 100] (0 is greedy; typical: 0.7)"),
    ("generation", "top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("grpo", "num_generations", lambda v: v >= 2, "at least 2 (a group is compared within itself)"),
    ("grpo", "max_completion_length", lambda v: v > 0, "greater than 0 (tokens)"),
    ("grpo", "temperature", lambda v: 0 < v <= 100, "in (0, 100] (typical: 1.0)"),
    ("grpo", "beta", lambda v: v >= 0, "0 (no reference pass) or more (typical: 0.04)"),
]


def validate(config: RunConfig, source: str = "config", lines: dict | KeyLines | None = None,
             reader: Reader | None = None) -> RunConfig:
    """Check values a type cannot: choices, ranges, finite numbers and the template's syntax.
    Returns the config, or raises one ConfigError listing every problem, each naming the key (and
    its line when ``lines`` has it). ``reader`` (parse_config's) adds the problems it has already
    found, so that one ConfigError holds them all."""
    reader = reader or Reader(source, lines or {})
    _check_auto(config, reader)
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            reader.report((section, key), f"'{section}.{key}' is {value!r}; choose one of {shown}")
    for section, key, ok, rule in _RANGES:
        if getattr(config, section) is None:
            continue  # lora: null (full fine-tuning)
        value = getattr(getattr(config, section), key)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            reader.report((section, key), f"'{section}.{key}' must be a finite number {rule}; it is {value}")
        elif not ok(value):
            reader.report((section, key), f"'{section}.{key}' must be {rule}; it is {value!r}")
    if config.data.val_fraction + config.data.test_fraction >= 1 and not reader.reported(("data", "val_fraction")) \
            and not reader.reported(("data", "test_fraction")):
        reader.report(("data", "val_fraction"),
                      "'data.val_fraction' + 'data.test_fraction' must be below 1 (some rows must train)")
    for section, key in (("model", "base_model"), ("prompt", "template"), ("output_dir", "")):
        value = getattr(config, section) if not key else getattr(getattr(config, section), key)
        if not str(value).strip():
            dotted = f"{section}.{key}" if key else section
            reader.report((section, key) if key else (section,), f"'{dotted}' is empty; give a value")
    if not _FIELD_NAME.fullmatch(config.prompt.response_field):
        reader.report(("prompt", "response_field"), f"'prompt.response_field' is "
                      f"{config.prompt.response_field!r}; use a name of letters, digits and _ "
                      "(map a column named otherwise with data.columns)")
    if config.trainer.method in ("dpo", "orpo") and (config.prompt.rejected_field == config.prompt.response_field
                                           or not _FIELD_NAME.fullmatch(config.prompt.rejected_field)):
        reader.report(("prompt", "rejected_field"), (
            f"'prompt.rejected_field' is {config.prompt.rejected_field!r} and 'prompt.response_field' is "
            f"{config.prompt.response_field!r}; a {config.trainer.method} run needs two different fields, "
            "e.g. response_field: chosen, rejected_field: rejected"))
    for name, column in config.data.columns.items():
        if not _FIELD_NAME.fullmatch(name) or not column.strip():
            reader.report(("data", "columns", name), f"'data.columns' maps {name!r} to {column!r}; "
                          "write template_field: column_name (field names are letters, digits and _)")
    gpus = config.distributed.gpus
    if isinstance(gpus, str) and gpus.strip().lower() in ("all", *(str(n) for n in range(1, 1025))):
        gpus = config.distributed.gpus = gpus.strip().lower() if not gpus.strip().isdigit() else int(gpus)
    if not (gpus == "all" or (isinstance(gpus, int) and gpus >= 1)):
        reader.report(("distributed", "gpus"), f"'distributed.gpus' is {gpus!r}; give a number of GPUs "
                      "(1 or more) or 'all'")
    _check_full_finetune(config, reader)
    _check_template(config, reader)
    if config.trainer.method == "grpo":
        _check_grpo(config, reader)
    reader.check()
    return config


def _check_grpo(config: RunConfig, reader: Reader) -> None:
    """A GRPO run's rewards (studio/core/grpo/rewards.py) and room for a prompt beside the completion."""
    from studio.core.grpo.rewards import check_configs

    check_configs(config, reader)
    g, max_len = config.grpo, config.data.max_seq_length
    if max_len <= g.max_completion_length:
        reader.report(("data", "max_seq_length"), (
            f"'data.max_seq_length' is {max_len} but 'grpo.max_completion_length' is {g.max_completion_length}: "
            "a prompt and its completion must fit in data.max_seq_length; raise it (e.g. to "
            f"{g.max_completion_length + 256}) or lower grpo.max_completion_length"))


def _check_full_finetune(config: RunConfig, reader: Reader) -> None:
    """What full fine-tuning (``lora: null``) cannot be combined with, one line each."""
    if not config.full_finetune:
        return
    bits = config.quantization.bits
    # A bits value that is no choice at all, or a Ludwig config already told it lacks an adapter,
    # has its line already.
    if bits is not None and not reader.reported(("quantization", "bits")) and not reader.reported(("adapter",)):
        reader.report(("quantization", "bits"), (
            f"'quantization.bits' is {bits} but 'lora' is null (full fine-tuning): {bits}-bit weights cannot "
            "take gradients; set quantization.bits: null to train every weight, or give a lora section "
            "(QLoRA)"))
    if config.trainer.method != "sft":
        reader.report(("trainer", "method"), (
            f"'trainer.method' is {config.trainer.method} but 'lora' is null (full fine-tuning): preference "
            "and GRPO runs compare against the base with the adapter switched off; give a lora section, or "
            "use trainer.method: sft"))
    gpus = config.distributed.gpus
    if gpus != 1:
        reader.report(("distributed", "gpus"), (
            f"'distributed.gpus' is {gpus!r} but 'lora' is null (full fine-tuning): Studio trains a full "
            "fine-tune on one GPU (each GPU would hold every weight, gradient and optimizer state); set "
            "distributed.gpus: 1, or give a lora section"))


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_auto(config: RunConfig, reader: Reader) -> None:
    """``trainer.micro_batch_size`` is a number or ``auto``, ``trainer.gradient_checkpointing`` true,
    false or ``auto`` (any case; a quoted number is read as the number)."""
    t = config.trainer
    if isinstance(t.micro_batch_size, str):
        text = t.micro_batch_size.strip().lower()
        t.micro_batch_size = int(text) if text.isdigit() else text
    if isinstance(t.gradient_checkpointing, str):
        text = t.gradient_checkpointing.strip().lower()
        if text != AUTO:
            reader.report(("trainer", "gradient_checkpointing"), (
                f"'trainer.gradient_checkpointing' is {t.gradient_checkpointing!r}; write true, false or auto"))
            t.gradient_checkpointing = AUTO
        else:
            t.gradient_checkpointing = text


def _check_template(config: RunConfig, reader: Reader) -> None:
    """A literal template with a brace that opens or closes nothing would render a placeholder as
    text (or drop it) in every example: refuse it here, before any data is read."""
    from studio.core.prompt import PRESETS, syntax_issues

    template = config.prompt.template
    if template in PRESETS:
        return
    problems = syntax_issues(template)
    if problems:
        reader.report(("prompt", "template"), f"'prompt.template': {problems[0].message}")


def parse_config(text: str, source: str = "config") -> RunConfig:
    """Read a config from YAML text (Studio or Ludwig layout). ``source`` names it in errors.

    Other tools' key names (``lora_alpha``, ``num_train_epochs``: see :mod:`studio.core.config.aliases`) are
    read as Studio's, each with a :class:`ConfigNote`.
    """
    from studio.core.config import aliases, safe_yaml

    try:
        raw, found = safe_yaml.load(text, source)
    except safe_yaml.YamlError as exc:
        raise ConfigError(str(exc)) from None
    lines = KeyLines(found)
    reader = Reader(source, lines)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys to values")
    raw = {str(k): v for k, v in raw.items()}
    if "model_type" in raw or "base_model" in raw or "input_features" in raw or "ludwig_version" in raw:
        raw = from_ludwig(raw, reader)  # renamed keys keep the lines Ludwig's names were written on
    else:
        _full_finetune_spelling(raw, reader)

        def note(old: tuple[str, ...], new: tuple[str, ...], message: str) -> None:
            lines.rename(old, new)
            reader.note(old, message)

        raw = aliases.apply(raw, set(_SECTIONS), note, reader.report)
    config = reader.build(RunConfig, raw, ())
    return validate(config, source, reader.lines, reader)


_NO_ADAPTER = (None, False, "none", "null", "full")
"""What ``lora:`` may say to ask for full fine-tuning (``lora: null`` is the spelling Studio writes)."""


def _full_finetune_spelling(raw: dict[str, Any], reader: Reader) -> None:
    """``lora: null`` / ``false`` / ``none`` become full fine-tuning (``lora`` None, in place). A
    quantization section that does not name ``bits`` then gets ``bits: null``: the 4-bit default is
    QLoRA's, and a full fine-tune needs unquantized weights (an explicit 4 or 8 is refused in
    :func:`validate`). LoRA-only options given at the top level (``use_dora: true``) are refused here."""
    if "lora" not in raw or raw["lora"] is True:
        if raw.get("lora") is True:
            raw["lora"] = {}
        return
    value = raw["lora"]
    if isinstance(value, str):
        value = value.strip().lower()
    if value not in _NO_ADAPTER:
        return
    from studio.core.config import aliases

    for key in list(raw):
        if aliases.ALIASES.get(key, ("",))[0] == "lora":
            reader.report((key,), f"'{key}' sets a LoRA option but 'lora' is null (full fine-tuning: no "
                          "adapter); remove it, or give a lora section")
            del raw[key]
    raw["lora"] = None
    quantization = raw.get("quantization")
    if quantization is None:
        raw["quantization"] = {"bits": None}
    elif isinstance(quantization, dict) and "bits" not in quantization:
        raw["quantization"] = {**quantization, "bits": None}


_SECTIONS = ("model", "quantization", "lora", "prompt", "data", "trainer", "generation", "distributed", "grpo")


_MAX_CONFIG_BYTES = 2**20
"""Larger files are refused unread: a config is a few KB, and a dataset passed by mistake would be parsed whole."""


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML config file; every problem is a ConfigError naming the file (and line)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file; check the path (or run 'studio config dump' "
                          "for a starting point)")
    if path.is_dir():
        raise ConfigError(f"{path}: this is a folder; give the config's YAML file")
    if not path.is_file():  # a pipe or a device would block the read, or never end
        raise ConfigError(f"{path}: not a regular file; save the config to a file")
    try:
        size = path.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: the file is {size / 2**20:.1f} MB, and a config is a few KB; check that "
                              "this is the config (a dataset goes in data.path)")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc.strerror or exc}); check its permissions") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not content
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[err.start]:02x}); "
                          "save the file as UTF-8") from None
    return parse_config(text, str(path))


def default_config() -> RunConfig:
    """The config `studio` uses with no arguments: the bundled sample data and the default model."""
    from studio.core.paths import sample_data_dir

    config = RunConfig()
    sample = sample_data_dir() / "code_alpaca_sample.jsonl"
    if sample.exists():
        config.data.path = str(sample)
    return config
