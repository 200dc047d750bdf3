"""Predicted memory of a training step on Studio's GPU fast path (studio/engine/fast/).

The fast path keeps far less than transformers + PEFT (core/memory/plain.py models that one): no
fp32 residual stream, no per-module saved inputs, no logits. What today's engine holds:

- weights: the packed 4-bit (or float) projections with their constants; embeddings, head and norms
  in the compute dtype (the loader skips ``prepare_model_for_kbit_training``'s fp32 cast when the
  fast path is ahead); the double-quantized scales stay packed;
- experts (a mixture of experts): the expert weights, packed in 4 bits like the projections
  (engine/quantized_experts.py) or in a float dtype; the shared dequantization buffer then holds one
  projection of every expert (:func:`expert_buffer_bytes`), a sparse layer's working set is its
  tokens' ``top_k`` copies through the grouped products (:func:`mlp_outputs_per_token`), and the
  experts' adapters are hoisted with the others. Not yet measured on a GPU (no benchmark of it exists yet);
- LoRA parameters, gradients and optimizer state as on the plain path;
- activations: every layer is checkpointed, whatever the config says, and on a CUDA card each
  layer's input and its rotated q, k and v (and fused attention's output: :func:`saved_per_token`)
  wait in pinned host memory (engine/fast/offload.py): on the device at a backward's start are two
  layer inputs (the one being recomputed and the next, prefetched) and the next layer's; the stacked bf16
  adapters of every layer (hoisted out of the checkpoints; an eager step frees each layer's as its
  backward ends, while the gradients appear: :func:`adapters_at_peak`), one recomputed layer's
  working set in its backward (with a model's fewer key/value heads, the key and value repeated to
  the query heads' count among it; with a GeGLU MLP whose activation runs outside Studio's kernels,
  the contiguous copies of gate and up liger's kernel takes: :func:`gelu_copies_per_token`), and the
  fused cross-entropy's gradient of the hidden states with one chunk of logits (never all of
  them: :func:`loss_bytes`); the shared buffer every 4-bit weight is dequantized into (as large as
  the widest single projection);
- overhead: the CUDA context; with CUDA graphs (micro-batches of up to core/plan.py's
  GRAPH_TOKEN_LIMIT tokens), the free blocks of the graph's private pool.

Preference runs (DPO, ORPO) take the same step on the pair batch's 2n rows (``Plan.tokens``), their
answers' log-probs from the fused loss (no logits either); DPO adds its reference pass, a forward
without gradients through the same layers before the policy's (:func:`reference_pass_bytes`): with
CUDA graphs a graph of its own in the policy graph's pool (:func:`reference_graph_bytes`).

The two fitted constants below (``LAYER_WORKING_SET``, ``GRAPH_POOL_PER_TOKEN``) are searched by
bench/refit_vram_fast.py on the in-sample rows of a measurement of the engine
(tests/data/vram_measured.json, made by bench/vram_measure.py at 9058222); bench/NOTES.md keeps their
history.

Plain Python: it must never import torch.
"""

from __future__ import annotations

import math

from studio.core.memory.allocator import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    PAGE,
    STEP_WORKSPACES,
)
from studio.core.memory.attention import eager_attention_bytes, kept_attention_per_token
from studio.core.memory.params import (
    QUANT_BLOCK,
    compute_bytes,
    expert_lora_params,
    experts_stored_bytes,
    linear_bytes,
    optimizer_bytes,
    trainable_params,
)
from studio.core.memory.plan import Plan
from studio.core.memory.result import Estimate
from studio.core.model.info import ModelInfo
from studio.core.plan import graphs_for

LAYER_WORKING_SET = 1.2
"""One recomputed layer's backward holds about this many times its forward outputs
(:func:`layer_outputs_per_token`: with few of them, the gradients beside them are a large share).
Fitted with ``GRAPH_POOL_PER_TOKEN`` by bench/refit_vram_fast.py on the 15 in-sample fast-path rows
of tests/data/vram_measured.json (9058222's engine, one H200); the search kept 1.2, the value first
fitted on 09fac3a's H100 grid."""

FIXED_SLACK = 32 * 2**20
"""Reserved beyond the allocated peak that no mechanism below explains: small-pool pages and 20 MiB
mapping steps of the allocator (fitted)."""

