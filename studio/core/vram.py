"""Predict where the GPU memory of a fine-tuning run goes, by category, before loading anything.

The prediction follows what HF transformers + PEFT + bitsandbytes actually keep alive on a CUDA
device during a training step, tensor by tensor (checked against H100 measurements:
bench/vram_accuracy.py, bench/rescore_vram.py, docs/memory.md), and reports it in the categories the gauge draws and
``engine/memory.py`` measures: weights, lora, gradients, optimizer, activations, overhead.

The peak of a step is the largest of three moments:

* the start of the backward pass (every saved activation, the logits and the loss's fp32 copies);
* the backward of one layer (with checkpointing: every layer's input, plus one recomputed layer);
* the optimizer step (gradients plus the optimizer's temporaries; activations are gone).

Two paths: :func:`estimate` asks core/plan.py which one the engine will take (the function the
engine calls itself) and models that one: the plain path here, the GPU fast path in
core/vram_fast.py. This module stays one piece past 400 lines because the plain path's moments, pools
and allocator rules are one model whose parts share their intermediate sizes.

Plain Python: the UI and ``studio estimate`` import this; it must never import torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from studio.core.config import RunConfig
from studio.core.model_info import ModelInfo
from studio.core.plan import KEEP_ATTENTION_FROM, KEEP_QKV, PathChoice, PathFacts, choose_path

CATEGORIES = ("weights", "lora", "gradients", "optimizer", "activations", "overhead")
"""Category keys, in drawing order; engine/memory.py measures the same ones."""

CUDA_CONTEXT_BYTES = 758 * 2**20
"""CUDA context, library handles and loaded kernels: on the card (nvidia-smi shows it) but outside
torch's counters. Measured through NVML on an H100 (torch 2.11, CUDA 13): 610 MiB for the bare
context, 676 MiB once cuBLAS is up, 758 MiB in both QLoRA training runs of
bench/results/vram_overhead_check_h100.json. Other drivers and cards differ by some 100 MiB."""

CUBLAS_WORKSPACE_BYTES = 32 * 2**20
"""cuBLAS workspace, allocated through torch's caching allocator on the first matmul."""

STEP_WORKSPACES = 2
"""cuBLAS workspaces of an eager run: torch keeps one per thread and stream that ran a product, and
products run on the default stream from the main thread (forward) and autograd's (backward)."""

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5, "fp4": 0.5}
_QUANT_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax constant per 64 weights
_NESTED_BLOCK = 256  # double quant: one fp32 constant per 256 absmax bytes
_OPTIM8_BLOCK = 256  # bitsandbytes 8-bit optimizers: one fp32 absmax per 256 state bytes
_OPTIM8_MIN_SIZE = 4096  # smaller tensors keep 32-bit optimizer state in bitsandbytes


