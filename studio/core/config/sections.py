"""The run configuration: typed dataclasses <-> YAML, with Ludwig-style LLM keys accepted.

A config file is either Studio's own layout (sections ``model``, ``quantization``, ``lora``,
``prompt``, ``data``, ``trainer``, ``generation``, ``distributed``) or a Ludwig LLM config (``model_type: llm``,
``base_model``, ``adapter``, ``trainer: {type: finetune, ...}``); :func:`load_config` detects which
and returns a :class:`RunConfig`. Errors name the file, the line and the key, and suggest the
nearest known key.

Plain Python and PyYAML only: the UI imports this. Past 400 lines because every field carries its
docstring (this file is the config's reference). Reading and checking a config file is
:mod:`studio.core.config.load`; YAML into the dataclasses, :mod:`studio.core.config.reader`; the YAML
itself, :mod:`studio.core.config.safe_yaml`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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

    target_experts: bool = False
    """A mixture of experts (Qwen3-MoE, OLMoE, Mixtral): give every expert its own adapter on its
    gate/up and down weights too (PEFT's ``target_parameters``, so the adapter loads with
    ``PeftModel``). The experts hold most of what such a model knows; their adapters add
    r x (in + out) parameters per expert, projection and sparse layer, with their gradients and
    optimizer state (Qwen3-30B-A3B at r 16: 0.63B parameters, 10 GB in training). Off: the
    experts stay frozen and only ``target_modules`` train. An error on a dense model."""

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
    stream's gradient, the attention of soft-capped scores and sinks: Gemma 2, gpt-oss; a mixture of
    experts' activation and sums, and its products reading 4-bit experts as stored where each expert
    gets few rows). False: torch
    operations and bitsandbytes' dequantization, slower; for a card or a Triton where a kernel
    misbehaves (a kernel that fails to build is given up on anyway, with a warning)."""

    cuda_graphs: bool = True
    """Replay the decoder stack's forward and backward as CUDA graphs for micro-batches of up to
    4096 tokens, which takes the host's per-operation cost out of the step (the larger a step, the
    less it matters). False: every step runs eagerly, slower at small micro-batches, without the
    graphs' private memory pools."""

    host_offload: bool = True
    """Keep each layer's checkpointed input, and its rotated q, k and v (with Studio's fused
    attention, Gemma 2's and gpt-oss', its output and log-sum-exp too), in pinned host memory
    between the forward and the backward, copied behind the compute (the layer inputs alone are
    about 2 GB for a 7B model at 8192 tokens a micro-batch). False: they stay on the GPU, and the
    recomputation runs the q/k/v products and the attention again (no host memory pinned, no PCIe
    traffic)."""


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

    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: the weight of the router's load-balancing loss added to the
    training loss (transformers' ``load_balancing_loss_func``; 0.001-0.01 typical). None (the
    default): as transformers trains the model, its config's ``router_aux_loss_coef`` where its
    ``output_router_logits`` is set, else none. Keeping it on with a GPU's fast path keeps the
    layer inputs on the GPU (their gradient needs torch's checkpointing)."""

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
