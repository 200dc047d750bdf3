"""Log-probs of chosen tokens from a causal LM's last hidden states, the output head applied a chunk of
tokens at a time: no ``tokens x vocabulary`` logits tensor, and no gradient of one, is ever alive.

GRPO's scored pass (engine/grpo.py) needs every completion token's log-prob. Through the model's own
forward that means the completion positions' logits, kept for backward, and their gradient as large
again in it: 8 completions of 256 tokens with Llama 3's 128k vocabulary are 0.53 GB each in bf16.
Here the model's decoder (its backbone) runs alone, and the head's product goes through
engine/fast/loss.py's ``TokenLogps``: the vocabulary in chunks of rows whose fp32 logits are no
larger than those rows' hidden states in fp32, each row's gradient to its hidden state computed in
the same pass (what backward keeps is one hidden-width row per token).

What a model does to its logits after the product comes from its description (core/decoder): a
divisor (Granite's logits_scaling), a final soft-cap (Gemma 2). :func:`find_head` returns None, with
the reason, for what this does not cover (a model the description refuses, an output head that
trains, carries an adapter or a bias); the caller then takes the logits from the model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from studio.core.decoder import Refusal, describe_decoder
from studio.engine.fast.loss import token_logps


@dataclass(frozen=True)
class ChunkedHead:
    """A (PEFT-wrapped) causal LM split into its decoder and its output head: ``logits =
    softcap((h @ head.weight.T) / divisor)``."""

    backbone: nn.Module
    """The decoder: input ids to the final normed hidden states (LoRA layers inside it run as usual)."""
    head: nn.Linear
    """The output head (frozen, no bias)."""
    divisor: float = 1.0
    """The logits are divided by this (Granite's logits_scaling): folded into the hidden states."""
    softcap: float | None = None
    """Logits become ``tanh(z / cap) * cap`` (Gemma 2); None: not capped."""

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
               ) -> torch.Tensor:
        """The final normed hidden states ``[rows, width, hidden]`` of a batch."""
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state

    def logps(self, h: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``log softmax(logits)[target]`` of each row of ``h`` (``[N, hidden]``; ``targets`` ``[N]``),
        fp32, differentiable in ``h``. The head's product runs in ``dtype`` (what autocast would cast
        the model's own head product to), the softmax in fp32."""
        h = h.to(dtype)
        if self.divisor != 1.0:
            h = h / self.divisor
        return token_logps(h, self.head.weight, targets, None, self.softcap)


def find_head(model: Any) -> tuple[ChunkedHead | None, str]:
    """``model`` split into decoder and output head, or (None, why not)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    spec = describe_decoder(config.to_dict() if hasattr(config, "to_dict") else {})
    if isinstance(spec, Refusal):
        return None, str(spec)
    if not spec.model_type:  # transformers picked the class by a model_type the description lacks
        return None, "config.json names no model_type"
    backbone = inner
    for name in spec.decoder_path:
        backbone = getattr(backbone, name, None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if backbone is None:
        return None, f"no decoder at {'.'.join(spec.decoder_path)}"
    if type(head) is not nn.Linear:  # PEFT's wrappers (an adapter, modules_to_save) are not plain Linears
        return None, f"the output head is a {type(head).__name__}"
    if head.bias is not None:
        return None, "the output head has a bias"
    if head.weight.requires_grad:  # TokenLogps gives no gradient to the head's weight
        return None, "the output head trains"
    return ChunkedHead(backbone, head, spec.logits_divisor, spec.final_softcap), ""
