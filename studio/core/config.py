"""The run configuration: typed dataclasses <-> YAML, with Ludwig-style LLM keys accepted.

A config file is either Studio's own layout (sections ``model``, ``quantization``, ``lora``,
``prompt``, ``data``, ``trainer``, ``generation``) or a Ludwig LLM config (``model_type: llm``,
``base_model``, ``adapter``, ``trainer: {type: finetune, ...}``); :func:`load_config` detects which
and returns a :class:`RunConfig`. Errors name the file, the line and the key, and suggest the
nearest known key.

Plain Python and PyYAML only: the UI imports this.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from studio.core.ludwig import from_ludwig

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A config problem a person can fix; the message names the file, line and key."""


@dataclass
class ModelConfig:
    """Which base model to fine-tune."""

    base_model: str = DEFAULT_MODEL
    """Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``) or a local folder with config.json."""

    revision: str | None = None
    """Hub revision (branch, tag or commit) to load; None for the default branch."""

    trust_remote_code: bool = False
    """Allow model code from the hub to run; only for models you trust."""


@dataclass
class QuantizationConfig:
    """How the frozen base weights are stored while training (QLoRA = 4-bit NF4)."""

    bits: int | None = 4
    """4 (bitsandbytes NF4/FP4), 8 (LLM.int8) or None for no quantization."""

    quant_type: str = "nf4"
    """4-bit data type: ``nf4`` (normal float, best for normally distributed weights) or ``fp4``."""

    double_quant: bool = True
    """Quantize the quantization constants too (saves ~0.4 bit a parameter)."""

    compute_dtype: str = "auto"
    """dtype of matmuls and of unquantized weights: ``auto`` (bf16 on GPU, fp32 on CPU),
    ``bfloat16``, ``float16`` or ``float32``."""


@dataclass
class LoraConfig:
    """The low-rank adapter trained on top of the frozen base."""

    r: int = 16
    """Rank of the update matrices; more rank, more trainable parameters."""

    alpha: int = 32
    """Scaling numerator: the update is scaled by alpha / r."""

    dropout: float = 0.0
    """Dropout on the adapter's input. 0 (the default) lets the GPU fast path replay each step as a
    CUDA graph, ~2x faster; 0.05-0.1 can help a long run on little data overfit less."""

    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: ``all-linear`` or a list such as [q_proj, v_proj]."""


@dataclass
class PromptConfig:
    """How a dataset row becomes training text: a template with {field} placeholders."""

    template: str = "alpaca"
    """A preset name (``alpaca``, ``alpaca_no_input``, ``chat``) or a template such as
    ``### Instruction:\\n{instruction}\\n\\n### Response:\\n{output}``. The text from the
    response field's placeholder to the end is the response: loss is computed there only. A template
    without the response placeholder gets the response appended after it."""

    response_field: str = "output"
    """The field whose text is the answer the model learns to produce."""

    add_eos: bool = True
    """Append the tokenizer's end-of-sequence token to every response, so the model learns to stop."""


@dataclass
class DataConfig:
    """Where the rows come from and how they are split."""

    path: str | None = None
    """CSV, JSON, JSONL or Parquet file, a folder saved by ``datasets.save_to_disk``, or a hub id."""

    hub_split: str = "train"
    """Which split to read when ``path`` is a hub dataset."""

    columns: dict[str, str] = field(default_factory=dict)
    """Template field -> dataset column, for columns named differently (``{instruction: prompt}``)."""

    split_column: str | None = "split"
    """Column holding 0 (train) / 1 (validation) / 2 (test); used when present in the data."""

    val_fraction: float = 0.1
    """Fraction of rows held out for validation when there is no split column."""

    test_fraction: float = 0.0
    """Fraction of rows held out for testing when there is no split column."""

    sample_ratio: float = 1.0
    """Use this fraction of the training rows (Ludwig's ``preprocessing.sample_ratio``)."""

    max_seq_length: int = 512
    """Tokens per example after rendering the template; longer examples are truncated."""


