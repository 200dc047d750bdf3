"""A training setup as the estimator sees it (:class:`Plan`), and the one a run config describes.

Plain Python: it must never import torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from studio.core.config import RunConfig
from studio.core.decoder.spec import PROJECTIONS
from studio.core.memory.allocator import expandable_segments_from_env
from studio.core.model.info import ModelInfo

ALL_LINEAR = PROJECTIONS
"""What PEFT's ``all-linear`` means for a Llama-architecture model (lm_head excluded)."""


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

    lora_targets: tuple[str, ...] = ALL_LINEAR
    """Linear modules that get an adapter."""

    expert_format: str = ""
    """A mixture of experts' expert weights kept as the checkpoint ships them where the weights
    load in 4 bits (``mxfp4``: gpt-oss, engine/mxfp4.py); '' where they are stored as ``weights``."""

    lora_experts: bool = False
    """A mixture of experts' experts get adapters too (``lora.target_experts``): r x (in + out) per
    expert, projection and sparse layer."""

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
    cache freed blocks (core/memory/plain.py's ``moments`` says what that costs)."""

    path: str = "plain"
    """The training path the engine takes (core/plan.py's choose_path): ``plain`` (transformers +
    PEFT + bitsandbytes: core/memory/plain.py) or ``fast`` (studio/engine/fast/:
    core/memory/fast.py)."""

    cuda_graphs: bool = True
    """Whether the fast path may replay steps as CUDA graphs at all (core/plan.py's
    ``PathChoice.cuda_graphs``: off with ``trainer.fast_path.cuda_graphs: false`` and for a mixture
    of experts where core/plan.py's ``moe_graphs_off`` says so); where it may, core/plan.py's
    ``graphs_for`` decides by the micro-batch's tokens."""

    kernels: bool = True
    """``trainer.fast_path.kernels``: the fast path's Triton kernels run (on a CUDA card, whose torch
    brings Triton), among them its fused attention of soft-capped scores and sinks
    (core/memory/fast.py's ``fused_attention``)."""

    sequences_per_example: int = 1
    """2 for preference runs (DPO, ORPO): a pair is its chosen and its rejected answer, padded rows."""

    reference_pass: bool = False
    """DPO: one more forward per micro-batch, through the base (adapter off) without gradients,
    before the policy's. On the plain path its logits (compute dtype plus an fp32 copy of the answer
    positions) are smaller than the loss moment's, which also holds the gradients of the fp32 logits:
    it costs time, not peak memory; on the fast path beside a CUDA graph its working set is reserved
    apart from the graph's pool (core/memory/fast.py's ``reference_pass_bytes``)."""

    packing: bool = True
    """``trainer.packing``: rows packed into ``seq_len``-long streams (every micro-batch full), or
    one example a row, padded to the micro-batch's longest."""

    lengths: tuple[int, ...] = ()
    """Token lengths of the training examples, longest first, each capped at ``seq_len``, when the
    data was read (core/memory/lengths.py); empty: every row is taken as ``seq_len`` long.
    Only unpacked runs use it (packed micro-batches fill ``seq_len``)."""

    generate_prompt_tokens: int | None = None
    """The generation phase's prompt (chat), in tokens; None: as long as a training row (``seq_len``)."""

    generate_new_tokens: int = 128
    """The generation phase's answer length (``generation.max_new_tokens``)."""

    kbit_upcast: bool = True
    """A k-bit QLoRA base prepared by PEFT's ``prepare_model_for_kbit_training``, which casts the
    embeddings, the output head and the norms to fp32 (and so the residual stream); False where the
    engine keeps them in the compute dtype (GRPO runs: engine/model.py)."""

    grpo_completion: int = 0
    """GRPO runs: ``grpo.max_completion_length`` (0: not a GRPO run). A micro-batch is prompts, each
    ``sequences_per_example`` (the group) rows of prompt + completion; the scored pass takes logits
    of the completion positions only, and the run has a sampling phase (core/memory/phases.py)."""

    grpo_scored_rows: int = 0
    """GRPO runs: completions in one forward and backward of the scored pass, which goes through a
    micro-batch's rows this many at a time, each chunk's backward before the next one's forward
    (engine/grpo.py); 0: every row at once. core/memory/estimate.py's ``grpo_scored_rows`` chooses it."""

    evaluates_between_steps: bool = True
    """An evaluation runs between two training steps (``trainer.eval_interval`` above 0 and below
    the run's steps), beside the CUDA graphs' private pools, which it cannot use. False: the run
    evaluates only before its first step (no graph captured yet) and after its last, once the engine
    has given the graphs and their pools back (engine/train.py), so no evaluation shares the card
    with a pool."""

    @property
    def upcast(self) -> bool:
        """Whether the base's unquantized parts and residual stream are fp32 (:attr:`kbit_upcast`
        applied to a quantized LoRA base)."""
        return self.quantized and self.lora_r is not None and self.kbit_upcast

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
    def stored(self) -> str:
        """How the frozen weights are stored, as a person reads it: ``NF4 weights``, or ``NF4
        weights, MXFP4 experts`` where a mixture of experts keeps the experts it ships."""
        kept = f", {self.expert_format.upper()} experts" if self.expert_format else ""
        return f"{self.weights.upper()} weights{kept}"

    @property
    def rows(self) -> int:
        """Rows of a micro-batch: its examples, each ``sequences_per_example`` rows (a preference
        pair's two answers, a GRPO prompt's group)."""
        return self.micro_batch * self.sequences_per_example

    @property
    def pass_rows(self) -> int:
        """Rows of one forward and backward: the micro-batch's, or a chunk of a GRPO micro-batch's
        completions (:attr:`grpo_scored_rows`)."""
        return min(self.rows, self.grpo_scored_rows) if self.grpo_scored_rows else self.rows

    @property
    def passes(self) -> int:
        """Forward and backward passes a micro-batch takes (more than one: a chunked GRPO scored
        pass, whose earlier chunks' gradients are alive through the later ones)."""
        return -(-self.rows // self.pass_rows)

    @property
    def tokens(self) -> int:
        """Tokens in one forward pass as the model sees it, padding included (a preference pair
        counts both of its sequences): :attr:`pass_rows` x :attr:`row_len`."""
        return self.pass_rows * self.row_len


def plan_for(config: RunConfig, micro_batch: int | None = None, attention: str = "sdpa",
             expandable_segments: bool | None = None, lengths: tuple[int, ...] = (),
             info: ModelInfo | None = None) -> Plan:
    """The Plan a RunConfig describes (4-bit NF4 QLoRA by default).

    ``expandable_segments`` None means what Studio's engine will use in this environment
    (core/memory/allocator.py's ``expandable_segments_from_env`` of PYTORCH_CUDA_ALLOC_CONF).
    ``lengths``: the training examples' token lengths when the data was read
    (core/memory/lengths.py), else every row is taken as ``data.max_seq_length`` long. ``info``:
    the model, whose module names the LoRA targets take (``ModelInfo.lora_targets``: all-linear,
    Phi-3's fused modules); without it, Llama's names.
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
    grpo = config.trainer.method == "grpo"
    every, steps = config.trainer.eval_interval, config.trainer.max_steps
    # without max_steps the steps come from the data: an interval may fall inside them
    between = every > 0 and (not steps or every < steps)
    kept = info.expert_format if info is not None and weights in ("nf4", "fp4") else ""
    return Plan(weights=weights, double_quant=q.double_quant, compute=compute, expert_format=kept,
                lora_r=lora.r if lora is not None else None, lora_targets=names,
                lora_experts=bool(lora.target_experts) if lora is not None else False,
                lora_dropout=lora.dropout if lora is not None else 0.0,
                dora=lora.use_dora if lora is not None else False,
                micro_batch=micro_batch or config.trainer.micro_batch(),
                seq_len=config.data.max_seq_length, checkpointing=config.trainer.checkpointing(),
                optimizer=config.trainer.optimizer, accumulation=accumulation, attention=attention,
                kernels=config.trainer.fast_path.kernels,
                expandable_segments=(expandable_segments_from_env(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
                                     if expandable_segments is None else expandable_segments),
                sequences_per_example=(2 if config.trainer.method in ("dpo", "orpo") else
                                       config.grpo.num_generations if grpo else 1),
                reference_pass=config.trainer.method == "dpo", packing=config.trainer.packing,
                lengths=tuple(lengths), generate_new_tokens=config.generation.max_new_tokens,
                kbit_upcast=not grpo, grpo_completion=config.grpo.max_completion_length if grpo else 0,
                evaluates_between_steps=between)
