"""The phases of a run besides the training step: evaluation, generation for chat, checkpoint save.

core/memory/plain.py and core/memory/fast.py model the training step. A run does more with the same memory
between steps, and its peak is the largest of them all (issue 18: the 7B run that trained at
micro-batch 32 under a 15 GB cap and died in its final evaluation):

- **evaluation** (``Trainer.evaluate``): no gradients, one micro-batch of validation rows at a time.
  The fast path's ``FastModel.score`` runs at most ``SCORE_TOKENS`` (512) tokens a forward pass (one
  row when a row is longer) and goes through the vocabulary in chunks whose fp32 logits are no larger
  than those tokens' hidden states in fp32 (engine/fast/loss.py); held: the pass's hidden states
  and residual, one layer's no-gradient working set, one layer's hoisted adapters, the chunk's logits
  (bf16 and fp32) and the gathered target rows; a DPO evaluation's reference pass runs a whole
  micro-batch (core/memory/fast.py's ``reference_pass_bytes``). The plain path's evaluation is its
  model's forward on the whole micro-batch with the logits (compute dtype, their fp32 copy and
  log-softmax) and, like generation's, one dequantized weight or group of 4-bit experts;
- **generation** (``Session.generate``, what chat and the held-out comparison call): a prompt of
  :attr:`~studio.core.memory.plan.Plan.generate_prompt_tokens` (a training row's length unless said) and
  ``generation.max_new_tokens`` new ones, through the transformers modules on both paths: the KV cache
  of every layer for prompt + answer, the prompt pass's working set of one layer (the prompt goes
  through :data:`PREFILL_TOKENS` tokens at a time), one weight
  dequantized by bitsandbytes for its product or, in a sparse layer with 4-bit experts, a group of
  experts' weights in 16 bits (with ``lora.target_experts`` the whole layer's and PEFT's adapted
  copy: core/memory/expert_groups.py), whichever is larger, the last
  position's logits only (engine/generate.py
  asks for ``logits_to_keep=1``) with their fp32 softmax, and on the plain k-bit path autocast's copy
  of the fp32 output head. When that could reserve more than the training step (a prompt as long
  as a training row whose step keeps its layer inputs on the host), the KV cache lives on the host too
  (:attr:`PhasePeak.host_kv`, which the engine reads: engine/session.py) and the card holds
  :data:`KV_LAYERS_ON_CARD` layers of it at a time;
- **checkpoint save**: the adapter and the optimizer state are copied to the host tensor by tensor;
  nothing beyond what persists on the card;
- **GRPO sampling** (a GRPO run's, engine/sampler.py): a micro-batch's prompts, each
  ``num_generations`` times, sampled together: the KV cache of every row for ``data.max_seq_length``
  slots (prompt room plus ``max_completion_length``, allocated whole), the prefill's working set of
  one layer over every row's prompt, one weight dequantized by bitsandbytes, the last position's
  logits with the sampling noise (int64 hashes and fp32 draws of a row x the vocabulary), and on a
  GPU the decode step's CUDA graph pool, about one more dequantized weight; the gradients of the
  step's earlier micro-batches are alive. The sampler gives the pool and the cache back before the
  scored pass (engine/sampler.py), so neither sits beside the training step's own memory. A GRPO
  run's evaluation is the same greedy sampling of held-out prompts, so its evaluation phase is this
  one.

What persists through all of them: the weights, the adapters, the optimizer state (gradients are
freed after every optimizer step: ``zero_grad(set_to_none=True)``), on the fast path its shared
dequantization buffer and, where the step ran as a CUDA graph, the graph's private pool, which
nothing outside the graph can reuse. The evaluation after the last step is the exception: the engine
gives the graphs and their pools back before it (engine/train.py), so only an evaluation between two
steps (:attr:`~studio.core.memory.plan.Plan.evaluates_between_steps`) runs beside a pool. Reserved
memory never shrinks during a run, so a phase's reserved peak is the training step's, or what the
phase needs on top of what persists when that is more.

Plain Python: it must never import torch.
"""

from __future__ import annotations

import math

