"""Bytes of what a run keeps from start to end: base weights, adapters, gradients, optimizer state.

The counts follow what transformers + PEFT + bitsandbytes allocate: bitsandbytes' packed 4-bit and
8-bit weights with their quantization constants, PEFT's fp32 adapters, torch's and bitsandbytes'
AdamW state.

Plain Python: it must never import torch.
"""

from __future__ import annotations

import math

from studio.core.memory.plan import Plan
from studio.core.model.info import ModelInfo

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "nf4": 0.5, "fp4": 0.5}
"""Bytes an element of each storage format takes (4-bit formats pack two a byte)."""

MXFP4_BYTES = 0.5 + 1 / 32
"""Bytes a weight takes in MXFP4 (gpt-oss' shipped experts): two values a byte and one scale byte a
block of 32 (4.25 bits)."""

QUANT_BLOCK = 64
"""bitsandbytes' 4-bit block size: one absmax constant per 64 weights (engine/quantized_experts.py
packs experts with it too)."""
_NESTED_BLOCK = 256  # double quant: one fp32 constant per 256 absmax bytes
_OPTIM8_BLOCK = 256  # bitsandbytes 8-bit optimizers: one fp32 absmax per 256 state bytes
_OPTIM8_MIN_SIZE = 4096  # smaller tensors keep 32-bit optimizer state in bitsandbytes


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (a compute dtype: bf16, fp16, fp32)."""
    return int(DTYPE_BYTES[dtype])


def compute_bytes(plan: Plan) -> int:
    """Bytes of one element in the plan's compute dtype."""
    return dtype_bytes(plan.compute)