@dataclass(frozen=True)
class Plan:
    """A training setup as the estimator sees it; :func:`plan_for` maps a RunConfig onto one."""

    weights: str = "nf4"
    """How frozen linear weights are stored: nf4, fp4, int8, bf16, fp16 or fp32."""

    double_quant: bool = True
    """4-bit only: quantize the absmax constants too (8-bit per 64 weights, not fp32)."""

    compute: str = "bf16"
    """Matmul dtype under autocast: bf16, fp16, or fp32 (no autocast)."""

    lora_r: int | None = 16
    """Adapter rank; None means full fine-tuning (every weight trains)."""

    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                     "down_proj")
    """Linear modules that get an adapter."""

    lora_dropout: float = 0.05
    """Adapter dropout; above 0 it keeps a one-byte mask per input element of each adapter."""

    micro_batch: int = 4
    """Sequences per forward pass."""

    seq_len: int = 512
    """Tokens per sequence (packed rows are full length)."""

    checkpointing: bool = True
    """Gradient checkpointing: keep only each layer's input, recompute the rest in backward."""

    optimizer: str = "adamw"
    """adamw (torch, state in the parameter's dtype), paged_adamw (32-bit, in unified memory),
    adamw_8bit or paged_adamw_8bit."""

    dora: bool = False
    """DoRA: each adapted module also trains a magnitude vector (one value per output feature)."""

    accumulation: int = 1
    """Micro-batches per optimizer step; above 1 gradients stay alive through the forward pass."""

    attention: str = "sdpa"
    """sdpa / flash (memory linear in length) or eager (keeps seq x seq scores per head)."""

    expandable_segments: bool = True
    """PyTorch's caching allocator mode (PYTORCH_CUDA_ALLOC_CONF). True, what Studio's engine sets
    unless the environment says otherwise: one growing mapping per pool, so reserved memory is the
    allocated peak rounded up to 2 MiB pages. False: PyTorch's default fixed-size segments, which
    cache freed blocks (see :func:`_moments` for what that costs)."""

    path: str = "plain"
    """The training path the engine takes (core/plan.py's choose_path): ``plain`` (transformers +
    PEFT + bitsandbytes, modelled tensor by tensor below) or ``fast`` (studio/engine/fast/:
    core/vram_fast.py)."""

    sequences_per_example: int = 1
    """2 for preference runs (DPO, ORPO): a pair is its chosen and its rejected answer, padded rows."""

    reference_pass: bool = False
    """DPO: one more forward per micro-batch, through the base (adapter off) without gradients. It
    runs after the policy's forward, and its logits (compute dtype plus an fp32 copy of the answer
    positions) are smaller than the loss moment's, which also holds the gradients of the fp32 logits:
    it costs time, not peak memory."""

    packing: bool = True
    """``trainer.packing``: rows packed into ``seq_len``-long streams (every micro-batch full), or
    one example a row, padded to the micro-batch's longest."""

    lengths: tuple[int, ...] = ()
    """Token lengths of the training examples, longest first, each capped at ``seq_len``, when the
    data was read (:mod:`studio.core.vram_lengths`); empty: every row is taken as ``seq_len`` long.
    Only unpacked runs use it (packed micro-batches fill ``seq_len``)."""

    generate_prompt_tokens: int | None = None
    """The generation phase's prompt (chat), in tokens; None: as long as a training row (``seq_len``)."""

    generate_new_tokens: int = 128
    """The generation phase's answer length (``generation.max_new_tokens``)."""

    loss: str = "trainer"
    """How the plain path's loss is computed: ``trainer``, as Studio's Trainer does (an fp32 copy of
    the response positions' logits only: engine/train.py), or ``hf``, transformers' own loss from
    ``labels`` (every position's logits upcast, as the benchmark's reference loop runs it)."""

    prefill_tokens: int | None = None
    """Tokens of the generation prompt's pass at a time: None, as the engine runs it
    (core/vram_phases.py's PREFILL_TOKENS); 0, the whole prompt in one pass (the engine before it
    ran prompts in pieces; the benchmark's older measurements)."""

    kv_cache: str = "auto"
    """Where the generation phase keeps its KV cache: ``auto``, as the engine decides (on the host
    when on the card it would need more than the training step: core/vram_phases.py), or ``card``,
    always on the card (what the engine did before it could keep it on the host; the benchmark's
    older measurements)."""

    packed_layouts: int = 1
    """CUDA-graph layouts alive at once in a packed run of short examples: 1, as the engine runs it
    (a fuller micro-batch widens the one layout: engine/fast/model.py's _static_layout), or 2, what
    the engine kept before (one layout per example count bucket; the benchmark's older measurements)."""

    fused_layer: bool = True
    """The fast path's decoder layer as the engine runs it since 09fac3a (engine/fast/layer.py,
    weights.py): q, k and v from their own products (RoPE rotates them where they are, and their
    gradients are not concatenated), each LoRA'd product writing its output onto the residual stream
    (no separate sums), and the recomputation for the backward skipping the down projection. False:
    the layer before (a fused q/k/v output that RoPE copied q and k out of, separate residual sums,
    down recomputed), for the benchmark's older measurements (core/vram_fast.py's ``UNFUSED``)."""

    kept_qkv: bool = KEEP_QKV
    """The fast path keeps each offloaded layer's rotated q, k and v on the host for its
    recomputation (core/plan.py's ``KEEP_QKV``; one more layer's q, k and v on the device, brought
    back ahead of its backward). False: the engine before, which recomputed them (the benchmark's
    older measurements: their engine's description lacks "q/k/v kept on the host")."""

    keep_attention_from: int | None = KEEP_ATTENTION_FROM
    """With ``kept_qkv``, micro-batches whose longest example has at least this many tokens keep
    each layer's attention output on the host too (core/plan.py's ``KEEP_ATTENTION_FROM``; one
    more layer's output on the device). None: the engine before, which recomputed the attention
    (the benchmark's older measurements: their engine's description lacks "attention kept")."""

    @property
    def kept_attention(self) -> bool:
        """Whether the fast path keeps the attention for this plan's rows (:attr:`keep_attention_from`)."""
        return (self.kept_qkv and self.keep_attention_from is not None
                and self.row_len >= self.keep_attention_from)

    @property
    def data_sized(self) -> bool:
        """Whether the step is sized from the data's token lengths (unpacked SFT with lengths known)
        rather than taking every row as ``seq_len`` long."""
        return bool(self.lengths) and not self.packing and self.sequences_per_example == 1

    @property
    def row_len(self) -> int:
        """Width of a micro-batch's rows: ``seq_len``, or the data's longest example (capped)."""
        return min(self.seq_len, self.lengths[0]) if self.data_sized else self.seq_len

    @property
    def real_tokens(self) -> int:
        """Tokens of the largest micro-batch without its padding (what the fast path, which unpads,
        computes on): the sum of the ``micro_batch`` longest examples when sized from the data (no
        micro-batch can hold more), else :attr:`tokens`."""
        if self.data_sized:
            return sum(min(self.seq_len, n) for n in self.lengths[:self.micro_batch])
        return self.tokens

    @property
    def quantized(self) -> bool:
        """True for 4-bit and 8-bit base weights (loaded through bitsandbytes)."""
        return self.weights in ("nf4", "fp4", "int8")

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch as the model sees it, padding included (a preference pair
        counts both of its sequences): micro-batch x :attr:`row_len`."""
        return self.micro_batch * self.sequences_per_example * self.row_len


@dataclass
class Estimate:
    """Predicted memory of one training step, in bytes."""

    categories: dict[str, int]
    """Bytes per category (keys in :data:`CATEGORIES`); they sum to ``total``."""

    total: int
    """Everything that must fit on the card: peak reserved by torch plus the CUDA context."""

    capacity: int | None
    """The card's memory in bytes, or None when no card was given."""

    fits: bool | None
    """``total <= capacity``; None without a capacity."""

    max_micro_batch: int | None
    """The largest micro-batch whose total fits (0: not even 1), or None without a capacity."""

    peak_allocated: int
    """Predicted ``torch.cuda.max_memory_allocated()`` over a step."""

    peak_reserved: int
    """Predicted ``torch.cuda.max_memory_reserved()`` over a step."""

    plan: Plan
    """The setup this estimate is for."""

    notes: list[str] = field(default_factory=list)
    """Caveats a person should read (paged state, unknown model parts, ...)."""

    choice: PathChoice | None = None
    """The engine's path decision this estimate follows (core/plan.py), with its reason; None for
    estimates of a bare Plan (the walkthrough's steps, the benchmark's rows)."""

    phases: dict = field(default_factory=dict)
    """Each phase of a run (core/vram_phases.py's PHASES: training step, evaluation, generation,
    checkpoint save) and its :class:`~studio.core.vram_phases.PhasePeak`; the peaks above are the
    largest of them."""

    peak_phase: str = "training step"
    """The phase that sets the peak reserved memory (and the categories, which are that moment's)."""

    step_categories: dict[str, int] = field(default_factory=dict)
    """The training step's categories (what engine/memory.py measures during a step); the same as
    ``categories`` when the step sets the peak."""

    @property
    def path(self) -> str:
        """``fast`` or ``plain``: the training path this estimate models."""
        return self.plan.path

    def to_json_dict(self) -> dict:
        """The ``studio estimate --json`` shape: categories, total, capacity, fits, max_micro_batch,
        the path (``fast`` or ``plain``) and the plan it assumed."""
        plan = {"weights": self.plan.weights, "compute": self.plan.compute, "lora_r": self.plan.lora_r,
                "lora_targets": list(self.plan.lora_targets), "lora_dropout": self.plan.lora_dropout,
                "micro_batch": self.plan.micro_batch, "seq_len": self.plan.seq_len,
                "checkpointing": self.plan.checkpointing or self.plan.path == "fast",
                "optimizer": self.plan.optimizer, "accumulation": self.plan.accumulation,
                "expandable_segments": self.plan.expandable_segments}
        if self.choice is not None:
            plan.update(self.choice.to_json_dict())
        else:
            plan["path"] = self.plan.path
        plan["token_lengths"] = ({"source": "data", "longest": self.plan.row_len,
                                  "micro_batch_tokens": self.plan.real_tokens, "examples": len(self.plan.lengths)}
                                 if self.plan.data_sized else {"source": "max_seq_length"})
        return {"categories": dict(self.categories), "total": self.total, "capacity": self.capacity,
                "fits": self.fits, "max_micro_batch": self.max_micro_batch, "path": self.plan.path, "plan": plan,
                "peak_phase": self.peak_phase,
                "phases": {name: peak.to_json_dict() for name, peak in self.phases.items()}}