from studio.core.memory.allocator import CUBLAS_WORKSPACE_BYTES, PAGE, SLACK_FLOOR, STEP_WORKSPACES
from studio.core.memory.expert_groups import captured_expert_bytes, lent_expert_bytes
from studio.core.memory.fast import (
    dequant_buffer_bytes,
    dequantizes,
    expert_buffer_bytes,
    gate_in_kernel,
    graph_pool_bytes,
    hoisted_adapter_bytes,
    kept_attention_per_token,
    reference_pass_bytes,
    shared_pool_growth,
)
from studio.core.memory.params import compute_bytes
from studio.core.memory.plain import stream_bytes
from studio.core.memory.plan import Plan
from studio.core.memory.result import GRPO_SAMPLING, MODEL_LOAD, Estimate, PhasePeak
from studio.core.model.info import ModelInfo
from studio.core.plan import graphs_for

SCORE_TOKENS = 512
"""The fast path's evaluation (engine/fast/model.py's ``FastModel.score``) runs at most this many
tokens a forward pass (a longer row runs alone). Between two steps its working set comes on top of
the CUDA graphs' private pool, which an eager pass cannot reuse: at 2048 tokens an evaluation of a
micro-batch of 4 x 512 beside the pool reserved 0.11 GiB more than the training step on the H100
(docs/memory.md)."""

PREFILL_TOKENS = 512
"""engine/generate.py runs a prompt through the model this many tokens at a time (each piece
attending to the KV cache of those before), so a long prompt's pass holds one piece's working set."""

KV_LAYERS_ON_CARD = 3
"""Layers of a host-resident KV cache on the card at the worst moment of a new token: the layer
being extended (its copy brought back and the copy with the new token) and the next one, brought
back ahead of time on a side stream (transformers' ``DynamicCache(offloading=True)``)."""