@dataclass
class TrainerConfig:
    """The optimisation loop."""

    learning_rate: float = 2e-4
    """Peak learning rate, reached after warmup."""

    epochs: float = 1.0
    """Passes over the training rows; ignored when ``max_steps`` is set."""

    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides ``epochs``)."""

    micro_batch_size: int = 4
    """Examples per forward/backward pass: what must fit in GPU memory."""

    effective_batch_size: int | None = 16
    """Examples per optimizer step; gradient accumulation = effective / micro batch."""

    gradient_accumulation_steps: int | None = None
    """Set directly instead of ``effective_batch_size`` (Ludwig style); None to derive it."""

    warmup_fraction: float = 0.03
    """Fraction of the steps spent warming the learning rate up from 0."""

    scheduler: str = "cosine"
    """Learning-rate schedule after warmup: ``cosine``, ``linear`` or ``constant``."""

    optimizer: str = "adamw"
    """``adamw`` (torch), ``adamw_8bit`` or ``paged_adamw_8bit`` (bitsandbytes)."""

    weight_decay: float = 0.0
    """AdamW weight decay on the adapter weights."""

    max_grad_norm: float = 1.0
    """Clip the gradient norm to this; 0 disables clipping."""

    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: far less memory for ~30% more compute."""

    packing: bool = True
    """Pack several examples into one row without padding (each attends only to itself)."""

    eval_interval: int = 50
    """Evaluate on the validation split every this many steps (and at the end); 0 disables."""

    eval_max_rows: int = 200
    """Evaluate on at most this many validation rows, to keep evaluation quick."""

    checkpoint_interval: int = 100
    """Save a resumable checkpoint every this many steps; 0 disables (the end is always saved)."""

    keep_checkpoints: int = 2
    """Keep only the newest this many checkpoints."""

    log_interval: int = 1
    """Emit a step event every this many steps."""

    seed: int = 42
    """Seed for data order, LoRA initialisation and dropout: same seed, same run."""

    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step, from the explicit value or the effective batch."""
        if self.gradient_accumulation_steps:
            return max(1, int(self.gradient_accumulation_steps))
        if self.effective_batch_size:
            return max(1, math.ceil(self.effective_batch_size / max(1, self.micro_batch_size)))
        return 1


@dataclass
class GenerationConfig:
    """Defaults for answers in the chat pane, ``studio eval`` and previews."""

    max_new_tokens: int = 128
    """Stop after this many new tokens (or at end-of-sequence)."""

    temperature: float = 0.0
    """0 means greedy decoding; higher is more random."""

    top_p: float = 0.9
    """Nucleus sampling: sample from the smallest set of tokens with this total probability."""


@dataclass
class RunConfig:
    """Everything one fine-tuning run needs; saved as ``runs/<id>/config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model."""

    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    """How base weights are stored."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """The adapter."""

    prompt: PromptConfig = field(default_factory=PromptConfig)
    """Row -> text."""

    data: DataConfig = field(default_factory=DataConfig)
    """The dataset."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Answer defaults."""

    output_dir: str = "runs"
    """Folder under which each run gets its own directory."""

    name: str | None = None
    """A label for the run; the run id is made from the time and this (or the model)."""

    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that also get the run's metrics: any of ``tensorboard`` (written under
    ``runs/<id>/tensorboard``), ``wandb``, ``mlflow``. Needs ``pip install 'studio[trackers]'``."""

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, every default filled in."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML that :func:`load_config` reads back unchanged."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True, width=100)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML to ``path`` (atomically: a temp file, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_yaml())
        tmp.replace(path)


# --------------------------------------------------------------------------------- YAML -> config


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML was built with it (several times faster), else the pure-Python one."""


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map each mapping key path in the YAML text to its 1-based line, for error messages."""
    lines: dict[tuple[str, ...], int] = {}
    try:
        root = yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError:
        return lines

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = (*path, str(key.value))
                lines[sub] = key.start_mark.line + 1
                walk(value, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, (*path, str(i)))

    if root is not None:
        walk(root, ())
    return lines


class _KeyLines:
    """The YAML's key lines, found only when an error needs one: composing the text a second time
    costs as much as loading it, and a valid config (the usual case) never asks."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._lines: dict[tuple[str, ...], int] | None = None

    def get(self, path: tuple[str, ...], default: int | None = None) -> int | None:
        if self._lines is None:
            self._lines = _key_lines(self._text)
        return self._lines.get(path, default)


class _Reader:
    """Turns nested dicts into dataclasses, raising errors that name file, line and key."""

    def __init__(self, source: str, lines: dict[tuple[str, ...], int] | _KeyLines):
        self.source = source
        self.lines = lines

    def where(self, path: tuple[str, ...]) -> str:
        line = self.lines.get(path)
        return f"{self.source}: line {line}" if line else self.source

    def fail(self, path: tuple[str, ...], message: str) -> ConfigError:
        return ConfigError(f"{self.where(path)}: {message}")

    def unknown(self, path: tuple[str, ...], known: list[str]) -> ConfigError:
        key = path[-1]
        dotted = ".".join(path)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(known)}"
        return self.fail(path, f"unknown key '{dotted}': {hint}")

    def build(self, cls: type, data: Any, path: tuple[str, ...]) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            where = ".".join(path) or "the top level"
            raise self.fail(path, f"'{where}' must be a mapping of keys to values")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in data.items():
            key = str(key)
            if key not in fields:
                raise self.unknown((*path, key), list(fields))
            values[key] = self.coerce(hints[key], value, (*path, key))
        return cls(**values)

    def coerce(self, hint: Any, value: Any, path: tuple[str, ...]) -> Any:
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, path)
        dotted = ".".join(path)
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
        if value is None:
            if type(None) in options:
                return None
            raise self.fail(path, f"'{dotted}' needs a value")
        for option in options:
            if option is type(None):
                continue
            ok, converted = _convert(option, value)
            if ok:
                return converted
        wanted = " or ".join(_type_name(o) for o in options if o is not type(None))
        raise self.fail(path, f"'{dotted}' should be {wanted}, got {value!r}")


