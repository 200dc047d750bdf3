"""Streaming generation with a KV cache: greedy or temperature / top-p sampling, stop at EOS.

One copy of the weights answers both ways: with the adapter, or as the base model inside peft's
``disable_adapter()``. The model is put in eval mode for the answer (no dropout) and handed back in
the mode it came in, so this can run between two training steps.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from studio.core.memory.phases import PREFILL_TOKENS


@dataclass(frozen=True)
class GenerationResult:
    """A finished answer."""

    text: str
    new_tokens: int
    tokens_per_s: float
    token_ids: tuple[int, ...] = ()
    adapter: bool = True
    kv_on_host: bool = False
    """Whether the KV cache lived on the host (a few layers on the card at a time)."""


def bos_to_add(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one in front of every text (Llama-2 style), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a rendered prompt, exactly as training encodes a prompt (BOS when the model
    uses one, no other special tokens)."""
    bos = bos_to_add(tokenizer)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ([bos] if bos is not None else []) + ids


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the model's generation config EOS ids."""
    found: set[int] = set()
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", None)
    value = getattr(config, "eos_token_id", None) if config is not None else None
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, int):
            found.add(item)
    return found


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token: argmax when temperature is 0, else a sample from the top-p nucleus."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        sorted_probs[outside] = 0
        choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator)
        return int(order[choice.to(order.device)])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _last_logits_only(model: Any) -> dict:
    """``logits_to_keep=1`` where the model takes it: the prompt's pass then computes the last
    position's logits only, not ``prompt x vocab`` of them (1 GB in bf16 for 4096 tokens of a 128k
    vocabulary, more than a fast-path training step holds: docs/memory.md)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


def _cache(kv_on_host: bool) -> dict:
    """The KV cache argument of the prompt's pass: transformers' own (None) on the card, or one that
    keeps every layer on the host and brings it back a layer ahead on a side stream (CUDA only)."""
    if not kv_on_host:
        return {}
    from transformers import DynamicCache

    return {"past_key_values": DynamicCache(offloading=True)}


def generate(model: Any, tokenizer: Any, input_ids: list[int], *, adapter: bool = True,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             on_text: Callable[[str], None] | None = None, generator: torch.Generator | None = None,
             device: torch.device | str | None = None,
             autocast_dtype: torch.dtype | None = None, kv_on_host: bool = False) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``input_ids``, calling ``on_text`` with each new piece.

    Sampling draws from ``generator`` (not the global RNG), so answering during training leaves the
    training run's random stream, and with it exact resume, untouched. ``kv_on_host`` (CUDA only,
    ignored elsewhere): keep the KV cache in host memory, a few layers on the card at a time; slower
    per token, for a prompt whose cache would need more memory than the training step
    (core/memory/phases.py decides).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    kv_on_host = kv_on_host and device.type == "cuda"
    stops = stop_ids(model, tokenizer)
    use_autocast = device.type == "cuda" and autocast_dtype not in (None, torch.float32)
    adapter_off = model.disable_adapter() if not adapter and hasattr(model, "disable_adapter") else nullcontext()
    was_training = model.training
    model.eval()
    generated: list[int] = []
    shown = ""
    began = time.perf_counter()
    try:
        with torch.no_grad(), adapter_off, torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                                          enabled=use_autocast):
            # The prompt in pieces of PREFILL_TOKENS, each attending to the cache of those before: a
            # long prompt's pass then holds one piece's working set, not the whole prompt's.
            cache = _cache(kv_on_host)
            for offset in range(0, len(input_ids), PREFILL_TOKENS):
                ids = torch.tensor([input_ids[offset:offset + PREFILL_TOKENS]], device=device)
                out = model(input_ids=ids, use_cache=True, **_last_logits_only(model), **cache)
                cache = {"past_key_values": out.past_key_values}
            for _ in range(max_new_tokens):
                token = _pick(out.logits[0, -1], temperature, top_p, generator)
                if token in stops:
                    break
                generated.append(token)
                text = tokenizer.decode(generated, skip_special_tokens=True)
                # A multi-byte character split across tokens decodes as U+FFFD until it completes.
                if not text.endswith("\ufffd") and len(text) > len(shown):
                    if on_text is not None:
                        on_text(text[len(shown):])
                    shown = text
                out = model(input_ids=torch.tensor([[token]], device=device),
                            past_key_values=out.past_key_values, use_cache=True)
    finally:
        if was_training:
            model.train()
    text = tokenizer.decode(generated, skip_special_tokens=True)
    if on_text is not None and len(text) > len(shown):
        on_text(text[len(shown):])
    seconds = max(time.perf_counter() - began, 1e-9)
    return GenerationResult(text=text, new_tokens=len(generated), tokens_per_s=len(generated) / seconds,
                            token_ids=tuple(generated), adapter=adapter, kv_on_host=kv_on_host)
