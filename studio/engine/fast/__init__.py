"""The fast training path: a lean forward/backward for QLoRA on every decoder core/decoder/ describes.

The plain path (``model(**batch).loss`` through transformers + PEFT + bitsandbytes) spends most of
a step outside the matrix products: per-module Python, fp32 casts of the residual stream, a dropout
kernel per adapter, each 4-bit weight dequantized through several small kernels, a logits tensor of
``tokens x vocab`` floats. This package computes the *same function* with fewer, larger operations,
one concern a module (the imports point down this list):

- ``build``: which models are covered (:func:`prepare`), and when the trainer uses it
  (:func:`enable`, with the run's ``trainer.fast_path`` settings); a model's layers are built from
  its description (core/decoder's DecoderSpec) and its loaded modules, so a family is data here;
- ``model``: :class:`FastModel`, the loss: padding removed before the model (packed rows become one
  flat stream of examples), the residual stream in the compute dtype (bf16) from embedding to loss,
  each layer checkpointed, the stack replayed as CUDA graphs or run eagerly;
- ``graphs``: the decoder stack's forward and backward captured and replayed as CUDA graphs, one a
  batch layout, the adapters' gradients added inside the graph (``GradSink``);
- ``offload``: each checkpointed layer's input, and its rotated q, k and v (and the fused
  attention's output and log-sum-exp), waiting in pinned host memory between the forward and the
  backward, copied behind the compute, so that the recomputation runs none of what they hold;
- ``layer``: one decoder layer as one function, for every family: norms (pre, post or sandwich;
  Llama's or Gemma's casting), fused projections, q/k norms, RoPE (partial, per layer type, or
  none), the gated MLP (SwiGLU, GeGLU) or a mixture of experts (``moe``: routers with or without a
  bias, SiLU or gpt-oss' clamped SwiGLU experts, with or without biases, their weights 16-bit,
  NF4 or MXFP4), residual multipliers; each a branch only where the description asks for it;
- ``attention``: causal attention per example of the flat stream (flash-attention varlen on CUDA,
  a block-diagonal mask elsewhere), with the layer's scale and sliding window; soft-capped scores
  (Gemma 2) and attention sinks (gpt-oss) through ``fused_attention`` where it runs, else in plain
  torch, a block of queries at a time, recomputed in the backward;
- ``fused_attention`` (kernels in ``fused_attention_kernels``): soft-capped scores and sinks in
  Triton kernels of Studio's own, flash attention's way (forward and backward, O(tokens) memory,
  example boundaries read on the device);
- ``projection``: the linears that share an input (q/k/v, o, gate/up, down; Phi-3's fused
  modules), with their PEFT adapters, run as one fused product;
- ``products``: the fused QLoRA products as autograd functions, with hand-written backwards that
  dequantize the frozen weights again instead of keeping them; frozen biases added by the products;
- ``frozen``: the frozen base weights, multiplied one projection at a time, 4-bit ones dequantized
  into one buffer the whole model shares;
- ``dequant`` (kernel in ``dequant_kernel``): an NF4 weight dequantized by one Triton kernel, its
  double-quantized scales expanded in the same pass (bitsandbytes' values to the bit);
- ``mxfp4_dequant`` (kernel in ``mxfp4_kernel``): gpt-oss' MXFP4 experts dequantized by one Triton
  kernel for engine/mxfp4.py (its torch operations' values to the bit);
- ``update`` (kernels in ``update_kernels``): the LoRA update added by the kernel that reads the
  product's output (the gated activation: SwiGLU, GeGLU; the residual's add) instead of written
  out on its own;
- ``norm`` (kernels in ``norm_kernels``): the layer's RMSNorm whose backward adds the residual
  stream's gradient in the same pass;
- ``moe``: a sparse layer's router, sort by expert, grouped products and combine; ``routing``: its
  routing's log (the tokens each expert took, the balance loss) and what a forward keeps of it for
  the recomputation; ``expert_activation`` (kernels in ``expert_activation_kernels``):
  its experts' activation times the routing weight, one kernel a pass; ``expert_copies`` (kernel in
  ``expert_copies_kernels``): each token's copies gathered into expert order and summed back;
  ``stored_experts`` (kernels in ``stored_experts_kernels``, the code decoded by ``fourbit_decode``'s
  PTX): grouped products that read 4-bit experts (NF4, MXFP4) as stored, for few rows an expert;
- ``cross_entropy`` (kernel in ``cross_entropy_kernels``): the training loss fused with the output
  head, in chunks of rows wide enough that its products are not bound by reading the head;
- ``kernels``: what those nine share: Triton kernels jitted on first use and given up on, with a
  warning, once they fail;
- ``dropout``: adapter dropout whose masks are a function of (micro-batch seed, adapter, element),
  so graphs replay each step's masks and recomputed layers regenerate them (nothing saved);
- ``ops``: RMSNorm (both castings), RoPE (full and partial) and its inverse in plain torch, and
  where liger-kernel's Triton versions and the flash-attention varlen entry point come from;
- ``loss``: the cross-entropy over the vocabulary without a ``tokens x vocab`` logits tensor, for
  training (fused with the output projection: ``cross_entropy``, else liger's) and for evaluation
  (chunked, with argmax hits), with a final logit soft-cap where the model has one.

The trainable parameters are PEFT's own ``lora_A`` / ``lora_B`` weights, so the optimizer, the
checkpoints and ``save_pretrained`` are untouched; only the loss computation changes.
:func:`prepare` returns None (with a reason) for models it does not cover, and the caller keeps the
plain path. The MFU helpers live in :mod:`studio.engine.flops` and are re-exported here for the
trainer.
"""

from studio.engine.fast.build import FAST_PATH_ENV, enable, prepare
from studio.engine.fast.loss import IGNORE_INDEX
from studio.engine.fast.model import FastModel
from studio.engine.flops import matmul_tflops, model_flops_per_token

__all__ = ["FAST_PATH_ENV", "IGNORE_INDEX", "FastModel", "enable", "matmul_tflops", "model_flops_per_token",
           "prepare"]
