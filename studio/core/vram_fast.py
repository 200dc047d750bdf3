"""Predicted memory of a training step on Studio's GPU fast path (studio/engine/fast/).

The fast path keeps far less than transformers + PEFT (core/vram.py models that one): no fp32
residual stream, no per-module saved inputs, no logits. What it holds, from what engine/fast does:

- weights: the packed 4-bit (or float) projections with their constants; embeddings, head and norms
  back in the compute dtype (``prepare`` casts down what ``prepare_model_for_kbit_training`` had
  cast up to fp32); the double-quantized scales stay packed (``cache_absmax`` is off);
- LoRA parameters, gradients and optimizer state as on the plain path;
- activations: each layer's input (every layer is checkpointed, whatever the config says; on the
  eager steps, core/plan.py's ``offload_for``, the inputs wait in host memory and only two are on the
  device), the stacked bf16 adapters of every layer (hoisted out of the checkpoints), one recomputed
  layer's working set in its backward, and the fused cross-entropy's gradient of the hidden states
  (the logits are never materialised); the shared buffer every 4-bit weight is dequantized into
  (as large as the widest single projection: fused products run one projection at a time);
- overhead: the CUDA context; with CUDA graphs (micro-batches of up to core/plan.py's
  GRAPH_TOKEN_LIMIT tokens), the free blocks of the graph's private pool.

``_LAYER_WORKING_SET`` was first fitted to three H100 rows of Studio's Trainer (Llama-2-7B NF4 r16
seq 512, micro-batch 1, 4, 16: bench/results/h100_speed_memory_studio_unsloth.json), then with the
slack constants to the in-sample rows of each accuracy grid. The engine of 09fac3a changed the
recomputed layer (``Plan.fused_layer``): the constants below are refitted to the in-sample rows of
the grid measured on it (bench/results/h100_vram_trainer_v5_*.json), and ``UNFUSED`` keeps the
ones fitted to the engine before, for the rows measured on that one (docs/memory.md keeps the scores).

Plain Python, like core/vram.py: it must never import torch.
"""

from __future__ import annotations

import math

from studio.core.model_info import ModelInfo
from studio.core.plan import graphs_for, offload_for

_LAYER_WORKING_SET = 1.2
"""One recomputed layer's backward holds about this many times its forward outputs (the layer's
outputs are those of the engine since 09fac3a, :func:`layer_outputs_per_token`: with fewer of them,
the gradients beside them are a larger share). Refitted with ``_GRAPH_POOL_PER_TOKEN`` to the 17
in-sample rows of bench/results/h100_vram_trainer_v5_*.json (bench/refit_vram_fast.py --search: 1.0
on the v3 grid's, with the layer's outputs of the engine before)."""

_FIXED_SLACK = 32 * 2**20
"""Reserved beyond the allocated peak that no mechanism below explains: small-pool pages and 20 MiB
mapping steps of the allocator (fitted)."""

_GRAPH_POOL_PER_TOKEN = 0.5
"""With CUDA graphs, the captured step's private pool keeps free blocks worth this many times one
layer's forward outputs per token: the layer's transients the capture freed, which the pool cannot
hand to anything outside the graph. Refitted to the in-sample rows of the v5 grid (engine of
09fac3a), where the transients of odd sizes left the layer (the q/k/v gradients' concatenation,
RoPE's q and k copies, the residual sums): graphed 7B and 8B rows with LoRA on every projection
reserved 0.03-0.09 GiB less beyond allocated than the same rows on the engine before (v3 grid; the
q/v rows the same), and the fit halves the factor (1.0 on the v3 grid; 1.5 before the layer inputs
went to the host inside the graphs)."""

_OFFLOAD_PER_TOKEN = 0
"""Hidden-state-sized free blocks per token that eager steps with the layer inputs in host memory
keep beyond the allocated peak: none on the engine since 09fac3a. On the engine before, 3 (fitted to
the v3 grid): every projection wrote a hidden-sized output of its own that a separate residual sum
then read, so such blocks were freed between the layer inputs that wait one layer for their copy to
the host (engine/fast/offload.py), and smaller requests left holes there. Each projection now writes
onto the residual stream (``torch.addmm(residual, ...)``, the base product adding itself in place):
the same eager rows on the v5 grid reserve 1 to 4 hidden states a token less beyond allocated than on
v3 (Llama-2-7B at 8192 tokens 0.218 -> 0.152 GiB, Llama-3-8B 0.426 -> 0.156, SmolLM2-135M 0.055 ->
0.027) and the search on the v5 grid's in-sample rows picks 0."""