GRAPH_POOL_PER_TOKEN = 0.375
"""With CUDA graphs, the captured step's private pool keeps free blocks worth this many times one
layer's forward outputs per token: the layer's transients the capture freed, which the pool cannot
hand to anything outside the graph. Fitted with ``LAYER_WORKING_SET`` on the in-sample rows of
tests/data/vram_measured.json (9058222's engine); 0.5 before the repeated keys and values joined the
layer's outputs."""

CAPTURE_WORKSPACES = 5
"""cuBLAS workspaces (core/memory/allocator.py's CUBLAS_WORKSPACE_BYTES each) alive when a CUDA
graph is captured: beside the default stream's (STEP_WORKSPACES), the capture's warm-up and capture
streams, on the main and the autograd thread, have theirs. Counted in the allocator's history at the
peak of two H100 Trainer rows (bench/results/archive/h100_v7_attribution.json: five 32 MiB blocks, one from
the first product of the run, four from the fused products' first calls on the capture's streams);
the engine frees the capture's once it is done."""

LOSS_CHUNK_ROWS = 128
"""The fewest rows a chunk of the fast path's fused loss takes (engine/fast/cross_entropy.py). Each
chunk reads the whole head twice (its logits' product, the hidden states' gradient's), so the
products take about ``206 / rows`` times their arithmetic's time in reading it on an H200 (989
TFLOP/s over 4.8 TB/s): 1.6x at 128 rows, 6.4x at liger's 32 (2,048 tokens over Gemma 2's 256,000
words). 256 rows would reach the card's rate with twice the logits held (up to 131 MB in bf16 at
that vocabulary); 128 keeps the estimate within its bar on the measured rows of liger's engine."""

MAX_LAYOUTS = 2
"""CUDA-graph layouts a run of unpacked rows of varying lengths captures (engine/fast/model.py's
``max_graphs``), each with its own private pool; packed rows keep one layout, widened in place."""


def layer_outputs_per_token(info: ModelInfo, compute: int) -> float:
    """Bytes per token of one recomputed decoder layer's forward outputs (engine/fast/layer.py):
    the norms (two on a Llama layer, four on Gemma 2 and 3's), q, k and v from their own products
    (RoPE rotates them where they are: no copies; q/k norms write normed copies of q and k first),
    attention, o_proj's output written onto the residual stream (one tensor: the LoRA update's
    product adds the residual, the base product adds itself in place), the gate/up product and the
    gated activation; the recomputation skips down_proj, whose value nothing reads. With fewer
    key/value heads than query heads (grouped-query attention), engine/fast/attention.py repeats k
    and v to the query heads' count (``repeat_interleave``: two new ``tokens x heads x head_width``
    tensors) wherever its kernel cannot take fewer: always on the SDPA path (rows without example
    boundaries), and on flash-attention's varlen path where torch's ``varlen_attn`` takes no
    ``enable_gqa`` (torch 2.11, the GPU box's); the attention keeps both for its backward. The
    description (core/decoder/) changes nothing else at the lengths Studio trains: a sliding window
    masks scores the flash kernels never keep, soft-caps and scales act inside the kernels."""
    h = info.hidden
    q = info.heads * info.head_width
    kv = info.kv_heads * info.head_width
    qk_normed = q + kv if info.qk_norm else 0
    repeated = 2 * q if info.kv_heads != info.heads else 0
    return (compute * (info.norms_per_layer * h + (q + 2 * kv) + qk_normed + repeated + q + h)
            + mlp_outputs_per_token(info, compute))


def mlp_outputs_per_token(info: ModelInfo, compute: int) -> float:
    """Bytes per token of a recomputed layer's MLP outputs: a dense layer's gate/up product and
    gated activation (``3 x intermediate``); a sparse layer's (engine/fast/moe.py), for each of the
    token's ``top_k`` copies, its gathered input, the grouped gate/up product, SiLU(gate) and its
    product with up (both saved for the backward), and the routing-weighted activation that down
    reads, beside the router's logits (compute dtype) and probabilities (fp32) over the experts,
    three int64 indices a copy (expert, sorted order, source row) and an int32 (where the copy sits
    in the sort). The widest kind of layer counts."""
    dense = compute * 3 * info.intermediate
    if not info.sparse_layers:
        return dense
    k, inter = info.top_k, info.expert_intermediate
    sparse = compute * (info.experts + k * (info.hidden + 2 * inter + 3 * inter)) + 4 * info.experts + (3 * 8 + 4) * k
    return sparse if info.sparse_layers == info.layers else max(dense, sparse)