def lora_params(info: ModelInfo, r: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: r x (in + out) per targeted linear module, in every layer that has it
    (a sparse layer's MLP has no linear module)."""
    shapes = info.linear_shapes()
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"lora.target_modules: {', '.join(unknown)} not in the model "
                         f"(known: {', '.join(shapes)}, or all-linear)")
    return sum(info.layers_with(t) * r * (shapes[t][0] + shapes[t][1]) for t in targets)


def expert_lora_params(info: ModelInfo, plan: Plan) -> int:
    """The experts' adapters (``lora.target_experts``, PEFT's ``target_parameters``): r x (in + out)
    per expert for gate/up (hidden -> 2 x intermediate) and down (intermediate -> hidden), in every
    sparse layer; 0 when off. ValueError naming the key on a dense model."""
    if not plan.lora_experts or plan.lora_r is None:
        return 0
    if not info.sparse_layers:
        raise ValueError("lora.target_experts: the model has no mixture-of-experts layers; set it to false")
    hidden, inter = info.hidden, info.expert_intermediate
    per_expert = plan.lora_r * ((hidden + 2 * inter) + (inter + hidden))
    return info.sparse_layers * info.experts * per_expert


def quant_constants(n: int, plan: Plan) -> float:
    """Bytes of bitsandbytes quantization constants for one 4-bit weight matrix of ``n`` elements
    (0 for other formats: LLM.int8's per-row scales depend on the shape, :func:`weight_bytes` adds them)."""
    if plan.weights in ("nf4", "fp4"):
        blocks = math.ceil(n / QUANT_BLOCK)
        if plan.double_quant:
            # uint8 absmax per block, fp32 absmax per 256 of those, a 256-entry fp32 code, an offset
            return blocks + 4 * math.ceil(blocks / _NESTED_BLOCK) + 1024 + 4 + 64
        return 4 * blocks + 64
    return 0.0


def linear_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes of one decoder layer's frozen weights as stored: the linear modules' packed data plus
    their constants; where some layers are sparse, the mean over the layers, their experts and
    router included (:func:`expert_bytes`), so that ``layers x`` this is the whole stack's."""
    total = 0.0
    for name, (fan_in, fan_out) in info.linear_shapes().items():
        n = fan_in * fan_out
        total += info.layers_with(name) * (n * DTYPE_BYTES[plan.weights] + quant_constants(n, plan))
    return (total + expert_bytes(info, plan)) / max(1, info.layers)


def expert_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes of every sparse layer's experts and router (0 for a dense model): the experts as
    :func:`experts_stored_bytes`, the routers in the compute dtype where the linear modules are
    quantized (bitsandbytes' loading leaves them so), else in the weights' dtype."""
    router = DTYPE_BYTES[plan.compute if plan.quantized else plan.weights]
    return experts_stored_bytes(info, plan) + info.router_params() * router


def experts_stored_bytes(info: ModelInfo, plan: Plan) -> float:
    """Bytes of every sparse layer's expert weights as stored, the estimate's ``experts`` category:
    with 4-bit weights packed like the linear modules (engine/quantized_experts.py: one block of
    scales per 64 values, double-quantized as configured, per projection), or in MXFP4 as the
    checkpoint ships them (gpt-oss, engine/mxfp4.py: 4.25 bits a weight); with 8-bit weights in the
    compute dtype (bitsandbytes' int8 loading leaves the 3-D tensors alone), else in the weights'
    dtype. Expert biases (gpt-oss) stay in the compute dtype. 0 for a dense model."""
    if not info.sparse_layers:
        return 0.0
    stored = DTYPE_BYTES[plan.compute if plan.quantized else plan.weights]
    biases = (info.expert_params() - info.expert_weight_params()) * stored
    if plan.weights in ("nf4", "fp4"):
        if info.expert_format == "mxfp4":
            return info.expert_weight_params() * MXFP4_BYTES + biases
        # per sparse layer: gate/up [experts, 2 x intermediate, hidden] and down [experts, hidden, intermediate]
        n = info.experts * info.hidden * info.expert_intermediate
        per_layer = 3 * n * DTYPE_BYTES[plan.weights] + quant_constants(2 * n, plan) + quant_constants(n, plan)
        return info.sparse_layers * per_layer + biases
    return info.expert_weight_params() * stored + biases


def weight_bytes(info: ModelInfo, plan: Plan) -> int:
    """Bytes of the base model's parameters on the plain path, as loaded and prepared for training.

    Quantized linears: packed data plus constants. Everything else (embeddings, lm_head, norms) is
    in the compute dtype, except after ``prepare_model_for_kbit_training`` (which Studio runs for
    4-bit and 8-bit), which casts all of it to fp32.
    """
    linear = linear_bytes(info, plan)
    if plan.weights == "int8":  # fp32 scale per row (SCB)
        rows = sum(info.layers_with(t) * fan_out for t, (_, fan_out) in info.linear_shapes().items())
        linear += 4 * rows / info.layers
    other = info.embedding_params() + info.head_params() + info.norm_params() + info.vision_params
    if plan.lora_r is None:  # full fine-tuning: everything in the weights' dtype (int8: illustrative)
        other_bytes = DTYPE_BYTES[plan.compute if plan.quantized else plan.weights]
    else:
        other_bytes = 4 if plan.upcast else DTYPE_BYTES[plan.compute]
    return int(info.layers * linear + other * other_bytes)


def trainable_params(info: ModelInfo, plan: Plan) -> int:
    """Parameters that get gradients and optimizer state."""
    if plan.lora_r is None:
        return info.total_params()
    return lora_params(info, plan.lora_r, plan.lora_targets) + expert_lora_params(info, plan) + dora_params(info, plan)


def dora_params(info: ModelInfo, plan: Plan) -> int:
    """DoRA's magnitude vectors: one value per output feature of every adapted module (0 without DoRA)."""
    if not plan.dora or plan.lora_r is None:
        return 0
    shapes = info.linear_shapes()
    return sum(info.layers_with(t) * shapes[t][1] for t in plan.lora_targets if t in shapes)


def trainable_dtype_bytes(plan: Plan) -> int:
    """Bytes of one trainable parameter (and of its gradient)."""
    # PEFT keeps adapters in fp32 (autocast_adapter_dtype); full fine-tuning trains the weights as
    # stored (int8 weights cannot take updates: the walkthrough shows that step with bf16 updates)
    if plan.lora_r is not None:
        return 4
    return 2 if plan.quantized else int(DTYPE_BYTES[plan.weights])


def optimizer_bytes(info: ModelInfo, plan: Plan) -> int:
    """Optimizer state: torch AdamW's m and v in the parameter's dtype (bf16 weights of a full
    fine-tune: 4 B a parameter), bitsandbytes' 32-bit paged AdamW's in fp32 whatever the parameter's
    dtype (8 B), or bitsandbytes 8-bit blocks."""
    n = trainable_params(info, plan)
    if plan.optimizer == "adamw":
        return 2 * n * trainable_dtype_bytes(plan)
    if plan.optimizer == "paged_adamw":
        return 2 * n * 4
    # 8-bit: one byte per element for m and v, plus an fp32 absmax per 256; tensors under 4096
    # elements keep 32-bit state (bitsandbytes' min_8bit_size).
    small = _small_tensor_params(info, plan)
    big = n - small
    return int(2 * (big + 4 * math.ceil(big / _OPTIM8_BLOCK)) + 8 * small)


def lora_matrix_sizes(info: ModelInfo, plan: Plan) -> list[int]:
    """Elements of each LoRA matrix (A: r x fan_in, B: fan_out x r) of one layer."""
    shapes = info.linear_shapes()
    return [plan.lora_r * fan for t in plan.lora_targets for fan in shapes[t]]


def _small_tensor_params(info: ModelInfo, plan: Plan) -> int:
    """Trainable parameters in tensors too small for 8-bit optimizer state."""
    if plan.lora_r is None:
        return info.norm_params()
    # DoRA's magnitude vectors are as wide as a module's output: thousands, at the 8-bit threshold
    magnitudes = [info.linear_shapes()[t][1] for t in plan.lora_targets] if plan.dora else []
    small = sum(n for n in (*lora_matrix_sizes(info, plan), *magnitudes) if n < _OPTIM8_MIN_SIZE)
    return small * info.layers