UNFUSED = {"_LAYER_WORKING_SET": 1.0, "_GRAPH_POOL_PER_TOKEN": 1.0, "_OFFLOAD_PER_TOKEN": 3}
"""The three constants above as fitted to the engine before 09fac3a (the v3 grid's in-sample rows),
for rows measured on that engine (``Plan.fused_layer`` False: bench/rescore_vram.py sets it where a
row's engine did not say "recomputation without the last product")."""


def constants(fused: bool = True) -> tuple[float, float, float]:
    """(working set, graph pool, offload slack) of the engine since 09fac3a, or of the one before."""
    if fused:
        return _LAYER_WORKING_SET, _GRAPH_POOL_PER_TOKEN, _OFFLOAD_PER_TOKEN
    return UNFUSED["_LAYER_WORKING_SET"], UNFUSED["_GRAPH_POOL_PER_TOKEN"], UNFUSED["_OFFLOAD_PER_TOKEN"]


CAPTURE_WORKSPACES = 5
"""cuBLAS workspaces (core/vram.py's CUBLAS_WORKSPACE_BYTES each) alive when a CUDA graph is
captured: beside the default stream's (core/vram.py's STEP_WORKSPACES), the capture's warm-up and
capture streams, on the main and the autograd thread, have theirs. Counted in
the allocator's history at the peak of two H100 Trainer rows (bench/results/h100_v7_attribution.json:
five 32 MiB blocks, one from the first product of the run, four from the fused products' first calls
on the capture's streams); graphs.py frees the capture's once it is done."""


def layer_outputs_per_token(info: ModelInfo, compute_bytes: int, fused: bool = True) -> float:
    """Bytes per token of one recomputed decoder layer's forward outputs on the fast path (engine of
    09fac3a, engine/fast/layer.py): the two norms, q, k and v from their own products (liger's RoPE
    rotates them where they are: no copies), attention, o_proj's output written onto the residual
    stream (one tensor: the LoRA update's product adds the residual, the base product adds itself in
    place), the gate/up product and SwiGLU; the recomputation skips down_proj, whose value nothing
    reads. ``fused`` False, the engine before: a fused q/k/v output, the rotated q and k copied out
    of it, o_proj and the residual sum apart, and down_proj."""
    h, i = info.hidden, info.intermediate
    q = info.heads * info.head_width
    kv = info.kv_heads * info.head_width
    if fused:
        widths = 2 * h + (q + 2 * kv) + q + h + 2 * i + i
    else:
        widths = 2 * h + (q + 2 * kv) + (q + kv) + q + h + h + 2 * i + i + h
    return compute_bytes * widths


def hoisted_adapter_bytes(info: ModelInfo, r: int, targets: tuple[str, ...], compute_bytes: int) -> int:
    """The adapters cast and stacked once per forward, for every layer: stacked A (n*r x in) and a
    block-diagonal B^T (n*r x sum of the fused outputs) per fused product."""
    shapes = info.linear_shapes()
    fused = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    total = 0
    for group in fused:
        n = sum(1 for name in group if name in targets)
        if not n:
            continue
        fan_in = shapes[group[0]][0]
        outs = sum(shapes[name][1] for name in group)
        total += n * r * (fan_in + outs)
    return info.layers * total * compute_bytes


def widest_fused_weight(info: ModelInfo, compute_bytes: int) -> int:
    """Bytes of the largest fused weight the product dequantizes (gate and up together, usually)."""
    shapes = info.linear_shapes()
    h = info.hidden
    gate_up = shapes["gate_proj"][1] + shapes["up_proj"][1]
    qkv = shapes["q_proj"][1] + shapes["k_proj"][1] + shapes["v_proj"][1]
    return max(gate_up * h, qkv * h, shapes["down_proj"][0] * h) * compute_bytes