def gelu_copies_per_token(info: ModelInfo, compute: int, gate_in_kernel: bool) -> int:
    """Bytes per token that a GeGLU layer's recomputation holds beyond the outputs
    :func:`layer_outputs_per_token` counts where its activation runs outside Studio's kernels
    (``gate_in_kernel`` False: :func:`gate_in_kernel`): engine/fast/layer.py's ``gated`` then hands
    the gate and up halves of gate/up's output to liger's GELU-and-multiply kernel, which takes its
    inputs contiguous and so copies both halves (``2 x intermediate``) while gate/up's output is
    still alive. Studio's gated kernels (engine/fast/update.py, SwiGLU and GeGLU) and liger's SwiGLU
    read that output where it is: 0 for them, for a SiLU model, and for one whose every MLP is a
    mixture of experts (engine/fast/moe.py's own kernels)."""
    if gate_in_kernel or info.activation == "silu" or (info.sparse_layers and info.sparse_layers == info.layers):
        return 0
    return compute * 2 * info.intermediate


def gate_in_kernel(plan: Plan) -> bool:
    """Whether the gated MLP's activation runs in Studio's kernel that adds gate/up's update
    (engine/fast/projection.py's ``gated``): the fast path's kernels on (``trainer.fast_path.kernels``),
    a half-precision compute dtype, and an adapter on gate or up (the kernel adds that update)."""
    adapted = {"gate_proj", "up_proj", "gate_up_proj"} & set(plan.lora_targets)
    return plan.kernels and compute_bytes(plan) < 4 and bool(adapted)


