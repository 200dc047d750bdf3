"""Batched sampling for GRPO: many completions at once from the worker's own model, with a KV cache.

Every row of a batch (a prompt repeated once per completion of its group) is left-padded to the
longest prompt, the prompts go through the model once (the prefill), and then one token a step for
every row together, each step attending to a KV cache that holds ``prompt + max_new`` slots a row.
The cache is Studio's own (:class:`SlotCache`): the model's attention layers write each step's keys
and values into fixed slots, and a 4D attention mask says which slots each row sees, so a decode
step has the same shapes every time. On a CUDA GPU that step (the model's forward, the choice of
the next token and the bookkeeping) is captured once as a CUDA graph and replayed for every token;
elsewhere, or where the capture fails, the same step runs eagerly.

Sampling is counter-based: the noise that picks a row's token at position ``t`` is a hash of
(seed, the row's key, ``t``, the token id), turned into Gumbel noise (``argmax(logits / T + g)`` is a
sample at temperature T). A completion therefore depends only on the seed, its key and the model,
not on which other rows share its batch: a step redone after an out-of-memory halving, a step split
over several GPUs and a resumed run sample the same completions. The hash runs on the device, inside
the graph.

A sampling whose decode step ran as a graph gives its memory back before it returns (the graph's
private pool, the KV cache's pages, the cuBLAS workspaces of the capture's streams): the scored pass
that comes next needs it, and no allocation outside a graph can use a graph's pool.

The adapters are on unless the caller switches them off (peft's ``disable_adapter()``); the model is
put in eval mode for the sampling and handed back as it came.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from studio.engine.fast.graphs import clear_cublas_workspaces, without_collection

_M32 = 0xFFFFFFFF
_NOISE_BITS = 24
"""Bits of the hash a uniform draw keeps: exact in fp32, so no draw rounds to 0 or 1."""


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``(x * constant) mod 2**32`` for ``x`` in [0, 2**32) held in int64, without overflowing int64:
    the product is taken in two 16-bit halves."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, keys: torch.Tensor, position: torch.Tensor,
                  vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniform draws in (0, 1), one per (row, token id), for the token at ``position``: a function
    of (``seed``, the row's key, ``position``, the token id) only. ``vocab_hash`` is
    :func:`vocab_hashes` of the vocabulary."""
    row = _mix((_mul32(keys & _M32, 0x9E3779B1) ^ _mul32(position & _M32, 0x632BE5AB) ^ seed) & _M32)
    bits = _mix(row[:, None] ^ vocab_hash[None, :]) >> (32 - _NOISE_BITS)
    return (bits.float() + 0.5) / float(1 << _NOISE_BITS)


def vocab_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """Each token id scrambled once (a bijection of 32-bit values), for :func:`uniform_noise`."""
    return _mix(_mul32(torch.arange(vocab, device=device, dtype=torch.int64), 0x27D4EB2F) ^ 0x165667B1)


def step_seed(seed: int, step: int) -> int:
    """The 32-bit sampling seed of optimizer step ``step`` of a run seeded ``seed``."""
    value = torch.tensor([(seed * 0x9E3779B1 + step * 0x7FEB352D + 0x3C6EF372) & _M32], dtype=torch.int64)
    return int(_mix(value)[0])


