"""The fast training path: a lean forward/backward for Llama-style QLoRA models.

The plain path (``model(**batch).loss`` through transformers + PEFT + bitsandbytes) spends most of
a step outside the matrix products: per-module Python, fp32 casts of the residual stream, a dropout
kernel per adapter, each 4-bit weight dequantized through several small kernels, a logits tensor of
``tokens x vocab`` floats. This package computes the *same function* with fewer, larger operations,
one concern a module:

- ``weights``: projections sharing an input are fused (q/k/v in one product, gate/up in one), the
  frozen 4-bit weights are dequantized straight into the fused matrix, and the LoRA update is added
  by the same product's epilogue (``addmm``), with a hand-written backward that re-dequantizes
  instead of keeping the bf16 weights; every 4-bit weight is dequantized into one shared buffer;
- ``dequant``: an NF4 weight dequantized by one Triton kernel, its double-quantized scales
  expanded in the same pass (bitsandbytes' values to the bit, in one kernel instead of three);
- ``ops``: RMSNorm, RoPE, SwiGLU and the cross-entropy come from liger-kernel's Triton kernels when
  it is installed on a CUDA machine (the cross-entropy is fused with the output projection, so the
  logits are never materialised), with plain torch code as the fallback;
- ``layer``: each decoder layer runs as one function; attention runs per example of a flat stream
  (flash-attention varlen on CUDA, a block-diagonal mask elsewhere), so packed rows never see each
  other;
- ``model``: padding is removed before the model, the residual stream stays in the compute dtype
  (bf16) from embedding to loss, and each layer is checkpointed (non-reentrant);
- ``loss``: the cross-entropy over the vocabulary without a ``tokens x vocab`` logits tensor, for
  training (fused) and for evaluation (chunked, with argmax hits);
- ``dropout``: adapter dropout whose masks are a function of (micro-batch seed, adapter, element),
  so graphs replay each step's masks and recomputed layers regenerate them (nothing saved);
- ``graphs``: the decoder stack's forward and backward are replayed as CUDA graphs;
- ``offload``: on the steps that run eagerly, each layer's checkpointed input waits in pinned host
  memory between the forward and the backward;
- ``build``: which models are covered (:func:`prepare`) and when the trainer uses it (:func:`enable`).

The trainable parameters are PEFT's own ``lora_A`` / ``lora_B`` weights, so the optimizer, the
checkpoints and ``save_pretrained`` are untouched; only the loss computation changes.
:func:`prepare` returns None (with a reason) for models it does not cover, and the caller keeps the
plain path. The MFU helpers live in :mod:`studio.engine.flops` and are re-exported here for the
trainer.
"""

from studio.engine.fast.build import FAST_PATH_ENV, enable, prepare
from studio.engine.fast.loss import IGNORE_INDEX
from studio.engine.fast.model import FastModel, FastOptions
from studio.engine.flops import matmul_tflops, model_flops_per_token

__all__ = ["FAST_PATH_ENV", "IGNORE_INDEX", "FastModel", "FastOptions", "enable", "matmul_tflops",
           "model_flops_per_token", "prepare"]