def hoisted_adapter_bytes(info: ModelInfo, r: int, targets: tuple[str, ...], compute: int) -> int:
    """The adapters cast and stacked once per forward, for every layer: stacked A (n*r x in) and a
    block-diagonal B^T (n*r x sum of the fused outputs) per fused product (a module that is already
    fused, Phi-3's qkv_proj, is one adapter over its whole output)."""
    shapes = info.linear_shapes()
    products = ((("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)) if info.fused else
                (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)))
    total = 0
    for group in products:
        n = sum(1 for name in group if name in targets)
        if not n:
            continue
        fan_in = shapes[group[0]][0]
        outs = sum(shapes[name][1] for name in group)
        total += n * r * (fan_in + outs)
    return info.layers * total * compute


def adapters_at_peak(layers: int, hoisted: float, grads: float, eager_fresh: bool) -> float:
    """Bytes of the hoisted adapters and of the adapters' gradients alive together at the backward's
    peak, from ``hoisted`` and ``grads``, every layer's of each.

    Each layer's hoisted adapters are inputs of its recomputing autograd function
    (engine/fast/offload.py's ``OffloadedLayer``), saved until that layer's backward has run. A step
    captured as a CUDA graph adds its gradients into tensors that exist before it starts
    (engine/fast/graphs.py's ``GradSink``), and a later micro-batch of an accumulated step finds the
    earlier ones' gradients in place: either way every gradient and every layer's adapters are there
    when the backward starts. A fresh eager step (``eager_fresh``: the first micro-batch of an
    optimizer step, after engine/train.py's ``zero_grad(set_to_none=True)``) starts its backward with
    no gradient, and as each layer's backward ends autograd frees that layer's hoisted adapters and
    writes its fp32 gradients. So while layer ``L`` runs its backward the layers up to ``L`` hold
    their adapters and those above it their gradients, an amount linear in ``L``: the peak is at the
    first layer the backward runs (``L = N - 1``: every layer's adapters, no gradient) or at the
    second-to-last (``L = 1``: two layers' adapters, the other layers' gradients). The very last
    (``L = 0``) prefetches no layer below it, one layer input and q, k, v fewer, and stays lower."""
    if not eager_fresh or layers < 2:
        return hoisted + grads
    per_hoisted, per_grads = hoisted / layers, grads / layers
    return max(layers * per_hoisted, 2 * per_hoisted + (layers - 2) * per_grads)


def dequant_buffer_bytes(info: ModelInfo, compute: int) -> int:
    """Bytes of the shared buffer 4-bit weights are dequantized into: one projection at a time
    (engine/fast/weights.py splits a fused product), so the widest single projection."""
    shapes = info.linear_shapes()
    return max(fan_in * fan_out for fan_in, fan_out in shapes.values()) * compute


def gate_up_in_halves(info: ModelInfo) -> bool:
    """Whether the fast path dequantizes a mixture of experts' 4-bit gate/up in two halves of its
    output features (engine/fast/moe.py's ``PARTS``): NF4/FP4 experts whose halves fall on whole
    blocks (each expert's half of ``intermediate x hidden`` values; gpt-oss, stored ``[in, out]``,
    each row's half of its ``2 x intermediate``), and gpt-oss' MXFP4 experts (half of each expert's
    rows)."""
    if info.expert_format == "mxfp4":
        return True
    per_row = info.expert_intermediate if info.model_type == "gpt_oss" else info.expert_intermediate * info.hidden
    return per_row % QUANT_BLOCK == 0


def expert_buffer_bytes(info: ModelInfo, plan: Plan) -> int:
    """What the shared dequantization buffer grows by beyond :func:`dequant_buffer_bytes` for a
    mixture of experts' 4-bit experts: it holds one projection of every expert at a time
    (engine/fast/moe.py's ExpertWeights): down's ``experts x intermediate x hidden`` where gate/up
    is read in halves (:func:`gate_up_in_halves`), else gate/up's, twice that. 0 for a dense model
    or experts in a float dtype."""
    if not info.sparse_layers or not dequantizes(plan.weights):
        return 0
    c = compute_bytes(plan)
    widest = (1 if gate_up_in_halves(info) else 2) * info.experts * info.expert_intermediate * info.hidden * c
    return max(0, widest - dequant_buffer_bytes(info, c))


def dequantizes(weights: str) -> bool:
    """Whether the fast path dequantizes its base weights for the products, so that it holds the
    shared buffer of :func:`dequant_buffer_bytes` and leaves holes of its size: 4-bit bases only
    (engine/fast/weights.py gives a product a Workspace only when one of its bases is 4-bit). A
    base in the compute dtype (bf16) is read where it is: no buffer, no dequantized copies."""
    return weights in ("nf4", "fp4")


def loss_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows a chunk of the fast path's fused loss takes (engine/fast/cross_entropy.py): as many as make
    its logits as large as the hidden states (liger's rule), but at least :data:`LOSS_CHUNK_ROWS`,
    rounded up to a multiple of 128 (the products' tiles), and never more than the tokens."""
    rows = max(LOSS_CHUNK_ROWS, -(-tokens * hidden // max(vocab, 1)))
    return max(1, min(tokens, -(-rows // 128) * 128))


def loss_bytes(info: ModelInfo, tokens: int, compute: int) -> int:
    """The fused loss's working set: the gradient of the final hidden states and one chunk's logits
    (:func:`loss_chunk_rows` rows of the vocabulary, in the compute dtype, their gradient written
    over them)."""
    return tokens * info.hidden * compute + loss_chunk_rows(tokens, info.hidden, info.vocab) * info.vocab * compute


def saved_per_token(info: ModelInfo, compute: int, attention: int = 0) -> int:
    """Bytes per token that the checkpointed layers keep on the device at a backward's start: with
    the layer inputs and their rotated q, k and v on the host, two inputs (the one being recomputed
    and the next, prefetched) and the next layer's q, k and v, and ``attention`` bytes of its kept
    attention (:func:`kept_attention_per_token`; the recomputed layer's own replace its q/k/v
    product's and attention's outputs in the working set); and every sparse layer's routing, kept
    for its recomputation (engine/fast/routing.py's KeptRouting: for each of a token's ``top_k``
    copies its expert, one byte up to 256 experts, and an int32 place in the sort)."""
    qkv = (info.heads + 2 * info.kv_heads) * info.head_width
    key = 1 if info.experts <= 256 else 2 if info.experts <= 2 ** 15 else 4
    return (2 * info.hidden + qkv) * compute + attention + info.sparse_layers * info.top_k * (key + 4)


def step_activations(info: ModelInfo, tokens: int, compute: int, gate_in_kernel: bool, attention: int = 0) -> float:
    """Bytes a training step holds beyond the parameters, gradients and optimizer state at its peak
    (a recomputed layer's), without the hoisted adapters and the dequantized weight;
    ``gate_in_kernel``: :func:`gate_in_kernel`; ``attention``: :func:`kept_attention_per_token`."""
    saved = tokens * saved_per_token(info, compute, attention)
    working = tokens * (LAYER_WORKING_SET * layer_outputs_per_token(info, compute)
                        + gelu_copies_per_token(info, compute, gate_in_kernel))
    return saved + working + loss_bytes(info, tokens, compute)


def dropout_bytes(info: ModelInfo, tokens: int, compute: int, rate: float, targets: tuple[str, ...]) -> int:
    """Adapter dropout's working copy in a recomputed layer's backward (engine/fast/weights.py's
    AdapterDropout), ``tokens x fan_in`` of the widest adapted input: one at a time, since the input
    gradient's product is masked straight into the layer's input gradient (the kernel accumulates
    into it) and freed before the adapter's own gradient regenerates the masked input. Measured on the
    H100 in one call (bench/results/archive/h100_v7_speed_c.json, Llama-2-7B r16 on all projections, 2048
    tokens): dropout 0.05 allocated 0.042 GiB more than none, one 2048 x 11008 bf16 tensor."""
    if rate <= 0:
        return 0
    shapes = info.linear_shapes()
    widest = max((shapes[name][0] for name in targets if name in shapes), default=0)
    return tokens * widest * compute


def graph_tensor_bytes(info: ModelInfo, tokens: int, compute: int) -> int:
    """The tensors a captured graph keeps for its replays as long as it lives (torch's
    ``make_graphed_callables``): its sample input (the stack's input hidden states, the first step's),
    cos and sin, its static output, the static gradient of that output and the static gradient of
    its input. In a graph's own capture they are that step's own tensors, inside the activations; a
    second layout's capture has the first graph's on top."""
    return tokens * (4 * info.hidden + 2 * info.head_width) * compute


def graph_pool_free_bytes(info: ModelInfo, tokens: int, compute: int) -> float:
    """Free blocks a captured step's private pool keeps beside the blocks of its activations."""
    return tokens * GRAPH_POOL_PER_TOKEN * layer_outputs_per_token(info, compute)


def graph_pool_bytes(info: ModelInfo, tokens: int, compute: int, gate_in_kernel: bool, attention: int = 0) -> float:
    """The whole private pool of a step captured as a CUDA graph: what the layers keep on the device
    (:func:`saved_per_token`), one layer's working set and the free blocks, none of which anything
    outside the graph can reuse (core/memory/phases.py puts it under every other phase);
    ``gate_in_kernel``: :func:`gate_in_kernel`; ``attention``: :func:`kept_attention_per_token`."""
    return tokens * (saved_per_token(info, compute, attention) + gelu_copies_per_token(info, compute, gate_in_kernel)
                     + (LAYER_WORKING_SET + GRAPH_POOL_PER_TOKEN) * layer_outputs_per_token(info, compute))


def allocator_slack(info: ModelInfo, tokens: int, compute: int, graphs: bool, dequantized: bool = True) -> float:
    """Reserved beyond the allocated peak: holes about two dequantized weights' size that later,
    smaller requests do not fill (``dequantized`` False, a base in the compute dtype: none); with
    CUDA graphs, the free blocks the captured step's private pool keeps."""
    slack = FIXED_SLACK + (2 * dequant_buffer_bytes(info, compute) if dequantized else 0)
    if graphs:
        slack += graph_pool_free_bytes(info, tokens, compute)
    return slack


def reference_pass_bytes(info: ModelInfo, tokens: int, compute: int) -> int:
    """DPO's reference pass on the fast path (engine/preference.py, ``FastModel.sequence_logps`` with
    the adapters off): a forward without gradients, layer by layer, whose widest moment is the MLP's
    (the layer's input and its normed copy, the gate/up product and the SwiGLU product of it), then
    the final hidden states, the answer rows gathered from them and the fused loss's chunk of logits
    (no larger than those rows: engine/fast/loss.py). Eager, it runs before the policy's pass, when
    none of the step's activations exist yet, and the step reuses its blocks."""
    return tokens * compute * (2 * info.hidden + 3 * info.intermediate + 3 * info.hidden)


def reference_graph_bytes(info: ModelInfo, tokens: int, compute: int) -> int:
    """The part of :func:`reference_pass_bytes` that a CUDA graph captures (engine/fast/graphs.py's
    ReferenceGraph: the decoder stack, whose widest moment is a layer's MLP): it lands in the private
    pool that the layout's policy graph is captured into next, whose capture takes the blocks the
    pass freed. Its static output, the final hidden states (``tokens x hidden``), stays allocated
    there; the head's part runs eagerly in blocks the policy's head reuses."""
    return tokens * compute * (2 * info.hidden + 3 * info.intermediate)


def shared_pool_growth(info: ModelInfo, tokens: int, compute: int, gate_in_kernel: bool, attention: int = 0) -> float:
    """What the reference graph adds to the layout's one private pool (:func:`graph_pool_bytes` the
    policy's alone): the pool holds the larger of the two working sets, the reference pass's static
    output kept beside the policy's, so it grows by that output or by the pass's excess, whichever is
    more."""
    output = tokens * info.hidden * compute
    return max(float(output), reference_graph_bytes(info, tokens, compute)
               - graph_pool_bytes(info, tokens, compute, gate_in_kernel, attention))


def fast_step(info: ModelInfo, plan: Plan) -> Estimate:
    """The training step's :class:`~studio.core.memory.result.Estimate` of ``plan`` on ``info`` on
    the fast path; core/memory/estimate.py adds the other phases and the card."""
    c = compute_bytes(plan)
    # a vision tower loads with the decoder and stays in the compute dtype (Gemma 3's SigLIP)
    other = info.embedding_params() + info.head_params() + info.norm_params() + info.vision_params
    weights = int(info.layers * linear_bytes(info, plan) + other * c)
    n_train = trainable_params(info, plan)
    lora = grads = n_train * 4
    optimizer = optimizer_bytes(info, plan)
    on_device_optimizer = 0 if plan.optimizer.startswith("paged") else optimizer
    tokens = plan.real_tokens  # the fast path drops the padding before the model
    # the engine's own rule (core/plan.py), where the run's path replays graphs at all
    graphs = plan.cuda_graphs and graphs_for(tokens, plan.lora_dropout, cuda=True)
    dequantized = dequantizes(plan.weights)
    # the shared dequantization buffer, as wide as one projection of every expert with 4-bit experts
    dequant = dequant_buffer_bytes(info, c) + expert_buffer_bytes(info, plan) if dequantized else 0
    # the experts' adapters are hoisted out of the checkpoints like the linear modules', stacked per expert
    hoisted = hoisted_adapter_bytes(info, plan.lora_r or 0, plan.lora_targets, c) + expert_lora_params(info, plan) * c
    in_kernel = gate_in_kernel(plan)
    attention = kept_attention_per_token(info, plan)
    working = (step_activations(info, tokens, c, in_kernel, attention)
               + eager_attention_bytes(info, plan)
               + dequant
               + CUBLAS_WORKSPACE_BYTES
               + dropout_bytes(info, tokens, c, plan.lora_dropout, plan.lora_targets))
    activations = working + hoisted
    # The hoisted adapters and the gradients at the backward's peak: all of both with graphs (their
    # backward adds into fixed gradient tensors) or accumulated gradients, fewer in a fresh eager step.
    adapters = adapters_at_peak(info.layers, hoisted, grads, eager_fresh=not graphs and plan.accumulation == 1)
    # The optimizer's foreach temporary comes after the activations are gone, every gradient there:
    # the backward is the peak. (The categories keep every gradient; activations are the rest.)
    temp = n_train * 4 if plan.optimizer == "adamw" else 0
    held = int(weights + lora + on_device_optimizer + max(working + adapters, grads + temp))
    # unpadded rows of varying lengths come in several layouts; packed ones widen the one they have
    layouts = plan.data_sized
    workspace = CUBLAS_WORKSPACE_BYTES
    reference = reference_pass_bytes(info, tokens, c) if plan.reference_pass else 0
    # DPO with graphs: the reference graph (captured first, in the policy's pool) and its static output
    reference_pool = reference_graph_bytes(info, tokens, c) if reference and graphs else 0
    reference_output = tokens * info.hidden * c if reference_pool else 0
    if graphs:
        # The graph is captured in the first step, before the optimizer has any state: that moment
        # holds the capture's activations and its streams' cuBLAS workspaces, without the optimizer.
        # Later steps replay inside the graph's private pool, whose blocks the allocator counts as
        # free (reserved, not allocated); the optimizer's state and step come after (reserved keeps
        # both: the pool stays mapped when the state arrives). A second layout's capture comes in a
        # later step, with the state and the first graph's fixed tensors (graph_tensor_bytes).
        # With DPO, the reference graph's pool is there already, its static output allocated.
        capture = activations + (CAPTURE_WORKSPACES - 1) * workspace + reference_output
        state = on_device_optimizer
        at_capture = weights + lora + grads + capture + (state + graph_tensor_bytes(info, tokens, c) if layouts else 0)
        peak_allocated = int(max(at_capture, weights + lora + grads + state + temp))
    else:
        # Eager steps: every product-running thread has its workspace (activations count one).
        extra = (STEP_WORKSPACES - 1) * workspace
        peak_allocated = int(weights + lora + on_device_optimizer + max(working + adapters + extra, grads + temp))
    slack = allocator_slack(info, tokens, c, graphs, dequantized)
    second_pool = 0.0
    if graphs and layouts:
        # every layout's graph has a private pool of its own: another copy of the graph's held
        # activations and free blocks each
        second_pool = (MAX_LAYOUTS - 1) * (step_activations(info, tokens, c, in_kernel, attention)
                                           + graph_pool_free_bytes(info, tokens, c))
        slack += second_pool
    eager_extra = 0 if graphs else (STEP_WORKSPACES - 1) * workspace  # mapped too
    need = max(held + eager_extra + slack, peak_allocated)
    if reference:
        # The pass's moment (eager, or the warm-up before its capture): the step's persistent bytes
        # (earlier micro-batches' gradients with accumulation) and its working set, before any of the
        # step's activations. Eager, its blocks are the step's to reuse.
        at_reference = (weights + lora + on_device_optimizer + (grads if plan.accumulation > 1 else 0)
                        + dequant + reference + workspace)
        peak_allocated = int(max(peak_allocated, at_reference))
        need = max(need, at_reference + slack)
    if reference_pool:
        # Graphed, it shares the policy graph's pool: the larger working set, not both.
        need += shared_pool_growth(info, tokens, c, in_kernel, attention) * (MAX_LAYOUTS if layouts else 1)
    if graphs:
        # The capture's own moment reserves its allocated peak, the free blocks its private pool has
        # by then and the allocator's fixed slack (a later step's other holes, the dequantized weights'
        # and the prefetched inputs', are not there yet: torch.cuda.graph empties the cache before it
        # captures). It is the peak where the optimizer's state is smaller than the capture's four
        # extra cuBLAS workspaces: SmolLM2-135M r8 on q and v keeps 3.5 MB of state, and its H100 row
        # reserved 109 MB beyond allocated at the capture (bench/results/archive/h100_v7_attribution.json).
        # (DPO: the policy's warm-up runs beside the reference graph's pool, free blocks and all.)
        need = max(need, at_capture + FIXED_SLACK + graph_pool_free_bytes(info, tokens, c) + second_pool
                   + reference_pool - reference_output)
    peak_reserved = int(math.ceil(need / PAGE) * PAGE)
    overhead = peak_reserved - held + CUDA_CONTEXT_BYTES
    experts = int(experts_stored_bytes(info, plan))
    categories = {"weights": weights - experts, "experts": experts, "lora": int(lora), "gradients": int(grads),
                  "optimizer": int(optimizer),
                  "activations": int(held - weights - lora - on_device_optimizer - grads),
                  "overhead": int(overhead)}
    total = sum(categories.values())
    notes = ["fast path (studio/engine/fast): every layer checkpointed, fused cross-entropy, "
             + ("CUDA graphs" if graphs else "eager steps")]
    if plan.sequences_per_example == 2:
        notes.append("a preference pair is two sequences (chosen, rejected): the micro-batch counts pairs"
                     + ("; DPO's reference pass (adapters off, no gradients) runs before the policy's, "
                        + ("as a CUDA graph in the policy graph's pool" if graphs else
                           "eagerly, in memory the step reuses") if plan.reference_pass else ""))
    if graphs and peak_allocated < held:
        notes.append("allocated peaks at the first step's CUDA-graph capture, before the optimizer has "
                     "state (the categories are a later step's)")
    if plan.optimizer.startswith("paged"):
        notes.append("paged optimizer state lives in unified memory: it spills to host RAM under "
                     "pressure and torch.cuda's counters do not see it")
    if plan.seq_len > info.max_positions:
        notes.append(f"sequence length {plan.seq_len} exceeds the model's {info.max_positions} positions")
    notes.append("overhead includes ~0.8 GB of CUDA context that only nvidia-smi shows")
    return Estimate(categories, total, None, None, None, peak_allocated, peak_reserved, plan, notes)
