"""The training step on the plain path (transformers + PEFT + bitsandbytes), tensor by tensor.

The prediction follows what HF transformers + PEFT + bitsandbytes keep alive on a CUDA device during
a step of Studio's Trainer (engine/train.py), and what torch's caching allocator reserves for it.
The peak of a step is the largest of three moments:

* the loss (every saved activation, the logits and the loss's fp32 copies);
* the backward of one layer (with checkpointing: every layer's input, plus one recomputed layer);
* the optimizer step (gradients plus the optimizer's temporaries; activations are gone).

Reserved memory follows the allocator's mode: with expandable segments (what Studio's engine sets)
each pool is one growing mapping, without them freed blocks stay cached in fixed segments.

Plain Python: it must never import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from studio.core.memory.allocator import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    LARGE_PAGE,
    SLACK_FLOOR,
    SMALL_PAGE,
    SMALL_TENSOR,
)
from studio.core.memory.params import (
    dtype_bytes,
    experts_stored_bytes,
    lora_matrix_sizes,
    optimizer_bytes,
    trainable_dtype_bytes,
    trainable_params,
    weight_bytes,
)
from studio.core.memory.plan import Plan
from studio.core.memory.result import Estimate
from studio.core.model.info import ModelInfo

# ----------------------------------------------------------------------------------- activations


def stream_bytes(plan: Plan) -> int:
    """dtype size of the residual stream and of the projections' outputs.

    After prepare_model_for_kbit_training the embeddings are fp32, so the whole residual stream is
    fp32 and bitsandbytes returns each projection in its input's dtype (fp32). A bf16 base keeps
    everything in bf16; full fine-tuning runs in the weights' dtype.
    """
    if plan.lora_r is None:
        return dtype_bytes(plan.compute) if plan.quantized else dtype_bytes(plan.weights)
    return 4 if plan.upcast else dtype_bytes(plan.compute)


def _input_saved(n: int, dtype: int, modules: tuple[str, ...], plan: Plan) -> float:
    """Bytes per token that the modules reading one input tensor (``n`` wide, ``dtype`` bytes) keep.

    A tensor kept by several consumers counts once; a per-module copy (autocast cast, dropout
    output) counts per module.
    """
    c = dtype_bytes(plan.compute)
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
        elif dtype != c or (not plan.upcast and c != 4 and not plan.quantized):
            # autocast casts per call (PEFT's plain LoRA first casts to its fp32 weights; its
            # bitsandbytes LoRA layers do not under autocast, so a k-bit base whose stream stays in
            # the compute dtype, GRPO's, hands lora_A its input as it is)
            total += c * n
        else:
            shared = True
    return total + (dtype * n if shared else 0)


INT8_THRESHOLD = 6.0
"""LLM.int8's outlier threshold (BitsAndBytesConfig.llm_int8_threshold, which Studio leaves at 6)."""


def _normal_tail(x: float) -> float:
    """P(|z| >= x) for a standard normal z."""
    return math.erfc(x / math.sqrt(2))


def swiglu_tail(sigma: float, threshold: float, steps: int = 2000) -> float:
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
    return normed, _columns_hit(swiglu_tail(sigma, INT8_THRESHOLD), rows)


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
    rs = stream_bytes(plan)
    normed, down = int8_outlier_fractions(info, plan)
    inputs = rs * h + dtype_bytes(plan.compute) * q + rs * h + rs * i  # q/k/v, o, gate/up, down
    outliers = rs * (5 * h * normed + i * down)  # the attention output into o_proj stays small
    return inputs + outliers


def layer_activation_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes one decoder layer keeps for backward, per token, without checkpointing."""
    h, i = info.hidden, info.intermediate
    q = info.heads * info.head_width
    kv = info.kv_heads * info.head_width
    c = dtype_bytes(plan.compute)
    rs = stream_bytes(plan)
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
    the same way."""
    c = dtype_bytes(plan.compute)
    return max(c + 8, 12) * info.vocab + 4 * info.hidden  # + the final norm's input