def expandable_segments_from_env(alloc_conf: str | None) -> bool:
    """Whether Studio's engine runs with expandable segments, given PYTORCH_CUDA_ALLOC_CONF.

    Unset (None), the engine sets ``expandable_segments:True``; a value set by the user wins, and
    PyTorch leaves expandable segments off unless that value turns them on.
    """
    if alloc_conf is None:
        return True
    for option in alloc_conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip() == "True"
    return False


def plan_for(config: RunConfig, micro_batch: int | None = None, attention: str = "sdpa",
             expandable_segments: bool | None = None, lengths: tuple[int, ...] = (),
             info: ModelInfo | None = None) -> Plan:
    """The Plan a RunConfig describes (4-bit NF4 QLoRA by default).

    ``expandable_segments`` None means what Studio's engine will use in this environment
    (:func:`expandable_segments_from_env` of PYTORCH_CUDA_ALLOC_CONF). ``lengths``: the training
    examples' token lengths when the data was read (core/vram_lengths.py), else every row is taken
    as ``data.max_seq_length`` long. ``info``: the model, whose module names the LoRA targets take
    (``ModelInfo.lora_targets``: all-linear, Phi-3's fused modules); without it, Llama's names.
    """
    q = config.quantization
    compute = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[q.compute_dtype]
    weights = {4: q.quant_type, 8: "int8"}.get(q.bits, compute) if q.bits else compute
    lora = config.lora
    targets = lora.target_modules if lora is not None else ()
    if info is not None:
        names = info.lora_targets(targets) if lora is not None else ()
    else:
        names = ALL_LINEAR if targets == "all-linear" else tuple(t for t in targets)
    accumulation = config.trainer.accumulation_steps()
    return Plan(weights=weights, double_quant=q.double_quant, compute=compute,
                lora_r=lora.r if lora is not None else None, lora_targets=names,
                lora_dropout=lora.dropout if lora is not None else 0.0,
                dora=lora.use_dora if lora is not None else False,
                micro_batch=micro_batch or config.trainer.micro_batch(),
                seq_len=config.data.max_seq_length, checkpointing=config.trainer.checkpointing(),
                optimizer=config.trainer.optimizer, accumulation=accumulation, attention=attention,
                expandable_segments=(expandable_segments_from_env(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
                                     if expandable_segments is None else expandable_segments),
                sequences_per_example=2 if config.trainer.method in ("dpo", "orpo") else 1,
                reference_pass=config.trainer.method == "dpo", packing=config.trainer.packing,
                lengths=tuple(lengths), generate_new_tokens=config.generation.max_new_tokens)


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What PEFT's ``all-linear`` means for a Llama-architecture model (lm_head excluded)."""


# ------------------------------------------------------------------------------------ parameters


def lora_params(info: ModelInfo, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: r x (in + out) per targeted linear module, in every layer."""
    shapes = info.linear_shapes()
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"lora.target_modules: {', '.join(unknown)} not in the model "
                         f"(known: {', '.join(shapes)}, or all-linear)")
    return info.layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


def _quant_constants(n: int, plan: Plan) -> float:
    """Bytes of bitsandbytes quantization constants for one weight matrix of ``n`` elements."""
    if plan.weights in ("nf4", "fp4"):
        blocks = math.ceil(n / _QUANT_BLOCK)
        if plan.double_quant:
            # uint8 absmax per block, fp32 absmax per 256 of those, a 256-entry fp32 code, an offset
            return blocks + 4 * math.ceil(blocks / _NESTED_BLOCK) + 1024 + 4 + 64
        return 4 * blocks + 64
    if plan.weights == "int8":
        return 0.0  # the per-row scales are added by the caller (they depend on the shape)
    return 0.0


def weight_bytes(info: ModelInfo, plan: Plan) -> int:
    """Bytes of the base model's parameters, as loaded and prepared for training.

    Quantized linears: packed data plus constants. Everything else (embeddings, lm_head, norms) is
    in the compute dtype, except after ``prepare_model_for_kbit_training`` (which Studio runs for
    4-bit and 8-bit), which casts all of it to fp32.
    """
    shapes = info.linear_shapes()
    linear = 0.0
    for fan_in, fan_out in shapes.values():
        n = fan_in * fan_out
        linear += n * _DTYPE_BYTES[plan.weights] + _quant_constants(n, plan)
        if plan.weights == "int8":
            linear += 4 * fan_out  # fp32 scale per output row (SCB)
    other = info.embedding_params() + info.head_params() + info.norm_params() + info.vision_params
    if plan.lora_r is None:  # full fine-tuning: everything in the weights' dtype (int8: illustrative)
        other_bytes = _DTYPE_BYTES[plan.compute if plan.quantized else plan.weights]
    else:
        other_bytes = 4 if plan.quantized else _DTYPE_BYTES[plan.compute]
    return int(info.layers * linear + other * other_bytes)


def trainable_params(info: ModelInfo, plan: Plan) -> int:
    """Parameters that get gradients and optimizer state."""
    if plan.lora_r is None:
        return info.total_params()
    return lora_params(info, plan.lora_r, plan.lora_targets) + dora_params(info, plan)


def dora_params(info: ModelInfo, plan: Plan) -> int:
    """DoRA's magnitude vectors: one value per output feature of every adapted module (0 without DoRA)."""
    if not plan.dora or plan.lora_r is None:
        return 0
    shapes = info.linear_shapes()
    return info.layers * sum(shapes[t][1] for t in plan.lora_targets if t in shapes)


def _trainable_dtype_bytes(plan: Plan) -> int:
    # PEFT keeps adapters in fp32 (autocast_adapter_dtype); full fine-tuning trains the weights as
    # stored (int8 weights cannot take updates: the walkthrough shows that step with bf16 updates)
    if plan.lora_r is not None:
        return 4
    return 2 if plan.quantized else int(_DTYPE_BYTES[plan.weights])


def optimizer_bytes(info: ModelInfo, plan: Plan) -> int:
    """Optimizer state: torch AdamW's m and v in the parameter's dtype (bf16 weights of a full
    fine-tune: 4 B a parameter), bitsandbytes' 32-bit paged AdamW's in fp32 whatever the parameter's
    dtype (8 B), or bitsandbytes 8-bit blocks."""
    n = trainable_params(info, plan)
    if plan.optimizer == "adamw":
        return 2 * n * _trainable_dtype_bytes(plan)
    if plan.optimizer == "paged_adamw":
        return 2 * n * 4
    # 8-bit: one byte per element for m and v, plus an fp32 absmax per 256; tensors under 4096
    # elements keep 32-bit state (bitsandbytes' min_8bit_size).
    small = _small_tensor_params(info, plan)
    big = n - small
    return int(2 * (big + 4 * math.ceil(big / _OPTIM8_BLOCK)) + 8 * small)


def _lora_matrix_sizes(info: ModelInfo, plan: Plan) -> list[int]:
    """Elements of each LoRA matrix (A: r x fan_in, B: fan_out x r) of one layer."""
    shapes = info.linear_shapes()
    return [plan.lora_r * fan for t in plan.lora_targets for fan in shapes[t]]


def _small_tensor_params(info: ModelInfo, plan: Plan) -> int:
    """Trainable parameters in tensors too small for 8-bit optimizer state."""
    if plan.lora_r is None:
        return info.norm_params()
    # DoRA's magnitude vectors are as wide as a module's output: thousands, at the 8-bit threshold
    magnitudes = [info.linear_shapes()[t][1] for t in plan.lora_targets] if plan.dora else []
    small = sum(n for n in (*_lora_matrix_sizes(info, plan), *magnitudes) if n < _OPTIM8_MIN_SIZE)
    return small * info.layers


# ----------------------------------------------------------------------------------- activations


def _bytes(dtype: str) -> int:
    return int(_DTYPE_BYTES[dtype])


def _stream_bytes(plan: Plan) -> int:
    """dtype size of the residual stream and of the projections' outputs.

    After prepare_model_for_kbit_training the embeddings are fp32, so the whole residual stream is
    fp32 and bitsandbytes returns each projection in its input's dtype (fp32). A bf16 base keeps
    everything in bf16; full fine-tuning runs in the weights' dtype.
    """
    if plan.lora_r is None:
        return _bytes(plan.compute) if plan.quantized else _bytes(plan.weights)
    return 4 if plan.quantized else _bytes(plan.compute)


def _input_saved(n: int, dtype: int, modules: tuple[str, ...], plan: Plan) -> float:
    """Bytes per token that the modules reading one input tensor (``n`` wide, ``dtype`` bytes) keep.

    A tensor kept by several consumers counts once; a per-module copy (autocast cast, dropout
    output) counts per module.
    """
    c = _bytes(plan.compute)
    full = plan.lora_r is None
    shared = False
    total = 0.0
    for name in modules:
        if full or plan.weights == "int8":
            # a trainable weight needs its input for the weight gradient; LLM.int8 keeps its input
            # too (for the input gradient), in the dtype it came in
            if full and dtype != c:
                total += c * n
            else:
                shared = True
        if full or name not in plan.lora_targets:
            continue
        total += c * (plan.lora_r or 0)  # lora_A's output, kept by lora_B
        if plan.lora_dropout > 0:
            total += n + c * n  # CUDA dropout keeps a one-byte mask; lora_A keeps its own input copy
        elif dtype != c or (not plan.quantized and c != 4):
            # autocast casts per call (PEFT's plain LoRA first casts to its fp32 weights)
            total += c * n
        else:
            shared = True
    return total + (dtype * n if shared else 0)


INT8_THRESHOLD = 6.0
"""LLM.int8's outlier threshold (BitsAndBytesConfig.llm_int8_threshold, which Studio leaves at 6)."""


def _normal_tail(x: float) -> float:
    """P(|z| >= x) for a standard normal z."""
    return math.erfc(x / math.sqrt(2))


def _swiglu_tail(sigma: float, threshold: float, steps: int = 2000) -> float:
    """P(|silu(g) * u| >= threshold) for independent g, u ~ N(0, sigma^2) (midpoint rule over g)."""
    lo, hi = -10.0, 10.0
    dz = (hi - lo) / steps
    total = 0.0
    for k in range(steps):
        z = lo + (k + 0.5) * dz
        g = sigma * z
        silu = abs(g / (1 + math.exp(-g)))
        if silu > 0:
            total += math.exp(-z * z / 2) * _normal_tail(threshold / (silu * sigma))
    return total * dz / math.sqrt(2 * math.pi)


def _columns_hit(p: float, rows: int) -> float:
    """Fraction of columns with at least one of ``rows`` values past the threshold (each with prob p)."""
    return -math.expm1(rows * math.log1p(-min(p, 1 - 1e-12)))


def int8_outlier_fractions(info: ModelInfo, plan: Plan) -> tuple[float, float]:
    """Fractions of input columns LLM.int8 keeps in full precision: (RMSNorm outputs, down_proj input).

    MatMul8bitLt splits every input column that holds an |x| >= 6 anywhere in the micro-batch out of
    the int8 matmul and keeps that slice (``subA``) for backward. The estimate assumes the statistics
    of a freshly initialised model: a normed input is ~N(0, 1), so outliers there are rare; the
    down projection reads silu(gate) * up, where gate and up are ~N(0, (init_std * sqrt(hidden))^2),
    which for a 7B-wide model puts an outlier in almost every column of a 1k-token batch and for a
    576-wide one in none. Trained weights have their own (unknown) statistics; see docs/memory.md.
    """
    rows = plan.tokens
    normed = _columns_hit(_normal_tail(INT8_THRESHOLD), rows)
    sigma = info.init_std * math.sqrt(info.hidden)
    return normed, _columns_hit(_swiglu_tail(sigma, INT8_THRESHOLD), rows)


def int8_kept_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes per token and layer that LLM.int8 keeps outside autograd's saved tensors.

    bitsandbytes' MatMul8bitLt stores its input and the outlier slice as plain ``ctx`` attributes,
    not through ``save_for_backward``, so gradient checkpointing's saved-tensor hooks never see them:
    every int8 linear's input survives the forward pass with or without checkpointing. Inputs are
    shared (q/k/v read one tensor, gate/up another); each module cuts its own outlier slice.
    """
    if plan.weights != "int8":
        return 0.0
    h, i = info.hidden, info.intermediate
    q = info.heads * info.head_width
    rs = _stream_bytes(plan)
    normed, down = int8_outlier_fractions(info, plan)
    inputs = rs * h + _bytes(plan.compute) * q + rs * h + rs * i  # q/k/v, o, gate/up, down
    outliers = rs * (5 * h * normed + i * down)  # the attention output into o_proj stays small
    return inputs + outliers


def layer_activation_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes one decoder layer keeps for backward, per token, without checkpointing."""
    h, i = info.hidden, info.intermediate
    q = info.heads * info.head_width
    kv = info.kv_heads * info.head_width
    c = _bytes(plan.compute)
    rs = _stream_bytes(plan)
    norm = 4 * h + (rs * h if plan.lora_r is None else 0)  # RMSNorm keeps its fp32 input
    total = 2 * norm
    total += _input_saved(h, rs, ("q_proj", "k_proj", "v_proj"), plan)
    total += rs * (q + kv)  # rotary embedding keeps rotate_half(q) and rotate_half(k)
    if plan.attention == "eager":
        # q and the repeated k, v for the two matmuls; fp32 softmax output and its cast, per head
        total += c * 3 * q + info.heads * plan.seq_len * (4 + (c if c < 4 else 0))
    else:
        total += c * (q + 2 * kv) + c * q + 4 * info.heads  # q, k, v, output, log-sum-exp
    total += _input_saved(q, c, ("o_proj",), plan)
    total += _input_saved(h, rs, ("gate_proj", "up_proj"), plan)
    total += 3 * rs * i  # gate (for SiLU), SiLU output and up (for the product)
    total += _input_saved(i, rs, ("down_proj",), plan)
    if plan.weights == "int8":  # the inputs are counted above as shared; the outlier slices are extra
        normed, down = int8_outlier_fractions(info, plan)
        total += rs * (5 * h * normed + i * down)
    return total


def _loss_bytes_per_token(info: ModelInfo, plan: Plan) -> float:
    """Peak of the loss, per token, as the Trainer computes it on the plain path
    (engine/train.py's ``forward``): the logits in the compute dtype, then an fp32 copy of the
    response positions' logits and its log-softmax (the compute-dtype logits die with the forward:
    nothing saves them); in backward, the log-softmax's output, the gradient coming in and the one
    going out, fp32 each: 12 bytes a vocabulary entry, more than the forward's compute dtype + 8.
    Every token is taken as a response token (the estimate does not read the template's split).
    A preference pair's log-probabilities (engine/preference.py's ``sequence_logps``) are computed
    the same way. transformers' own loss (``plan.loss == "hf"``) keeps the compute-dtype logits
    through it as well: compute dtype + 12."""
    c = _bytes(plan.compute)
    per_entry = c + 12 if plan.loss == "hf" else max(c + 8, 12)
    return per_entry * info.vocab + 4 * info.hidden  # + the final norm's input


@dataclass(frozen=True)
class _Moments:
    """Activation bytes (beyond parameters and optimizer state) at the three candidate peaks, and
    what the caching allocator holds beyond them (``slack_*``: reserved minus allocated) at each."""

    loss: float
    layer_backward: float
    optimizer_step: float
    saved: float
    slack_loss: float
    slack_backward: float


def _moments(info: ModelInfo, plan: Plan, grads: int) -> _Moments:
    t = plan.tokens
    c = _bytes(plan.compute)
    rs = _stream_bytes(plan)
    per_layer = layer_activation_bytes(info, plan)
    # LLM.int8 keeps its inputs past checkpointing (int8_kept_bytes); without it they are in per_layer
    kept = int8_kept_bytes(info, plan) if plan.checkpointing else 0.0
    saved = t * info.layers * (rs * info.hidden + kept if plan.checkpointing else per_layer)
    head_dtype = 4 if plan.quantized and plan.lora_r is not None else rs
    # autocast's bf16 copies of fp32 weights that need a gradient path stay in the graph
    head_copy = c * (info.embedding_params() if info.tied else info.head_params()) if head_dtype != c else 0
    lora_copy = c * trainable_params(info, plan) if plan.lora_r is not None and c < 4 else 0
    fixed = CUBLAS_WORKSPACE_BYTES + lora_copy
    loss = saved + t * _loss_bytes_per_token(info, plan) + head_copy + fixed
    if plan.accumulation > 1:
        loss += grads  # gradients of earlier micro-batches are alive through this forward
    shapes = info.linear_shapes().values()
    # one weight, unpacked for the input gradient: 4-bit dequantizes to bf16; LLM.int8 to its input's
    # dtype (CB.to(A.dtype)), fp32 on the fp32 residual stream of k-bit training
    unpacked = rs if plan.weights == "int8" else 2
    dequant = max(a * b for a, b in shapes) * unpacked if plan.quantized else 0
    backward_transient = rs * (2 * info.hidden + 2 * info.intermediate)
    # the recomputed layer's int8 inputs die with the recomputed graph (only the hooks' tensors stay)
    recompute = per_layer - kept if plan.checkpointing else 0
    layer_backward = saved + t * (recompute + backward_transient) + fixed + dequant + grads
    # torch's AdamW (foreach) holds about one parameter-sized temporary while it updates
    temp = trainable_params(info, plan) * _trainable_dtype_bytes(plan) if plan.optimizer == "adamw" else 0
    optimizer_step = grads + temp
    # Reserved minus allocated. Blocks freed by one layer's forward (its working set, ~ what it keeps
    # for backward) stay cached and are too small for what comes next; so do the big transient weight
    # copies (lm_head in bf16, one unpacked weight). In a layer's backward the loss's freed blocks are
    # carved up by the recompute and merge back afterwards: nothing extra.
    cached = t * per_layer + head_copy + dequant / 2 + _SLACK_FLOOR
    # At the loss, every step asks for the same blocks in the same order (bf16 logits, then three
    # fp32 logits-sized ones), and the caching allocator's best fit hands it the blocks of the step
    # before: no new segment. Unless a tensor that outlives the step sits in one of them: then one
    # fp32 logits block has to be mapped fresh (:func:`_loss_blocks_pinned`).
    slack_loss = cached + (t * info.vocab * 4 if _loss_blocks_pinned(info, plan) else 0)
    return _Moments(loss, layer_backward, optimizer_step, saved, slack_loss, cached)


def _largest_freed_forward_block(info: ModelInfo, plan: Plan) -> float:
    """Bytes of the largest block the forward pass frees and leaves cached before the backward starts.

    With checkpointing, each layer's forward frees its whole working set, the largest piece being the
    gate/up outputs (tokens x intermediate, residual dtype). Without it those are saved; what is
    freed is a projection's output that only fed a sum or a cast: bitsandbytes' bf16 matmul output
    before its cast back to the fp32 residual stream, or a LoRA'd base layer's output after the
    adapter is added.
    """
    t = plan.tokens
    if plan.checkpointing:
        return t * info.intermediate * _stream_bytes(plan)
    if plan.quantized or {"gate_proj", "up_proj"} & set(plan.lora_targets if plan.lora_r else ()):
        return t * info.intermediate * _bytes(plan.compute)
    return t * max(info.hidden, info.heads * info.head_width) * _bytes(plan.compute)


def _loss_blocks_pinned(info: ModelInfo, plan: Plan) -> bool:
    """Whether a long-lived allocation lands in the loss's cached logits blocks, so that the next
    step's loss maps one fresh fp32 logits block.

    The first matmul of the first backward (lm_head's input gradient) runs on autograd's own thread,
    whose cuBLAS handle allocates its own workspace through the caching allocator and keeps it for
    good. Best fit puts it in the smallest free block that holds it: a block the forward freed, if
    one is large enough, else the loss's freed logits blocks (the only large free ones then), which
    it then splits for the rest of the run.
    """
    return _largest_freed_forward_block(info, plan) < CUBLAS_WORKSPACE_BYTES


# -------------------------------------------------------------------------------------- estimate

_SLACK_FLOOR = 32 * 2**20
"""Small-pool segments (2 MiB each for tensors under 1 MiB) and 20 MiB segments of 1-10 MiB tensors."""

_LARGE_PAGE = 20 * 2**20
"""With expandable segments the large pool (tensors over 1 MiB) maps its one segment in 20 MiB steps."""

_SMALL_PAGE = 2 * 2**20
"""... and the small pool (tensors of at most 1 MiB) its own segment in 2 MiB steps."""

_SMALL_TENSOR = 2**20


def _small_pool_trainable(info: ModelInfo, plan: Plan) -> int:
    """Trainable parameters in tensors of at most 1 MiB: they, their gradients and their optimizer
    temporaries live in the allocator's small pool (all of LoRA r16 on a 7B model; at r64 the
    4096-wide matrices are 1 MiB and stay there, the 11008-wide ones move to the large pool)."""
    if plan.lora_r is None:
        return info.norm_params()
    width = _trainable_dtype_bytes(plan)
    return sum(n for n in _lora_matrix_sizes(info, plan) if n * width <= _SMALL_TENSOR) * info.layers


def _workspace_pins_loss_expandable(info: ModelInfo, plan: Plan) -> bool:
    """:func:`_loss_blocks_pinned` for expandable segments, where freed blocks are not cached
    segments of their own but holes in one address range, merging with their free neighbours.

    At the first backward matmul the autograd thread's 32 MiB cuBLAS workspace takes the smallest
    hole that holds it. Allocator traces on the H100 (bench/trace_pools.py) show what the forward
    leaves: with checkpointing, the saved hidden states are carved out of each layer's freed working
    set and the holes left are about three hidden-width bf16 tensors side by side; without it, the
    block of :func:`_largest_freed_forward_block`, two of them merged when gate and up both carry
    LoRA (their base outputs are freed next to each other). If no hole is large enough the workspace
    goes into the freed logits range and stays there.
    """
    t = plan.tokens
    if plan.checkpointing:
        hole = 3 * t * info.hidden * _bytes(plan.compute)
    elif plan.lora_r is not None and {"gate_proj", "up_proj"} <= set(plan.lora_targets):
        hole = 2 * t * info.intermediate * _bytes(plan.compute)
    else:
        hole = _largest_freed_forward_block(info, plan)
    return hole < CUBLAS_WORKSPACE_BYTES


def _pinned_loss_shift(info: ModelInfo, plan: Plan) -> int:
    """How much later the loss's blocks start, from the second step on, when the backward's cuBLAS
    workspace has settled in the freed logits range (expandable segments).

    The workspace takes the first free bytes of that range that hold it, and what lies below it
    then depends on who computes the loss:

    - transformers' own loss (``plan.loss == "hf"``) keeps the compute-dtype logits alive through
      the backward, and the logits' gradient cast back to the compute dtype fills the start of the
      freed fp32 range when lm_head's input gradient asks for the workspace: the workspace lands one
      compute-dtype logits block into it, and every later loss starts that block plus the workspace
      further along (the H100 trace of SmolLM2 int8 seq512 mb8: 436 MB = 403 + 34);
    - the Trainer's loss (engine/train.py, engine/preference.py) drops the compute-dtype logits at
      the end of its forward (only the response positions' fp32 copy and its log-softmax go on), and
      each gradient it casts back is freed before lm_head's product: the start of the range is free,
      the workspace lands there and the later losses start one workspace further along (SmolLM2 int8
      through the Trainer: 0.15 GiB reserved beyond allocated at 4096 tokens, less than the 0.38 GiB
      of one bf16 logits block the rule for transformers' loss adds).
    """
    if plan.loss == "hf":
        return plan.tokens * info.vocab * _bytes(plan.compute) + CUBLAS_WORKSPACE_BYTES
    return CUBLAS_WORKSPACE_BYTES


def _expandable_reserved(info: ModelInfo, plan: Plan, base: float, m: _Moments, grads: int) -> int:
    """Peak reserved bytes under expandable segments.

    Each pool maps one address range and never gives pages back during training, so reserved is the
    sum of the two pools' high-water marks, not the high-water mark of their sum:

    - the small pool peaks at the optimizer step, when the small trainable tensors' gradients and
      the foreach AdamW temporary are alive; at the moment of the overall peak (the loss, or a
      layer's backward) they are partly not, so the small pool adds what is missing then;
    - freed blocks merge, so the large pool holds little slack, except when the backward's cuBLAS
      workspace settles in the freed logits range (:func:`_workspace_pins_loss_expandable`): from
      the second step on, the loss's blocks start later by :func:`_pinned_loss_shift`.
    """
    small = _small_pool_trainable(info, plan) / max(trainable_params(info, plan), 1)
    temp = m.optimizer_step - grads
    shift = 0.0
    if _workspace_pins_loss_expandable(info, plan):
        shift = _pinned_loss_shift(info, plan)
    held_grads = grads if plan.accumulation > 1 else 0  # at the loss, earlier micro-batches' gradients
    # (bytes beyond ``base`` at each moment, of which in the small pool)
    moments = [(m.loss + shift, small * held_grads),
               (m.layer_backward, small * grads),
               (m.optimizer_step, small * (grads + temp))]
    large = base + max(need - in_small for need, in_small in moments)
    small_high = max(in_small for _, in_small in moments)
    return (math.ceil(large / _LARGE_PAGE) * _LARGE_PAGE
            + math.ceil(small_high / _SMALL_PAGE) * _SMALL_PAGE + _SMALL_PAGE)


def estimate_plan(info: ModelInfo, plan: Plan, gpu_bytes: int | None = None) -> Estimate:
    """Predict the memory of ``plan`` on model ``info`` (see :func:`estimate`), on the plan's path:
    the peak over every phase of a run (core/vram_phases.py), the training step's modelled here
    (plain path) or in core/vram_fast.py."""
    from studio.core.vram_phases import peak_phase, phase_peaks

    if plan.path == "fast":
        from studio.core.vram_fast import estimate_fast  # it builds on this module's helpers

        result = estimate_fast(info, plan)
    else:
        result = _plain_step(info, plan)
    phases = phase_peaks(info, plan, result)
    top = peak_phase(phases)
    result.phases, result.peak_phase, result.step_categories = phases, top, dict(result.categories)
    result.peak_allocated = max(p.allocated for p in phases.values())
    if top != "training step":  # the categories of the moment that sets the peak: no gradients then
        c, peak = result.categories, phases[top]
        on_device_optimizer = 0 if plan.optimizer.startswith("paged") else c["optimizer"]
        c["gradients"] = 0
        c["activations"] = peak.allocated - c["weights"] - c["lora"] - on_device_optimizer
        c["overhead"] = peak.reserved - peak.allocated + CUDA_CONTEXT_BYTES
        result.peak_reserved = peak.reserved
        result.total = sum(c.values())
        result.notes.insert(0, f"the {top} sets the peak: {peak.held}")
    if gpu_bytes is not None:
        result.capacity, result.fits = gpu_bytes, result.total <= gpu_bytes
        result.max_micro_batch = _max_micro_batch(info, plan, gpu_bytes)
    return result


def _plain_step(info: ModelInfo, plan: Plan) -> Estimate:
    """The training step on the plain path (transformers + PEFT + bitsandbytes)."""
    weights = weight_bytes(info, plan)
    n_train = trainable_params(info, plan)
    lora = n_train * 4 if plan.lora_r is not None else 0
    grads = n_train * _trainable_dtype_bytes(plan)
    optimizer = optimizer_bytes(info, plan)
    paged = plan.optimizer.startswith("paged")
    on_device_optimizer = 0 if paged else optimizer
    m = _moments(info, plan, grads)
    peak_activity = max(m.loss, m.layer_backward, m.optimizer_step)
    peak_allocated = int(weights + lora + on_device_optimizer + peak_activity)
    activations = peak_allocated - weights - lora - on_device_optimizer - grads
    # reserved never shrinks during training: its peak is the largest need of any moment
    base = weights + lora + on_device_optimizer
    if plan.expandable_segments:
        peak_reserved = max(_expandable_reserved(info, plan, base, m, grads), peak_allocated)
    else:
        peak_reserved = int(max(peak_allocated, base + m.loss + m.slack_loss,
                                base + m.layer_backward + m.slack_backward,
                                base + m.optimizer_step + m.slack_backward))
    overhead = peak_reserved - peak_allocated + CUDA_CONTEXT_BYTES
    categories = {"weights": int(weights), "lora": int(lora), "gradients": int(grads),
                  "optimizer": int(optimizer), "activations": int(activations), "overhead": int(overhead)}
    total = sum(categories.values())
    notes = []
    if plan.dora:
        notes.append("DoRA recomputes each adapted weight's norm every step: a dequantized copy of one "
                      "weight at a time, not counted in activations")
    if paged:
        notes.append("paged optimizer state lives in unified memory: it spills to host RAM under "
                     "pressure and torch.cuda's counters do not see it")
    if plan.sequences_per_example == 2:
        notes.append("a preference pair is two sequences (chosen, rejected): the micro-batch counts pairs"
                     + ("; DPO's reference pass (adapter off, no gradients) adds a forward's time, not memory"
                        if plan.reference_pass else ""))
    if plan.seq_len > info.max_positions:
        notes.append(f"sequence length {plan.seq_len} exceeds the model's {info.max_positions} positions")
    notes.append("overhead includes ~0.8 GB of CUDA context that only nvidia-smi shows")
    return Estimate(categories, total, None, None, None, peak_allocated, peak_reserved, plan, notes)


def _total(info: ModelInfo, plan: Plan) -> int:
    return estimate_plan(info, plan).total


def _max_micro_batch(info: ModelInfo, plan: Plan, capacity: int, limit: int = 4096) -> int:
    """Largest micro-batch whose total fits (memory grows with it, so bisect)."""
    if _total(info, replace(plan, micro_batch=1)) > capacity:
        return 0
    low, high = 1, 2
    while high <= limit and _total(info, replace(plan, micro_batch=high)) <= capacity:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if _total(info, replace(plan, micro_batch=mid)) <= capacity:
            low = mid
        else:
            high = mid
    return low


def path_choice(config: RunConfig, model_info: ModelInfo) -> PathChoice:
    """The training path Studio's engine will take for ``config`` on this model on a GPU, decided
    by the function the engine calls (core/plan.py's choose_path)."""
    plan = plan_for(config, info=model_info)
    facts = PathFacts.from_config(config, cuda=True, weights=plan.weights,
                                  model_blocker=model_info.fast_path_blocker, targets=plan.lora_targets)
    choice = choose_path(facts)
    if choice.path == "plain":
        choice = replace(choice, checkpointing=plan.checkpointing)
    return choice


def estimate(config: RunConfig, model_info: ModelInfo, gpu_bytes: int | None = None,
             micro_batch: int | None = None, lengths: tuple[int, ...] = ()) -> Estimate:
    """Predict the GPU memory of training ``config`` on the model ``model_info`` describes, on the
    path the engine will take (:func:`path_choice`).

    ``gpu_bytes`` is the card's capacity (for fits / max_micro_batch); ``micro_batch`` overrides the
    config's; ``lengths`` the training examples' token lengths when known (:func:`plan_for`).
    Raises ValueError naming ``lora.target_modules`` if a target is not in the model.
    """
    choice = path_choice(config, model_info)
    plan = replace(plan_for(config, micro_batch, lengths=lengths, info=model_info), path=choice.path)
    result = replace(estimate_plan(model_info, plan, gpu_bytes), choice=choice)
    if plan.lora_r is None:  # the config's own full fine-tune (the walkthrough's steps tell their own story)
        result.notes.insert(0, f"full fine-tuning: every weight has a gradient in {plan.weights} and AdamW state ("
                            + ("m and v in the weights' dtype, torch AdamW" if plan.optimizer == "adamw" else
                               "fp32 m and v" if plan.optimizer == "paged_adamw" else "8-bit m and v")
                            + "); no fp32 master copy")
    return result


# ----------------------------------------------------------------------------------- walkthrough


@dataclass(frozen=True)
class WalkStep:
    """One step of the walkthrough: a setup, its estimate and why it saves memory."""

    title: str
    why: str
    estimate: Estimate


def walkthrough(config: RunConfig, info: ModelInfo, gpu_bytes: int | None = None) -> list[WalkStep]:
    """The seed's story for this model: full fp32 -> bf16 -> 8-bit -> LoRA -> NF4 QLoRA ->
    + gradient checkpointing -> + paged 8-bit optimizer, each step changing one thing."""
    base = plan_for(config, info=info)
    # a full fine-tune's config (lora: null) has no adapter of its own: its LoRA steps show the default one
    lora = dict(lora_r=base.lora_r or 16, lora_targets=base.lora_targets or info.lora_targets("all-linear"),
                lora_dropout=base.lora_dropout)
    full = replace(base, lora_r=None, checkpointing=False, optimizer="adamw", compute="fp32",
                   weights="fp32")
    steps = [
        ("Full fine-tune, fp32", full,
         "every weight trains: 4 B weight + 4 B gradient + 8 B Adam m and v per parameter"),
        ("Full fine-tune, bf16", replace(full, weights="bf16", compute="bf16"),
         "bf16 halves weights, gradients, Adam state and activations"),
        ("8-bit weights", replace(full, weights="int8", compute="bf16"),
         "LLM.int8 halves the weights again; int8 weights cannot take updates, so an adapter is next"),
        ("LoRA on 8-bit", replace(full, weights="int8", compute="bf16", **lora),
         "only the adapter trains: gradients and Adam state shrink to it (the fp32 residual stream "
         "of k-bit training costs activations)"),
        ("NF4 QLoRA", replace(full, weights="nf4", double_quant=True, compute="bf16", **lora),
         "4-bit NF4 packs two weights a byte, plus small quantization constants"),
        ("+ gradient checkpointing", replace(full, weights="nf4", compute="bf16", checkpointing=True,
                                             **lora),
         "keep only each layer's input and recompute the rest in backward: ~30% more compute"),
        ("+ paged 8-bit AdamW", replace(full, weights="nf4", compute="bf16", checkpointing=True,
                                        optimizer="paged_adamw_8bit", **lora),
         "8-bit m and v; paging moves them to host RAM instead of failing on a spike"),
    ]
    return [WalkStep(title, why, estimate_plan(info, plan, gpu_bytes)) for title, plan, why in steps]