def dequant_buffer_bytes(info: ModelInfo, compute_bytes: int) -> int:
    """Bytes of the shared buffer 4-bit weights are dequantized into: one projection at a time
    (engine/fast/weights.py splits a fused product), so the widest single projection."""
    shapes = info.linear_shapes()
    return max(fan_in * fan_out for fan_in, fan_out in shapes.values()) * compute_bytes


def dequantizes(weights: str) -> bool:
    """Whether the fast path dequantizes its base weights for the products, so that it holds the
    shared buffer of :func:`dequant_buffer_bytes` and leaves holes of its size: 4-bit bases only
    (engine/fast/weights.py gives a product a Workspace only when one of its bases is 4-bit). A
    base in the compute dtype (bf16) is read where it is: no buffer, no dequantized copies."""
    return weights in ("nf4", "fp4")


def saved_per_token(info: ModelInfo, compute_bytes: int, offloaded: bool, kept_qkv: bool = False,
                    kept_attention: bool = False) -> int:
    """Bytes per token that the checkpointed layers keep on the device at a backward's start: every
    layer's input, or with the inputs on the host two of them (the one being recomputed and the
    next, prefetched) and, with ``kept_qkv`` (``Plan.kept_qkv``), the next one's q, k and v (the
    recomputed layer's own replace its q/k/v product's outputs in the working set); with
    ``kept_attention`` (``Plan.kept_attention``) also the next one's attention output and its fp32
    log-sum-exp per head."""
    if not offloaded:
        return info.layers * info.hidden * compute_bytes
    qkv = (info.heads + 2 * info.kv_heads) * info.head_width if kept_qkv else 0
    attention = (info.heads * info.head_width * compute_bytes + 4 * info.heads) if kept_qkv and kept_attention else 0
    return (2 * info.hidden + qkv) * compute_bytes + attention


def step_activations(info: ModelInfo, tokens: int, compute_bytes: int, offloaded: bool = False,
                     fused: bool = True, kept_qkv: bool = False, kept_attention: bool = False) -> float:
    """Bytes a training step holds beyond the parameters, gradients and optimizer state at its peak
    (the start of a layer's backward), without the hoisted adapters and the dequantized weight.
    ``offloaded``: the layer inputs wait on the host; two are on the device (the one being
    recomputed and the next, prefetched), and with core/plan.py's ``KEEP_QKV`` the next one's
    q, k and v (``kept_qkv``: ``Plan.kept_qkv``) and attention output (``Plan.kept_attention``).
    ``fused``: ``Plan.fused_layer``."""
    saved = tokens * saved_per_token(info, compute_bytes, offloaded, kept_qkv, kept_attention)
    working = tokens * constants(fused)[0] * layer_outputs_per_token(info, compute_bytes, fused)
    loss = tokens * 2 * info.hidden * compute_bytes  # the fused loss's gradient of the last hidden states
    return saved + working + loss


def dropout_bytes(info: ModelInfo, tokens: int, compute_bytes: int, rate: float, targets: tuple[str, ...]) -> int:
    """Adapter dropout's working copy in a recomputed layer's backward (engine/fast/weights.py's
    AdapterDropout), ``tokens x fan_in`` of the widest adapted input: one at a time, since the input
    gradient's product is masked straight into the layer's input gradient (the kernel accumulates
    into it) and freed before the adapter's own gradient regenerates the masked input. Measured on the
    H100 in one call (bench/results/h100_v7_speed_c.json, Llama-2-7B r16 on all projections, 2048
    tokens): dropout 0.05 allocated 0.042 GiB more than none, one 2048 x 11008 bf16 tensor."""
    if rate <= 0:
        return 0
    shapes = info.linear_shapes()
    widest = max((shapes[name][0] for name in targets if name in shapes), default=0)
    return tokens * widest * compute_bytes