_UnionType = type(int | None)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "text"}.get(hint, str(hint))


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    if origin is list:
        if isinstance(value, list):
            return True, [str(v) for v in value]
        return False, None
    if origin is dict:
        if isinstance(value, dict):
            return True, {str(k): str(v) for k, v in value.items()}
        return False, None
    if hint is bool:
        return (True, value) if isinstance(value, bool) else (False, None)
    if hint is int:
        if isinstance(value, bool):
            return False, None
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if hint is float:
        if isinstance(value, bool):
            return False, None
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return True, str(value)
        return False, None
    return False, None


# ------------------------------------------------------------------------------------- checking

_CHOICES = {
    ("quantization", "bits"): (4, 8, None),
    ("quantization", "quant_type"): ("nf4", "fp4"),
    ("quantization", "compute_dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("trainer", "scheduler"): ("cosine", "linear", "constant"),
    ("trainer", "optimizer"): ("adamw", "adamw_8bit", "paged_adamw_8bit"),
}


def validate(config: RunConfig, source: str = "config", lines: dict | _KeyLines | None = None) -> RunConfig:
    """Check values a type cannot: choices and ranges. Returns the config, or raises ConfigError."""
    reader = _Reader(source, lines or {})
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            raise reader.fail((section, key), f"'{section}.{key}' is {value!r}; choose one of {shown}")
    positive = [("lora", "r"), ("lora", "alpha"), ("trainer", "micro_batch_size"),
                ("data", "max_seq_length"), ("generation", "max_new_tokens")]
    for section, key in positive:
        if getattr(getattr(config, section), key) <= 0:
            raise reader.fail((section, key), f"'{section}.{key}' must be greater than 0")
    if not 0 <= config.lora.dropout < 1:
        raise reader.fail(("lora", "dropout"), "'lora.dropout' must be in [0, 1)")
    if config.trainer.learning_rate <= 0:
        raise reader.fail(("trainer", "learning_rate"), "'trainer.learning_rate' must be > 0")
    if not 0 <= config.trainer.warmup_fraction < 1:
        raise reader.fail(("trainer", "warmup_fraction"), "'trainer.warmup_fraction' must be in [0, 1)")
    if not 0 < config.data.sample_ratio <= 1:
        raise reader.fail(("data", "sample_ratio"), "'data.sample_ratio' must be in (0, 1]")
    if not 0 <= config.data.val_fraction + config.data.test_fraction < 1:
        raise reader.fail(("data", "val_fraction"),
                          "'data.val_fraction' + 'data.test_fraction' must be below 1")
    if config.trainer.max_steps is not None and config.trainer.max_steps <= 0:
        raise reader.fail(("trainer", "max_steps"), "'trainer.max_steps' must be > 0 (or null)")
    return config


def parse_config(text: str, source: str = "config") -> RunConfig:
    """Read a config from YAML text (Studio or Ludwig layout). ``source`` names it in errors."""
    try:
        raw = yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}: line {mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem}); check the indentation") from None
    lines = _KeyLines(text)
    reader = _Reader(source, lines)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys to values")
    if "model_type" in raw or "base_model" in raw or "input_features" in raw:
        raw = from_ludwig(raw, reader)
        reader = _Reader(source, {})  # keys were renamed, so their lines no longer apply
    config = reader.build(RunConfig, raw, ())
    return validate(config, source, lines)


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML config file; every problem is a ConfigError naming the file (and line)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file; check the path (or run 'studio config dump' "
                          "for a starting point)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc})") from None
    return parse_config(text, str(path))


def default_config() -> RunConfig:
    """The config `studio` uses with no arguments: the bundled sample data and the default model."""
    from studio.core.paths import sample_data_dir

    config = RunConfig()
    sample = sample_data_dir() / "code_alpaca_sample.jsonl"
    if sample.exists():
        config.data.path = str(sample)
    return config