GRPO_SLICE_BYTES = 2 * 4 * 2**25
"""engine/token_logps.py works through the logits a slice of 2**25 of them at a time in fp32: the
slice and the softmax made from it in backward."""


def grpo_loss_bytes(info: ModelInfo, plan: Plan) -> float:
    """The loss moment of GRPO's scored pass (engine/grpo.py) beyond the saved activations, every
    completion taken as ``grpo_completion`` long, the final norm's fp32 input included.

    With a LoRA (a frozen output head without an adapter: the estimate knows no LoRA on lm_head),
    the output head goes a chunk of tokens at a time (engine/chunked_head.py): the decoder's output,
    the completion tokens' rows gathered from it and each one's gradient (computed in the forward
    and kept), and one chunk of rows whose fp32 logits are no larger than the completion tokens'
    hidden states in fp32 (engine/fast/loss.py's ``chunk_rows``), with its fp32 log-softmax. A full
    fine-tune trains the head and takes the model's own logits: the completion positions' logits
    (``logits_to_keep``) in the compute dtype, kept for backward by engine/token_logps.py (no fp32
    copy), their gradient in backward, and its fp32 slices."""
    c = dtype_bytes(plan.compute)
    rows = plan.pass_rows  # a chunk of the micro-batch's completions (Plan.grpo_scored_rows)
    norm_input = plan.tokens * 4 * info.hidden
    if plan.lora_r is None:
        return rows * (plan.grpo_completion + 1) * info.vocab * 2 * c + GRPO_SLICE_BYTES + norm_input
    completion_tokens = rows * plan.grpo_completion
    chunk = max(16, completion_tokens * info.hidden // max(info.vocab, 1))
    return (norm_input + plan.tokens * c * info.hidden + 2 * completion_tokens * c * info.hidden
            + chunk * info.vocab * 8)


@dataclass(frozen=True)
class Moments:
    """Activation bytes (beyond parameters and optimizer state) at the three candidate peaks, and
    what the caching allocator holds beyond them (``slack_*``: reserved minus allocated) at each."""

    loss: float
    layer_backward: float
    optimizer_step: float
    saved: float
    slack_loss: float
    slack_backward: float


def moments(info: ModelInfo, plan: Plan, grads: int) -> Moments:
    """The step's three candidate peaks and the allocator's slack at each (fixed-size segments)."""
    t = plan.tokens
    c = dtype_bytes(plan.compute)
    rs = stream_bytes(plan)
    per_layer = layer_activation_bytes(info, plan)
    # LLM.int8 keeps its inputs past checkpointing (int8_kept_bytes); without it they are in per_layer
    kept = int8_kept_bytes(info, plan) if plan.checkpointing else 0.0
    saved = t * info.layers * (rs * info.hidden + kept if plan.checkpointing else per_layer)
    head_dtype = 4 if plan.upcast else rs
    # autocast's bf16 copies of fp32 weights that need a gradient path stay in the graph
    head_copy = c * (info.embedding_params() if info.tied else info.head_params()) if head_dtype != c else 0
    lora_copy = c * trainable_params(info, plan) if plan.lora_r is not None and c < 4 else 0
    fixed = CUBLAS_WORKSPACE_BYTES + lora_copy
    logits = grpo_loss_bytes(info, plan) if plan.grpo_completion else t * _loss_bytes_per_token(info, plan)
    loss = saved + logits + head_copy + fixed
    if plan.accumulation > 1 or plan.passes > 1:
        loss += grads  # gradients of earlier micro-batches (or chunks) are alive through this forward
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
    temp = trainable_params(info, plan) * trainable_dtype_bytes(plan) if plan.optimizer == "adamw" else 0
    optimizer_step = grads + temp
    # Reserved minus allocated. Blocks freed by one layer's forward (its working set, ~ what it keeps
    # for backward) stay cached and are too small for what comes next; so do the big transient weight
    # copies (lm_head in bf16, one unpacked weight). In a layer's backward the loss's freed blocks are
    # carved up by the recompute and merge back afterwards: nothing extra.
    cached = t * per_layer + head_copy + dequant / 2 + SLACK_FLOOR
    # At the loss, every step asks for the same blocks in the same order (bf16 logits, then three
    # fp32 logits-sized ones), and the caching allocator's best fit hands it the blocks of the step
    # before: no new segment. Unless a tensor that outlives the step sits in one of them: then one
    # fp32 logits block has to be mapped fresh (:func:`loss_blocks_pinned`).
    slack_loss = cached + (t * info.vocab * 4 if loss_blocks_pinned(info, plan) else 0)
    return Moments(loss, layer_backward, optimizer_step, saved, slack_loss, cached)


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
        return t * info.intermediate * stream_bytes(plan)
    if plan.quantized or {"gate_proj", "up_proj"} & set(plan.lora_targets if plan.lora_r else ()):
        return t * info.intermediate * dtype_bytes(plan.compute)
    return t * max(info.hidden, info.heads * info.head_width) * dtype_bytes(plan.compute)


def loss_blocks_pinned(info: ModelInfo, plan: Plan) -> bool:
    """Whether a long-lived allocation lands in the loss's cached logits blocks, so that the next
    step's loss maps one fresh fp32 logits block (fixed-size segments).

    The first matmul of the first backward (lm_head's input gradient) runs on autograd's own thread,
    whose cuBLAS handle allocates its own workspace through the caching allocator and keeps it for
    good. Best fit puts it in the smallest free block that holds it: a block the forward freed, if
    one is large enough, else the loss's freed logits blocks (the only large free ones then), which
    it then splits for the rest of the run.
    """
    return _largest_freed_forward_block(info, plan) < CUBLAS_WORKSPACE_BYTES


# -------------------------------------------------------------------------- expandable segments


def small_pool_trainable(info: ModelInfo, plan: Plan) -> int:
    """Trainable parameters in tensors of at most 1 MiB: they, their gradients and their optimizer
    temporaries live in the allocator's small pool (all of LoRA r16 on a 7B model; at r64 the
    4096-wide matrices are 1 MiB and stay there, the 11008-wide ones move to the large pool)."""
    if plan.lora_r is None:
        return info.norm_params()
    width = trainable_dtype_bytes(plan)
    return sum(n for n in lora_matrix_sizes(info, plan) if n * width <= SMALL_TENSOR) * info.layers


def workspace_pins_loss_expandable(info: ModelInfo, plan: Plan) -> bool:
    """:func:`loss_blocks_pinned` for expandable segments, where freed blocks are not cached
    segments of their own but holes in one address range, merging with their free neighbours.

    At the first backward matmul the autograd thread's 32 MiB cuBLAS workspace takes the smallest
    hole that holds it. Allocator traces on the H100 (bench/trace_pools.py) show what the forward
    leaves: with checkpointing, the saved hidden states are carved out of each layer's freed working
    set and the holes left are about three hidden-width bf16 tensors side by side; without it, the
    block of :func:`_largest_freed_forward_block`, two of them merged when gate and up both carry
    LoRA (their base outputs are freed next to each other). If no hole is large enough the workspace
    goes into the freed logits range and stays there: the Trainer's loss drops the compute-dtype
    logits at the end of its forward and each gradient it casts back is freed before lm_head's
    product, so the workspace lands at the start of that range and every later loss starts one
    workspace further along (SmolLM2 int8 through the Trainer on the H100: 0.15 GiB reserved beyond
    allocated at 4096 tokens).
    """
    t = plan.tokens
    if plan.checkpointing:
        hole = 3 * t * info.hidden * dtype_bytes(plan.compute)
    elif plan.lora_r is not None and {"gate_proj", "up_proj"} <= set(plan.lora_targets):
        hole = 2 * t * info.intermediate * dtype_bytes(plan.compute)
    else:
        hole = _largest_freed_forward_block(info, plan)
    return hole < CUBLAS_WORKSPACE_BYTES


def _expandable_reserved(info: ModelInfo, plan: Plan, base: float, m: Moments, grads: int) -> int:
    """Peak reserved bytes under expandable segments.

    Each pool maps one address range and never gives pages back during training, so reserved is the
    sum of the two pools' high-water marks, not the high-water mark of their sum:

    - the small pool peaks at the optimizer step, when the small trainable tensors' gradients and
      the foreach AdamW temporary are alive; at the moment of the overall peak (the loss, or a
      layer's backward) they are partly not, so the small pool adds what is missing then;
    - freed blocks merge, so the large pool holds little slack, except when the backward's cuBLAS
      workspace settles in the freed logits range (:func:`workspace_pins_loss_expandable`): from
      the second step on, the loss's blocks start one workspace later.
    """
    small = small_pool_trainable(info, plan) / max(trainable_params(info, plan), 1)
    temp = m.optimizer_step - grads
    shift = 0.0
    if workspace_pins_loss_expandable(info, plan):
        shift = CUBLAS_WORKSPACE_BYTES
    # at the loss, the gradients of earlier micro-batches (or chunks of a GRPO scored pass)
    held_grads = grads if plan.accumulation > 1 or plan.passes > 1 else 0
    # (bytes beyond ``base`` at each moment, of which in the small pool)
    at = [(m.loss + shift, small * held_grads),
          (m.layer_backward, small * grads),
          (m.optimizer_step, small * (grads + temp))]
    large = base + max(need - in_small for need, in_small in at)
    small_high = max(in_small for _, in_small in at)
    return (math.ceil(large / LARGE_PAGE) * LARGE_PAGE
            + math.ceil(small_high / SMALL_PAGE) * SMALL_PAGE + SMALL_PAGE)


# ------------------------------------------------------------------------------------ the step


def plain_step(info: ModelInfo, plan: Plan) -> Estimate:
    """The training step on the plain path (transformers + PEFT + bitsandbytes)."""
    weights = weight_bytes(info, plan)
    n_train = trainable_params(info, plan)
    lora = n_train * 4 if plan.lora_r is not None else 0
    grads = n_train * trainable_dtype_bytes(plan)
    optimizer = optimizer_bytes(info, plan)
    paged = plan.optimizer.startswith("paged")
    on_device_optimizer = 0 if paged else optimizer
    m = moments(info, plan, grads)
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
    experts = int(experts_stored_bytes(info, plan))
    categories = {"weights": int(weights) - experts, "experts": experts, "lora": int(lora), "gradients": int(grads),
                  "optimizer": int(optimizer), "activations": int(activations), "overhead": int(overhead)}
    total = sum(categories.values())
    notes = []
    if plan.dora:
        notes.append("DoRA recomputes each adapted weight's norm every step: a dequantized copy of one "
                      "weight at a time, not counted in activations")
    if paged:
        notes.append("paged optimizer state lives in unified memory: it spills to host RAM under "
                     "pressure and torch.cuda's counters do not see it")
    if plan.sequences_per_example == 2 and not plan.grpo_completion:
        notes.append("a preference pair is two sequences (chosen, rejected): the micro-batch counts pairs"
                     + ("; DPO's reference pass (adapter off, no gradients) adds a forward's time, not memory"
                        if plan.reference_pass else ""))
    if plan.seq_len > info.max_positions:
        notes.append(f"sequence length {plan.seq_len} exceeds the model's {info.max_positions} positions")
    notes.append("overhead includes ~0.8 GB of CUDA context that only nvidia-smi shows")
    return Estimate(categories, total, None, None, None, peak_allocated, peak_reserved, plan, notes)