def choose(logits: torch.Tensor, temperature: float, seed: torch.Tensor, keys: torch.Tensor,
           position: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """The next token of each row: a sample at ``temperature`` (Gumbel-max with the counter-based
    noise), or the argmax when ``temperature`` is 0."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = uniform_noise(seed, keys, position, vocab_hash[: logits.shape[-1]])
    return (logits.float() / temperature - torch.log(-torch.log(u))).argmax(-1)


class SlotCache:
    """The KV cache of a batch: per layer, keys and values of ``rows x slots`` (allocated on the
    first write). The prefill writes slots ``[0, prompt)``; each decode step writes the one slot in
    :attr:`slot` (a device tensor the step advances) and attends to all slots, the 4D mask hiding
    those not yet written. Duck-typed to what transformers' attention layers call."""

    def __init__(self, slots: int):
        self.slots = slots
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slot: torch.Tensor | None = None
        """The slot a decode step writes (shape [1]); None during the prefill."""
        self.filled = 0
        """Slots the prefill wrote."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys and values; return the keys and values it attends to."""
        if layer_idx not in self.keys:
            rows, heads, _, width = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(rows, heads, self.slots, width)
            self.values[layer_idx] = value_states.new_zeros(rows, heads, self.slots, value_states.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.slot is None:
            n = key_states.shape[2]
            keys[:, :, :n] = key_states
            values[:, :, :n] = value_states
            self.filled = n
            return keys[:, :, :n], values[:, :, :n]
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots written by the prefill (what a model asks when it is not given positions)."""
        return self.filled


@dataclass
class Sampled:
    """A batch's completions: token ids (``rows x width``, the stop token included where one came,
    padding after) with each row's length and whether it stopped by itself."""

    tokens: torch.Tensor
    lengths: list[int]
    stopped: list[bool]

    def row(self, index: int) -> list[int]:
        """Row ``index``'s completion token ids (its stop token included)."""
        return self.tokens[index, : self.lengths[index]].tolist()


def _forward_arguments(model: Any) -> tuple[str, bool]:
    """How this transformers version's causal LM takes a cache (``cache`` or ``past_key_values``),
    and whether it takes ``logits_to_keep``. No ``cache_position`` is passed: the positions and the
    4D mask say everything, and the cache writes where the sampler points it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(base.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values", "logits_to_keep" in parameters


class GroupSampler:
    """Samples completions of many prompts at once with ``model`` (the session's PEFT model).

    ``graphs``: capture the decode step as a CUDA graph (CUDA only; the model samples in eval
    mode, so adapter dropout draws no masks there)."""

    def __init__(self, model: Any, device: torch.device, pad_id: int, stops: Sequence[int],
                 compute_dtype: torch.dtype, graphs: bool = True):
        self.model = model
        self.device = device
        self.pad_id = int(pad_id)
        self.stops = torch.tensor(sorted(set(stops)) or [-1], device=device, dtype=torch.long)
        self.compute_dtype = compute_dtype
        self.graphs = graphs and device.type == "cuda"
        self.graphs_failed = ""
        """Why a CUDA graph capture failed (sampling then runs eagerly from there on); '' if none did."""
        self._cache_name, self._logits_to_keep = _forward_arguments(model)
        self._vocab_hash: torch.Tensor | None = None
        self._side: Any = None
        """The stream every capture's warm-up runs on (a torch.cuda.Stream, made at the first)."""
        self._captured_pool = False
        """A decode step was captured since the last :meth:`_release`."""
        impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
        self._additive_mask = impl == "eager"  # eager attention adds its mask; SDPA takes booleans

    def _mask(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The 4D mask as the attention takes it: booleans (SDPA), or 0 / the dtype's minimum added
        to the scores (eager attention)."""
        if not self._additive_mask:
            return allowed
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, zero.new_full((), torch.finfo(dtype).min))

    def _autocast(self) -> Any:
        enabled = self.device.type == "cuda" and self.compute_dtype != torch.float32
        # No weight cache under a graph capture: a cached cast would be baked into the graph.
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled, cache_enabled=False)

    def _call(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: SlotCache,
              last_only: bool) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_name: cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits
        return logits[:, -1]

    @torch.no_grad()
    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], seed: int, max_new: int,
               temperature: float, adapter: bool = True) -> Sampled:
        """One completion per prompt (repeat a prompt for several), each of at most ``max_new``
        tokens, ending at a stop token. ``keys`` name the rows for the noise (unique within the
        seed); ``temperature`` 0 is greedy."""
        model = self.model
        off = model.disable_adapter() if not adapter and hasattr(model, "disable_adapter") else nullcontext()
        was_training = model.training
        model.eval()
        try:
            with off, self._autocast():
                sampled = self._sample(prompts, keys, seed, max_new, temperature)
        finally:
            if was_training:
                model.train()
        self._release()
        return sampled

    def _sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], seed: int, max_new: int,
                temperature: float) -> Sampled:
        device = self.device
        rows, width = len(prompts), max(len(p) for p in prompts)
        slots = width + max_new
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.bool)
        for r, prompt in enumerate(prompts):
            if prompt:
                ids[r, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
                valid[r, width - len(prompt):] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        # A padding query sees itself: a row that attends to nothing gives NaN, which its keys and
        # values would carry into every real row's attention (as 0 x NaN).
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        cache = SlotCache(slots)
        dtype = self.compute_dtype if device.type == "cuda" else torch.float32
        logits = self._call(ids, self._mask(allowed[:, None], dtype), positions, cache, True)
        if self._vocab_hash is None or self._vocab_hash.shape[0] < logits.shape[-1]:
            self._vocab_hash = vocab_hashes(logits.shape[-1], device)
        state = _DecodeState(
            seed=torch.tensor(seed & _M32, dtype=torch.int64, device=device),
            keys=torch.tensor(list(keys), dtype=torch.int64, device=device),
            position=torch.zeros(1, dtype=torch.long, device=device),
            slot=torch.full((1,), width, dtype=torch.long, device=device),
            token_positions=valid.long().sum(-1, keepdim=True),
            seen=torch.cat([valid, torch.zeros((rows, max_new), dtype=torch.bool, device=device)], 1),
            out=torch.full((rows, max_new), self.pad_id, dtype=torch.long, device=device),
            done=torch.zeros(rows, dtype=torch.bool, device=device))
        first = choose(logits, temperature, state.seed, state.keys, state.position, self._vocab_hash)
        state.out[:, 0] = first
        state.done |= torch.isin(first, self.stops)
        state.token = first[:, None].clone()
        state.position += 1
        cache.slot = state.slot

        def step() -> None:
            state.seen.index_fill_(1, state.slot, True)
            logits = self._call(state.token, self._mask(state.seen[:, None, None, :], dtype), state.token_positions,
                                cache, False)
            chosen = choose(logits, temperature, state.seed, state.keys, state.position, self._vocab_hash)
            chosen = torch.where(state.done, torch.full_like(chosen, self.pad_id), chosen)
            state.out.index_copy_(1, state.position, chosen[:, None])
            state.done |= torch.isin(chosen, self.stops)
            state.token.copy_(chosen[:, None])
            state.position += 1
            state.slot += 1
            state.token_positions += 1

        self._decode(step, state, max_new)
        return self._finish(state.out)

    def _decode(self, step: Any, state: _DecodeState, max_new: int) -> None:
        """Run ``step`` for tokens 1 .. max_new - 1, replayed as a CUDA graph where possible; every
        few tokens the host checks whether every row has stopped."""
        remaining = max_new - 1
        replay = step
        if self.graphs and remaining > 1 and not self.graphs_failed:
            replay = self._captured(step)
            remaining -= 1  # _captured ran the first step eagerly (the warm-up)
        check_every = 8 if self.device.type == "cuda" else 1
        for index in range(remaining):
            if index % check_every == 0 and bool(state.done.all()):
                break
            replay()

    def _captured(self, step: Any) -> Any:
        """``step`` run once eagerly on a side stream (the warm-up a capture needs), then captured;
        the graph's replay, or ``step`` itself when the capture fails (said in :attr:`graphs_failed`)."""
        if self._side is None:
            # One side stream for every warm-up: cuBLAS keeps a workspace per stream it ran on (32
            # MiB on a Hopper card) until it is told to let go, and a new stream each call would
            # be a new one each step (torch hands out up to 32 different streams).
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        clear_cublas_workspaces(self.device)  # no workspace of an earlier, dead graph baked in
        try:
            with without_collection(), torch.cuda.graph(graph):
                step()
        except Exception as exc:  # any capture failure: the eager step is still correct
            self.graphs_failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            return step
        self._captured_pool = True
        return graph.replay

    def _release(self) -> None:
        """After a sampling that captured its decode step: give back what it leaves behind, before
        the scored pass asks for its own memory. The graph is gone by now (nothing keeps it past
        :meth:`_decode`), but its private pool stays reserved, usable by no other allocation, until
        the caching allocator is emptied; so do the KV cache's freed pages and the cuBLAS workspaces
        of the warm-up's side stream and of the capture's stream (the latter inside the dead
        graph's pool, which it would keep mapped)."""
        if not self._captured_pool:
            return
        self._captured_pool = False
        clear_cublas_workspaces(self.device)  # the default stream's comes back at its next product
        torch.cuda.empty_cache()

    def _finish(self, out: torch.Tensor) -> Sampled:
        stop_at = torch.isin(out, self.stops)
        stopped = stop_at.any(-1)
        first = torch.where(stopped, stop_at.float().argmax(-1) + 1, torch.full_like(stopped, out.shape[1],
                                                                                     dtype=torch.long))
        lengths = first.tolist()
        width = max(1, max(lengths))
        return Sampled(out[:, :width].clone(), lengths, stopped.tolist())


@dataclass
class _DecodeState:
    """The decode step's tensors: fixed addresses, changed in place (what a graph replays against)."""

    seed: torch.Tensor
    keys: torch.Tensor
    position: torch.Tensor
    """Index of the completion token the next step produces (shape [1])."""
    slot: torch.Tensor
    """The cache slot the next step writes (shape [1])."""
    token_positions: torch.Tensor
    """Each row's position id for the token fed next (rows x 1)."""
    seen: torch.Tensor
    """Which cache slots each row attends to (rows x slots)."""
    out: torch.Tensor
    done: torch.Tensor
    token: torch.Tensor | None = None