def allocator_slack(info: ModelInfo, tokens: int, compute_bytes: int, graphs: bool,
                    offloaded: bool = False, dequantized: bool = True, fused: bool = True) -> float:
    """Reserved beyond the allocated peak: holes about two dequantized weights' size that later,
    smaller requests do not fill (the fused products' pair before they ran one projection at a time;
    ``dequantized`` False, a base in the compute dtype: none); with the layer inputs on the host, on
    the engine before 09fac3a, hidden-sized holes between them (``_OFFLOAD_PER_TOKEN``); with CUDA
    graphs, the captured step's private pool keeps its own free blocks (one pool per batch layout: a
    second layout, e.g. packed rows of another shape, adds a second pool, not modelled)."""
    slack = _FIXED_SLACK + (2 * dequant_buffer_bytes(info, compute_bytes) if dequantized else 0)
    if offloaded:
        slack += constants(fused)[2] * tokens * info.hidden * compute_bytes
    if graphs:
        slack += graph_pool_free_bytes(info, tokens, compute_bytes, fused)
    return slack


def graph_tensor_bytes(info: ModelInfo, tokens: int, compute_bytes: int) -> int:
    """The tensors a captured graph keeps for its replays as long as it lives (torch's
    ``make_graphed_callables``): its sample input (the stack's input hidden states, the first step's),
    cos and sin, its static output, the static gradient of that output and the static gradient of
    its input. In a graph's own capture they are that step's own tensors, inside the activations the
    model fits to graphed and eager rows alike; a second layout's capture has the first graph's on
    top (the packed Llama-2-7B row of the v3 grid, whose engine captured two layouts: -7.0% -> -4.8%
    allocated; still under, as a second layout's run is: bench/results/h100_v7_speed_c.json)."""
    return tokens * (4 * info.hidden + 2 * info.head_width) * compute_bytes


def graph_pool_free_bytes(info: ModelInfo, tokens: int, compute_bytes: int, fused: bool = True) -> float:
    """Free blocks a captured step's private pool keeps beside the blocks of its activations."""
    return tokens * constants(fused)[1] * layer_outputs_per_token(info, compute_bytes, fused)


