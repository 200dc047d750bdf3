"""The run configuration: typed dataclasses <-> YAML, with Ludwig-style LLM keys accepted.

A config file is either Studio's own layout (sections ``model``, ``quantization``, ``lora``,
``prompt``, ``data``, ``trainer``, ``generation``, ``distributed``) or a Ludwig LLM config (``model_type: llm``,
``base_model``, ``adapter``, ``trainer: {type: finetune, ...}``); :func:`load_config` detects which
and returns a :class:`RunConfig`. Errors name the file, the line and the key, and suggest the
nearest known key.

Plain Python and PyYAML only: the UI imports this. Past 400 lines because every field carries its
docstring (this file is the config's reference); reading YAML into the dataclasses is in
:mod:`studio.core.config.reader`, the YAML itself in :mod:`studio.core.config.safe_yaml`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from studio.core.config.ludwig import from_ludwig
from studio.core.config.reader import ConfigError as ConfigError  # re-exported: callers import it from here
from studio.core.config.reader import ConfigNote as ConfigNote
from studio.core.config.reader import KeyLines, Reader

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

AUTO = "auto"
"""The value of ``trainer.micro_batch_size`` / ``trainer.gradient_checkpointing`` that lets Studio
plan them for the card at the start of a run (studio/core/memory/autoplan.py)."""

CPU_MICRO_BATCH_SIZE = 4
"""What ``micro_batch_size: auto`` means without a CUDA card (and until a run has planned it): the
default before ``auto`` existed, so CPU runs train as they always did."""

CPU_GRADIENT_CHECKPOINTING = True
"""What ``gradient_checkpointing: auto`` means without a CUDA card (and until a run has planned it)."""


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

    on_cpu: str = "full"
    """Without a CUDA GPU: ``full`` loads the base unquantized (4-bit and 8-bit save GPU memory; on a
    CPU their kernels only cost time, often 10x), ``keep`` quantizes anyway."""


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

    use_dora: bool = False
    """DoRA (PEFT's ``use_dora``): split each adapted weight into a magnitude vector and a direction
    that LoRA updates; often closer to full fine-tuning at low rank, ~10-20% slower a step."""

    use_rslora: bool = False
    """rsLoRA (PEFT's ``use_rslora``): scale the update by alpha / sqrt(r) instead of alpha / r, so
    high ranks keep learning at the same rate."""


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

    rejected_field: str = "rejected"
    """Preference runs (``trainer.method`` dpo or orpo): the field holding the rejected answer. The
    chosen answer is ``response_field``'s; both render through the same template (docs/preference.md)."""


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
class FastPathConfig:
    """The fast training path's parts a person may turn off (docs/speed.md). It runs on a CUDA card
    for the models and setups it covers (core/plan.py's ``choose_path``); these keys change how,
    never whether, and the loss is the same function either way. All on by default."""

    kernels: bool = True
    """Triton kernels: liger-kernel's RMSNorm, RoPE, SwiGLU and cross-entropy fused with the output
    projection (when it is installed), and Studio's own (4-bit weights dequantized in one pass, the
    LoRA update added inside SwiGLU and the residual's add, the norms' backward summing the residual
    stream's gradient). False: torch operations and bitsandbytes' dequantization, slower; for a card
    or a Triton where a kernel misbehaves (a kernel that fails to build is given up on anyway, with
    a warning)."""

    cuda_graphs: bool = True
    """Replay the decoder stack's forward and backward as CUDA graphs for micro-batches of up to
    4096 tokens, which takes the host's per-operation cost out of the step (the larger a step, the
    less it matters). False: every step runs eagerly, slower at small micro-batches, without the
    graphs' private memory pools."""

    host_offload: bool = True
    """Keep each layer's checkpointed input, and its rotated q, k and v, in pinned host memory
    between the forward and the backward, copied behind the compute (the layer inputs alone are
    about 2 GB for a 7B model at 8192 tokens a micro-batch). False: they stay on the GPU, and the
    recomputation runs the q/k/v products again (no host memory pinned, no PCIe traffic)."""


@dataclass
class TrainerConfig:
    """The optimisation loop."""

    learning_rate: float = 2e-4
    """Peak learning rate, reached after warmup."""

    epochs: float = 1.0
    """Passes over the training rows; ignored when ``max_steps`` is set."""

    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides ``epochs``)."""

    micro_batch_size: int | str = AUTO
    """Examples per forward/backward pass: what must fit in GPU memory. ``auto`` (the default): on a
    CUDA card the run picks the fastest one that fits the card with headroom, keeping the effective
    batch through accumulation (docs/memory.md, "automatic plan"); without one, 4."""

    effective_batch_size: int | None = 16
    """Examples per optimizer step on one GPU; gradient accumulation = effective / micro batch. On
    several GPUs (``distributed.gpus``) each takes this many, so a step takes this x gpus."""

    gradient_accumulation_steps: int | None = None
    """Set directly instead of ``effective_batch_size`` (Ludwig style); None to derive it."""

    warmup_fraction: float = 0.03
    """Fraction of the steps spent warming the learning rate up from 0."""

    scheduler: str = "cosine"
    """Learning-rate schedule after warmup: ``cosine``, ``linear`` or ``constant``."""

    optimizer: str = "adamw"
    """``adamw`` (torch), ``adamw_8bit``, ``paged_adamw`` (32-bit state in unified memory, which spills
    to host RAM under pressure) or ``paged_adamw_8bit`` (bitsandbytes)."""

    weight_decay: float = 0.0
    """AdamW weight decay on the adapter weights."""

    max_grad_norm: float = 1.0
    """Clip the gradient norm to this; 0 disables clipping."""

    gradient_checkpointing: bool | str = AUTO
    """Recompute activations in the backward pass: far less memory for ~30% more compute. ``auto``
    (the default): on a CUDA card the run turns it off when the plan without it fits and is faster;
    without one, on."""

    packing: bool = True
    """Pack several examples into one row without padding (each attends only to itself)."""

    eval_interval: int = 50
    """Evaluate on the validation split every this many steps; the base model is evaluated before the
    first step and the fine-tune at the end either way (0: only those two)."""

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

    method: str = "sft"
    """``sft`` (learn the responses), ``dpo`` (direct preference optimisation: prefer the chosen answer
    over the rejected one, against the base as reference), ``orpo`` (odds-ratio preference plus the
    chosen answer's loss; no reference) or ``grpo`` (reinforcement learning from rewards your code
    computes on sampled answers: the ``grpo`` section). Preference data: docs/preference.md; GRPO:
    docs/grpo.md."""

    beta: float = 0.1
    """Preference strength. DPO: the temperature of the implicit reward (0.1-0.5 typical; lower
    strays further from the base). ORPO: the weight of the odds-ratio term (the paper's lambda)."""

    fast_path: FastPathConfig = field(default_factory=FastPathConfig)
    """Which parts of the fast training path run (CUDA only; ``STUDIO_FAST_PATH=0`` turns the whole
    path off)."""

    def micro_batch(self) -> int:
        """The micro-batch size as a number: the configured one, or for ``auto`` (not yet planned by
        a run) :data:`CPU_MICRO_BATCH_SIZE`."""
        return CPU_MICRO_BATCH_SIZE if self.micro_batch_size == AUTO else int(self.micro_batch_size)

    def checkpointing(self) -> bool:
        """Gradient checkpointing as a boolean: the configured one, or for ``auto`` (not yet planned
        by a run) :data:`CPU_GRADIENT_CHECKPOINTING`."""
        if self.gradient_checkpointing == AUTO:
            return CPU_GRADIENT_CHECKPOINTING
        return bool(self.gradient_checkpointing)

    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step, from the explicit value or the effective batch."""
        if self.gradient_accumulation_steps:
            return max(1, int(self.gradient_accumulation_steps))
        if self.effective_batch_size:
            return max(1, math.ceil(self.effective_batch_size / max(1, self.micro_batch())))
        return 1

    def effective_batch(self, processes: int = 1) -> int:
        """Examples per optimizer step as trained: micro-batch x accumulation x ``processes`` (GPUs,
        each taking its own micro-batches). Above ``effective_batch_size`` when the micro-batch does
        not divide it (accumulation rounds up)."""
        return effective_batch(self.micro_batch(), self.accumulation_steps(), processes)


def effective_batch(micro_batch: int, accumulation: int, processes: int = 1) -> int:
    """Examples per optimizer step over every process: micro-batch x accumulation x processes. The
    one place Studio multiplies them (a config's :meth:`TrainerConfig.effective_batch`, a run's
    events, the estimate and the panes all ask here)."""
    return micro_batch * accumulation * max(1, processes)


@dataclass
class DistributedConfig:
    """Data-parallel training on several GPUs of this machine (docs/multigpu.md)."""

    gpus: int | str = 1
    """How many GPUs train the run: 1, a number (each gets a copy of the model and a share of every
    step's rows; torchrun starts one process a GPU), or ``all`` (every GPU this process can see).
    The effective batch is micro-batch x accumulation x gpus; ``studio train --gpus N`` overrides."""


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
class RewardConfig:
    """One reward of a GRPO run (docs/grpo.md): a built-in or your own Python function. In YAML a
    bare name (``- exact_match``, ``- my_rewards.py:format_ok``) stands for ``{name: ...}``."""

    name: str = ""
    """A built-in (``exact_match``, ``regex``, ``number_match``, ``length``) or your own function as
    ``file.py:function`` (relative to the config file) or ``package.module:function``, with TRL's
    signature ``f(completions, prompts, **columns) -> list[float | None]`` (None: does not apply)."""

    weight: float = 1.0
    """How much this reward counts: a completion's total is the sum of weight x score."""

    column: str | None = None
    """``exact_match`` and ``number_match``: the data column holding the right answer."""

    pattern: str | None = None
    """``regex``: a Python regular expression; 1.0 when it is found in the completion (anchor it with
    ^ and $ to match the whole completion), else 0.0."""

    max_chars: int | None = None
    """``length``: 1.0 for a completion of at most this many characters, falling linearly to 0.0 at
    twice as many."""


@dataclass
class GrpoConfig:
    """Group relative policy optimisation (``trainer.method: grpo``; docs/grpo.md): for each prompt
    the policy (the model with its LoRA) samples a group of completions, the rewards score them, and
    each completion is pushed up or down by how it scored against its group."""

    num_generations: int = 8
    """Completions sampled for each prompt (the group). A step's prompts are
    ``trainer.effective_batch_size``; ``micro_batch_size`` counts prompts too."""

    max_completion_length: int = 256
    """Most tokens a completion may have. Prompts are cut from their start to fit
    ``data.max_seq_length`` minus this."""

    temperature: float = 1.0
    """Sampling temperature of the completions (above 0; 1.0 samples the policy as it is)."""

    beta: float = 0.0
    """Weight of the KL divergence to the base model (the adapters switched off); 0 skips the
    reference pass, as current GRPO recipes do."""

    loss: str = "grpo"
    """``grpo``: each completion's token losses averaged over its own length, then over the
    completions; ``dr_grpo``: summed over every token and divided by completions x
    ``max_completion_length`` (no preference for short or long answers)."""

    rewards: list[RewardConfig] = field(default_factory=list)
    """The reward functions; each completion's reward is their weighted sum."""


@dataclass
class RunConfig:
    """Everything one fine-tuning run needs; saved as ``runs/<id>/config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The base model."""

    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    """How base weights are stored."""

    lora: LoraConfig | None = field(default_factory=LoraConfig)
    """The adapter; ``null`` (or ``false``) fine-tunes every weight instead (full fine-tuning: no
    adapter, the base in the compute dtype; docs/config.md)."""

    prompt: PromptConfig = field(default_factory=PromptConfig)
    """Row -> text."""

    data: DataConfig = field(default_factory=DataConfig)
    """The dataset."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Answer defaults."""

    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """How many GPUs train it."""

    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    """GRPO's sampling, loss and rewards (used when ``trainer.method`` is grpo)."""

    output_dir: str = "runs"
    """Folder under which each run gets its own directory."""

    name: str | None = None
    """A label for the run; the run id is made from the time and this (or the model)."""

    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that also get the run's metrics: any of ``tensorboard`` (written under
    ``runs/<id>/tensorboard``), ``wandb``, ``mlflow``. Needs ``pip install 'qlora-studio[trackers]'``."""

    @property
    def full_finetune(self) -> bool:
        """True when every weight trains (``lora: null``): no adapter, the base unquantized."""
        return self.lora is None

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, every default filled in (the ``grpo`` section only when
        ``trainer.method`` is grpo: other runs do not read it)."""
        data = dataclasses.asdict(self)
        if self.trainer.method != "grpo":
            del data["grpo"]
        return data

    def to_yaml(self) -> str:
        """The config as YAML that :func:`load_config` reads back unchanged."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True, width=100)

    def save(self, path: str | Path) -> None:
        """Write the config as YAML to ``path`` (atomically: a temp file, then rename). A file that
        exists keeps its permissions: a run's config is private (0600) and a rewrite (``--resume
        --max-steps``) must not open it to other users."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_yaml())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        tmp.replace(path)


# ------------------------------------------------------------------------------------- checking

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