def eval_tokens(plan: Plan) -> int:
    """Tokens of the evaluation's largest forward pass: the fast path scores ``SCORE_TOKENS // row``
    rows at a time (at least one) of a micro-batch; the plain path runs the whole micro-batch."""
    rows = plan.rows
    if plan.path == "fast":
        rows = min(rows, max(1, SCORE_TOKENS // plan.row_len))
    return rows * plan.row_len


def _layer_forward(info: ModelInfo, width: int) -> float:
    """Bytes per token of one decoder layer's forward without gradients at its largest moment (the
    MLP): the layer's input and its normed copy, the gate and up outputs and their SwiGLU product,
    in a stream of ``width`` bytes; the attention half holds less."""
    return width * (2 * info.hidden + 3 * info.intermediate)


def phase_peaks(info: ModelInfo, plan: Plan, step: Estimate) -> dict[str, PhasePeak]:
    """Every phase's :class:`PhasePeak` for ``plan`` on ``info``; ``step`` is the training step's
    estimate (its weights, adapters and optimizer state persist)."""
    c = compute_bytes(plan)
    fast_path = plan.path == "fast"
    kept = step.categories
    optimizer = 0 if plan.optimizer.startswith("paged") else kept["optimizer"]  # paged state is not on the card
    persistent = (kept["weights"] + kept["experts"] + kept["lora"] + optimizer
                  + STEP_WORKSPACES * CUBLAS_WORKSPACE_BYTES)
    pool = 0.0
    if fast_path:
        if dequantizes(plan.weights):
            # the shared dequantization buffer (one projection of every expert with 4-bit experts)
            persistent += dequant_buffer_bytes(info, c) + expert_buffer_bytes(info, plan)
        tokens = plan.real_tokens
        if plan.cuda_graphs and graphs_for(tokens, plan.lora_dropout, cuda=True):
            in_kernel, attention = gate_in_kernel(plan), kept_attention_per_token(info, plan)
            pool = graph_pool_bytes(info, tokens, c, in_kernel, attention)
            if plan.reference_pass:  # DPO's reference graph shares the pool
                pool += shared_pool_growth(info, tokens, c, in_kernel, attention)
    # the residual stream's width: bf16 on the fast path (its prepare casts embeddings and norms down),
    # fp32 after prepare_model_for_kbit_training on the plain one
    stream = c if fast_path else stream_bytes(plan)
    head_copy = 0
    if not fast_path and plan.upcast and c < 4:
        head_copy = c * info.head_params()  # autocast's bf16 copy of the fp32 output head, per call
    dequant = max(a * b for a, b in info.linear_shapes().values()) * 2 if plan.quantized else 0
    # transformers' forward without gradients: a dense weight dequantized for its product, or in a
    # sparse layer 4-bit experts in 16 bits, a group of them (never both at once)
    lent = max(dequant, lent_expert_bytes(info, plan))

    t = eval_tokens(plan)
    if fast_path:
        # a chunk's fp32 logits (at most the pass's hidden states in fp32) and their bf16 product
        chunk = t * info.hidden * (4 + 2)
        evaluation = (t * c * info.hidden * 3  # hidden states, residual, the gathered target rows
                      + t * _layer_forward(info, c) + chunk
                      + hoisted_adapter_bytes(info, plan.lora_r or 0, plan.lora_targets, c) / info.layers)
        eval_held = f"{t} tokens a pass, vocabulary in chunks"
        if plan.reference_pass:  # DPO's evaluation runs the reference pass on a whole micro-batch
            evaluation = max(evaluation, reference_pass_bytes(info, plan.real_tokens, c))
    else:
        evaluation = (t * stream * info.hidden * 2 + t * _layer_forward(info, stream)
                      + t * info.vocab * (c + 8) + head_copy + lent)
        eval_held = f"{t} tokens, their logits and fp32 log-softmax"

    prompt = plan.generate_prompt_tokens or plan.seq_len
    context = prompt + plan.generate_new_tokens
    kv = info.layers * 2 * info.kv_heads * info.head_width * context * stream
    piece = min(prompt, PREFILL_TOKENS)
    answer = (piece * stream * info.hidden * 2 + piece * _layer_forward(info, stream)
              + lent + head_copy + info.vocab * (c + 4 + 4))
    gen_held = f"KV cache of {prompt} + {plan.generate_new_tokens} tokens ({kv / 1e9:.2f} GB), last logits only"

    # Between two steps run as CUDA graphs the adapters' gradients stay in the graphs' fixed tensors
    # (engine/fast/graphs.py's GradSink): an answer or an evaluation there holds them too.
    sink = kept["gradients"] if pool else 0

    def peak(work: float, held: str, host_kv: bool = False, beside_pool: bool = True) -> PhasePeak:
        grads = sink if beside_pool else 0
        allocated = int(persistent + grads + work)
        need = math.ceil((allocated + (pool if beside_pool else 0) + SLACK_FLOOR) / PAGE) * PAGE
        return PhasePeak(allocated, max(step.peak_reserved, need), held, host_kv, int(grads))

    generation = peak(answer + kv, gen_held)
    # On the card only with a margin of one more KV cache under both of the step's peaks: a step run
    # as a CUDA graph holds its activations in the graph's private pool, which an eager answer cannot
    # reuse, so an answer that fits under the step's peak can still reserve more (on the v3 grid's
    # H100 rows, 9 answers of 25 did, by 0.06-1.5 GiB; this rule sends all 9 to the host, and one
    # more that had fitted). The reserved side takes the margin too: SmolLM2 r8 at 4096 tokens, whose
    # answer on the card had reserved 14% more than its step, comes out 10 MB under it without.
    margin = peak(answer + 2 * kv, gen_held)
    if margin.reserved > step.peak_reserved or margin.allocated > step.peak_allocated:
        on_card = kv * min(1.0, KV_LAYERS_ON_CARD / info.layers)
        generation = peak(answer + on_card, (f"KV cache of {prompt} + {plan.generate_new_tokens} tokens "
                                             f"({kv / 1e9:.2f} GB) on the host, {KV_LAYERS_ON_CARD} layers "
                                             "of it on the card; last logits only"), host_kv=True)
    if pool and not plan.evaluates_between_steps:
        eval_held += ", after the CUDA graphs' pools are given back"
    phases = {"training step": PhasePeak(step.peak_allocated, step.peak_reserved, "the step's activations"),
              "evaluation": peak(evaluation, eval_held, beside_pool=plan.evaluates_between_steps),
              "generation": generation,
              "checkpoint save": peak(0, "adapter and optimizer state copied to the host")}
    loading = load_peak(info, plan, step)
    if loading is not None:
        phases = {MODEL_LOAD: loading, **phases}
    if plan.grpo_completion:
        grads = kept["gradients"] if plan.accumulation > 1 and not sink else 0  # (the sink's: counted by peak)
        work, held = grpo_sampling(info, plan, stream, dequant)
        phases[GRPO_SAMPLING] = peak(work + grads, held)
        phases["evaluation"] = peak(work, f"greedy completions of held-out prompts: {held}",
                                    beside_pool=plan.evaluates_between_steps)
    return phases


def grpo_sampling(info: ModelInfo, plan: Plan, stream: int, dequant: float) -> tuple[float, str]:
    """Bytes a GRPO micro-batch's sampling holds beyond what persists, and what they are in words.
    ``dequant``: one dense weight dequantized for its product. A mixture of experts' 4-bit experts
    are lent in 16 bits instead: a group at a time in the eager prefill, the whole layer in the
    captured decode step (core/memory/expert_groups.py)."""
    rows = plan.rows
    prompt = max(1, plan.seq_len - plan.grpo_completion)
    kv = info.layers * 2 * info.kv_heads * info.head_width * rows * plan.seq_len * stream
    tokens = rows * prompt
    prefill = tokens * stream * info.hidden * 2 + tokens * _layer_forward(info, stream) + rows * prompt * prompt
    # the last position's logits (compute dtype, fp32) and the noise: int64 hashes, fp32 draws
    choose = rows * info.vocab * (compute_bytes(plan) + 4 + 3 * 8 + 4)
    lent = max(dequant, lent_expert_bytes(info, plan))
    # the decode step's captured working set: about one dequantized weight, or a whole sparse layer
    graph_pool = max(dequant, captured_expert_bytes(info, plan))
    return (kv + prefill + lent + choose + graph_pool,
            f"KV cache of {rows} rows x {plan.seq_len} slots ({kv / 1e9:.2f} GB), the prefill of "
            f"{rows} x {prompt} prompt tokens, last logits only")


def load_peak(info: ModelInfo, plan: Plan, step: Estimate) -> PhasePeak | None:
    """The model load's peak for a mixture of experts whose 16-bit experts are packed in 4 bits as
    they load (engine/quantized_experts.py); None for any other load, which puts each weight on the
    card once, in its final form (gpt-oss' MXFP4 experts are kept as shipped).

    transformers builds one layer's fused gate/up projection from the checkpoint's tensors in 16
    bits: the tensors as read, their stack, the concatenation of gate with up, each as large as the
    layer's gate/up weights of every expert. The last two are alive when the packing reads them, on
    top of every weight loaded so far (all but this layer's packed experts); all three are reserved,
    their sizes too unlike the 4-bit blocks for the allocator to reuse. Measured at 3687b1f on
    OLMoE-1B-7B, Qwen3-30B-A3B (8 layers) and Mixtral-8x7B (4 layers), where the load set the run's
    peak (bench/results/archive/h200_vram_measured_moe_3687b1f.json)."""
    if not info.sparse_layers or not dequantizes(plan.weights) or info.expert_format == "mxfp4":
        return None
    gate_up = info.experts * 2 * info.expert_intermediate * info.hidden * compute_bytes(plan)
    kept = step.categories
    loaded = kept["weights"] + kept["experts"] - kept["experts"] // info.sparse_layers
    allocated = int(loaded + 2 * gate_up)
    reserved = math.ceil((loaded + 3 * gate_up + SLACK_FLOOR) / PAGE) * PAGE
    return PhasePeak(allocated, reserved, "one layer's experts in 16 bits while they are packed "
                     f"({gate_up / 1e9:.2f} GB for gate/up, three copies)")


def peak_phase(phases: dict[str, PhasePeak]) -> str:
    """The phase that sets the run's peak reserved memory (the training step on a tie)."""
    return max(phases, key=lambda name: (phases[name].reserved, name == "training step"))