def estimate_fast(info: ModelInfo, plan):
    """The training step's :class:`~studio.core.vram.Estimate` of ``plan`` (whose ``path`` is
    ``fast``) on ``info``; core/vram.py's ``estimate_plan`` adds the other phases and the card."""
    from studio.core import vram

    c = 2 if plan.compute in ("bf16", "fp16") else 4
    shapes = info.linear_shapes().values()
    linear = 0.0
    for fan_in, fan_out in shapes:
        n = fan_in * fan_out
        linear += n * vram._DTYPE_BYTES[plan.weights] + vram._quant_constants(n, plan)
    other = info.embedding_params() + info.head_params() + info.norm_params()
    weights = int(info.layers * linear + other * c)
    n_train = vram.trainable_params(info, plan)
    lora = grads = n_train * 4
    optimizer = vram.optimizer_bytes(info, plan)
    on_device_optimizer = 0 if plan.optimizer.startswith("paged") else optimizer
    tokens = plan.real_tokens  # the fast path drops the padding before the model
    graphs = graphs_for(tokens, plan.lora_dropout, cuda=True)  # the engine's own rules (core/plan.py)
    offloaded = offload_for(tokens, plan.lora_dropout, cuda=True)
    dequantized = dequantizes(plan.weights)
    dequant = dequant_buffer_bytes(info, c) if dequantized else 0  # the shared dequantization buffer
    fused = plan.fused_layer
    activations = (step_activations(info, tokens, c, offloaded, fused, plan.kept_qkv, plan.kept_attention)
                   + hoisted_adapter_bytes(info, plan.lora_r or 0, plan.lora_targets, c)
                   + dequant
                   + vram.CUBLAS_WORKSPACE_BYTES
                   + dropout_bytes(info, tokens, c, plan.lora_dropout, plan.lora_targets))
    # Gradients exist through the whole step (the graphs' backward adds into them in place) and the
    # optimizer's foreach temporary comes after the activations are gone: the backward is the peak.
    temp = n_train * 4 if plan.optimizer == "adamw" else 0
    held = int(weights + lora + on_device_optimizer + grads + max(activations, temp))
    # Packed short examples are one layout (a fuller micro-batch widens it: FastModel._static_layout);
    # the engine used to keep one per example-count bucket, and the packed H100 row captured two.
    packed_short = plan.packing and bool(plan.lengths) and plan.lengths[-1] < plan.seq_len
    layouts = plan.data_sized or (packed_short and plan.packed_layouts > 1)
    workspace = vram.CUBLAS_WORKSPACE_BYTES
    if graphs:
        # The graph is captured in the first step, before the optimizer has any state: that moment
        # holds the capture's activations and its streams' cuBLAS workspaces, without the optimizer.
        # Later steps replay inside the graph's private pool, whose blocks the allocator counts as
        # free (reserved, not allocated); the optimizer's state and step come after (reserved keeps
        # both: the pool stays mapped when the state arrives). A second layout's capture comes in a
        # later step, with the state and the first graph's fixed tensors (graph_tensor_bytes).
        capture = activations + (CAPTURE_WORKSPACES - 1) * workspace
        state = on_device_optimizer
        at_capture = weights + lora + grads + capture + (state + graph_tensor_bytes(info, tokens, c) if layouts else 0)
        peak_allocated = int(max(at_capture, weights + lora + grads + state + temp))
    else:
        # Eager steps: every product-running thread has its workspace (activations count one).
        extra = (vram.STEP_WORKSPACES - 1) * workspace
        peak_allocated = int(weights + lora + on_device_optimizer + grads + max(activations + extra, temp))
    slack = allocator_slack(info, tokens, c, graphs, offloaded, dequantized, fused)
    second_pool = 0.0
    if graphs and layouts:
        # Unpacked rows of varying lengths come in several layouts, and the engine captures one graph
        # per layout up to FastOptions.max_graphs (2), each with its own private pool: a second copy
        # of the graph's held activations (its layer inputs on the host too) and free blocks (the
        # short-padded H100 row captured two).
        second_pool = (step_activations(info, tokens, c, offloaded, fused, plan.kept_qkv, plan.kept_attention)
                       + graph_pool_free_bytes(info, tokens, c, fused))
        slack += second_pool
    page = 2 * 2**20
    eager_extra = 0 if graphs else (vram.STEP_WORKSPACES - 1) * workspace  # mapped too
    need = max(held + eager_extra + slack, peak_allocated)
    if graphs:
        # The capture's own moment reserves its allocated peak, the free blocks its private pool has
        # by then and the allocator's fixed slack (a later step's other holes, the dequantized weights'
        # and the prefetched inputs', are not there yet: torch.cuda.graph empties the cache before it
        # captures). It is the peak where the optimizer's state is smaller than the capture's four
        # extra cuBLAS workspaces: SmolLM2-135M r8 on q and v keeps 3.5 MB of state, and its H100 row
        # reserved 109 MB beyond allocated at the capture (bench/results/h100_v7_attribution.json).
        need = max(need, at_capture + _FIXED_SLACK + graph_pool_free_bytes(info, tokens, c, fused) + second_pool)
    peak_reserved = int(math.ceil(need / page) * page)
    overhead = peak_reserved - held + vram.CUDA_CONTEXT_BYTES
    categories = {"weights": weights, "lora": int(lora), "gradients": int(grads), "optimizer": int(optimizer),
                  "activations": int(held - weights - lora - on_device_optimizer - grads),
                  "overhead": int(overhead)}
    total = sum(categories.values())
    notes = ["fast path (studio/engine/fast): every layer checkpointed, fused cross-entropy, "
             + ("CUDA graphs" if graphs else "eager steps with the layer inputs in host memory")]
    if graphs and peak_allocated < held:
        notes.append("allocated peaks at the first step's CUDA-graph capture, before the optimizer has "
                     "state (the categories are a later step's)")
    if plan.optimizer.startswith("paged"):
        notes.append("paged optimizer state lives in unified memory: it spills to host RAM under "
                     "pressure and torch.cuda's counters do not see it")
    if plan.seq_len > info.max_positions:
        notes.append(f"sequence length {plan.seq_len} exceeds the model's {info.max_positions} positions")
    notes.append("overhead includes ~0.8 GB of CUDA context that only nvidia-smi shows")
    return vram.Estimate(categories, total, None, None, None, peak_allocated, peak_reserved, plan, notes)
