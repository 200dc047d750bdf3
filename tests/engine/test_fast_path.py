"""The fast training path (studio/engine/fast/) on CPU: same loss and LoRA gradients as the plain
transformers + PEFT path, and packed or padded examples that never see each other."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from studio.engine import fast
from studio.engine.batching import collate
from studio.engine.fast.layer import Segments

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(tiny_model: Path, bits: int | None, targets: list[str], seed: int = 0,
                dtype: torch.dtype = torch.float32, dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {}
    if bits == 4:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype, **kwargs)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets))
    # B starts at zero in LoRA, which would make every A gradient zero: give it values.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


def _examples(lengths: list[int], seed: int = 0) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(3, 300) for _ in range(n)]
        out.append(SimpleNamespace(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3:]))
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _save_llama(path: Path, layers: int, kv_heads: int, hidden: int = 64) -> None:
    """A small random Llama (4 heads, 300-token vocabulary) saved at ``path``, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=kv_heads, vocab_size=300, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def _input_buffers(host) -> list:
    """The host buffers of layer inputs (the others hold a layer's kept q, k or v)."""
    return [key for key in host._host if not isinstance(key, tuple)]


@pytest.mark.parametrize(("bits", "targets"), [(None, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
                                                (4, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
                                                (None, ["q_proj", "v_proj", "gate_proj"])])
def test_layer_inputs_kept_on_the_host_give_the_same_loss_and_gradients(tiny_model: Path, bits, targets,
                                                                       monkeypatch) -> None:
    """The eager steps' offloaded recomputation (engine/fast/offload.py, q, k and v kept beside each
    input) against per-layer checkpointing: the same function, so the same loss and adapter gradients
    to rounding (on the CPU the host copies are plain copies; the stream handling runs on CUDA only). With a 4-bit base
    the shared dequantization workspace is in use too; adapters on only some projections (the
    last, down, with and without one: its recomputation skips the product's value)."""
    from studio.engine.fast.offload import HostInputs

    model = _peft_model(tiny_model, bits, targets)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    assert fast_model._host is None or device.type == "cuda"  # on the CPU only when asked, as here
    # the decision the engine takes per micro-batch (core/plan.offload_for), forced on here
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    results = []
    for host in (None, HostInputs(device)):
        fast_model._host = host
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
        if host is not None:
            assert not host._stored and not host._fetched  # every input came back once
            # one input buffer per layer but the last, whose input stays on the device (its copies
            # could hide behind no compute)
            assert len(_input_buffers(host)) == len(fast_model.layers) - 1
    # A step abandoned after its forward and part of its backward's prefetches (an out-of-memory
    # error there, and the trainer retries smaller): the next step must not read its inputs.
    other = collate([[e] for e in _examples([17, 12], seed=1)], pad_id=0, packing=True).to(device)
    fast_model.loss(other.input_ids, other.labels, other.attention_mask, other.position_ids)
    for index in range(len(fast_model.layers)):
        host.prefetch(index)
    model.zero_grad(set_to_none=True)
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    results.append((loss.detach(), _grads(model)))
    assert len(_input_buffers(host)) == len(fast_model.layers) - 1  # a smaller batch reuses each layer's buffer
    (loss0, grads0), (loss1, grads1), (loss2, grads2) = results
    torch.testing.assert_close(loss2, loss0, rtol=1e-6, atol=1e-6)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys() and grads0
    for name, grad in grads0.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("bits", "targets", "kv_heads"), [
    (None, ALL, 4), (None, ALL, 2), (4, ["q_proj", "v_proj", "down_proj"], 4), (None, ["o_proj", "gate_proj"], 4)])
def test_q_k_v_kept_on_the_host_give_the_recomputation_the_same_gradients(tmp_path: Path, bits, targets,
                                                                          kv_heads, monkeypatch) -> None:
    """Each offloaded layer's rotated q, k and v wait on the host beside its input, and its
    recomputation takes them instead of running the q/k/v product and RoPE (products.KeptQKV, whose
    backward is RoPE's inverse rotation and the product's own): the loss and every adapter gradient
    equal the run that recomputes them (torch's checkpointing), with grouped-query attention, a
    4-bit base, and adapters on q/k/v or on none of them. A budget that fits one layer's kept
    tensors keeps that layer's only; the other layers recompute as before."""

    from studio.engine.fast.offload import QKV, HostInputs

    _save_llama(tmp_path, 3, kv_heads)
    model = _peft_model(tmp_path, bits, targets)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    tokens = batch.input_ids.numel()
    one_layer = tokens * (4 + 2 * kv_heads) * 16 * 4  # q, k and v of one layer, fp32
    calls = []
    real = fast_model.layers[0].qkv.from_kept.__func__

    def counting(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(fast_model.layers[0].qkv), "from_kept", counting)
    results = []
    for host in (None, HostInputs(device), HostInputs(device, keep_budget=one_layer)):
        fast_model._host = host
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
        if host is None:
            assert not calls  # torch's checkpointing recomputes q, k and v
            continue
        assert not host._stored and not host._fetched  # everything kept came back once
        kept_layers = {key[0] for key in host._host if isinstance(key, tuple)}
        # the last layer (2) keeps its q, k and v on the device, beyond the budget
        expected = [{0, 1}, {0}][len(results) - 2]
        assert kept_layers == expected
        assert all((i, name) in host._host for i in kept_layers for name in QKV)
        assert len(calls) == len(expected) + 1  # the recomputations that took them, the last layer's too
    loss0, grads0 = results[0]
    assert grads0
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
        assert grads.keys() == grads0.keys()
        for name, grad in grads0.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rotary", [8, 6])
def test_rope_unrotation_is_the_rotation_s_backward(rotary: int) -> None:
    """ops.unrotate_torch (what KeptQKV's backward applies on the CPU) equals autograd's gradient
    through rope_torch, and through rope_partial_torch where only the first values of each head
    rotate (Phi-4-mini)."""
    from studio.engine.fast.ops import rope_partial_torch, rope_torch, unrotate_torch

    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    angles = torch.randn(2, 5, rotary)
    cos, sin = angles.cos(), angles.sin()
    dq, dk = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    rq, rk = (rope_torch if rotary == 8 else rope_partial_torch)(q, k, cos, sin)
    gq, gk = torch.autograd.grad((rq, rk), (q, k), (dq, dk))
    uq, uk = unrotate_torch(dq, dk, cos, sin)
    torch.testing.assert_close(uq, gq, rtol=0, atol=1e-6)
    torch.testing.assert_close(uk, gk, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("bits", "targets"), [(None, ALL), (4, ALL), (None, ["q_proj", "v_proj", "down_proj"])])
def test_fast_path_loss_and_lora_gradients_equal_the_plain_path(tiny_model: Path, bits, targets,
                                                               monkeypatch) -> None:
    """fp32 on CPU, so both paths compute the same function to rounding: 4-bit base weights and
    adapters on only some projections included."""
    if bits == 4 and not torch.cuda.is_available():
        # With transformers 5.23 some 4-bit weights record bf16 as their dtype although the model
        # loads in fp32, and bitsandbytes' CPU product then dequantizes them to bf16 (0.6% off in
        # this model's loss and its gradients). The plain side's reference here dequantizes to the
        # input's dtype, as the fast path does, and multiplies exactly.
        import copy

        import bitsandbytes
        import bitsandbytes.functional as bnbf

        def exact(a, b, out=None, quant_state=None, bias=None):
            state = copy.copy(quant_state)
            state.dtype = a.dtype
            y = a @ bnbf.dequantize_4bit(b, state).t()
            return y if bias is None else y + bias.to(a.dtype)

        monkeypatch.setattr(bitsandbytes, "matmul_4bit", exact)
    model = _peft_model(tiny_model, bits, targets)
    # On a CUDA machine bitsandbytes puts a 4-bit model on the GPU: the batch follows the model.
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=False).to(device)
    plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, labels=batch.labels).loss
    plain.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)

    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    got = _grads(model)

    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-5)
    assert got.keys() == expected.keys() and len(got) == 2 * len(targets) * 2  # A and B, 2 layers
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        rel = (got[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize(("mode", "targets"), [("host", ALL), ("checkpoint", ALL), ("eager", ALL),
                                                ("host", ["o_proj", "gate_proj", "down_proj"])])
def test_the_first_layer_runs_no_input_gradient_product(tiny_model: Path, mode, targets, monkeypatch) -> None:
    """The first layer's input is the frozen embeddings' output: nothing wants its gradient, so its
    q/k/v products run no backward product (nor the LoRA term's), recomputed on the host's inputs,
    checkpointed by torch or not checkpointed at all. Without adapters on q/k/v, the attention's
    output wants none either, and o's backward product goes too. Every other layer's products still
    run theirs, and the adapters' gradients equal those of a run that computes every input gradient
    (the embeddings made trainable, so that the first layer's input wants one)."""
    from studio.engine.fast.frozen import FrozenWeights
    from studio.engine.fast.offload import HostInputs

    model = _peft_model(tiny_model, None, targets)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    if mode == "eager":  # every activation kept: the layers run straight through
        monkeypatch.setattr("studio.engine.fast.model.checkpoint", lambda run, *args, **kwargs: run(*args))
    host = mode == "host"
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: host)
    fast_model._host = HostInputs(device) if host else None
    ran = []

    def counting(real):
        def run(self, *args, **kwargs):
            ran.append(self)
            return real(self, *args, **kwargs)
        return run

    for name in ("backward_product", "backward_blocks"):  # a fused matrix's, each projection's
        monkeypatch.setattr(FrozenWeights, name, counting(getattr(FrozenWeights, name)))
    model.zero_grad(set_to_none=True)
    fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()
    got = _grads(model)
    first = fast_model.layers[0]
    skipped = [first.qkv] + ([] if "q_proj" in targets else [first.o])
    for index, layer in enumerate(fast_model.layers):
        for proj in layer.projections():
            assert (proj.weights in ran) is not (index == 0 and proj in skipped), (index, proj.modules[0])

    # The reference: every input gradient computed, the first layer's too.
    fast_model.backbone.embed_tokens.weight.requires_grad_(True)
    ran.clear()
    model.zero_grad(set_to_none=True)
    fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()
    assert all(layer.qkv.weights in ran for layer in fast_model.layers)
    expected = {name: grad for name, grad in _grads(model).items() if name in got}
    assert got.keys() == expected.keys() and got
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_grouped_query_attention_on_the_fast_path_equals_the_plain_path(tmp_path: Path) -> None:
    """Two key/value heads for four query heads: q, k and v of different widths, from their own
    products (products.SeparateLoraProduct), give the plain path's loss and gradients."""

    _save_llama(tmp_path, 2, 2)
    model = _peft_model(tmp_path, None, ALL)
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True)
    plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, labels=batch.labels).loss
    plain.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    got = _grads(model)
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-5)
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        rel = (got[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_packed_examples_never_see_each_other(tiny_model: Path) -> None:
    """Changing one packed example's tokens must not move the loss (or gradients) of another, and
    the packed loss equals the examples' losses computed one by one."""
    model = _peft_model(tiny_model, None, ALL)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    first, second, third = _examples([11, 17, 8], seed=1)

    def packed_loss(a, b, c) -> torch.Tensor:
        batch = collate([[a, b], [c]], pad_id=0, packing=True)
        return fast_model.loss(batch.input_ids, batch.labels, None, batch.position_ids, reduction="sum")

    def alone(example) -> torch.Tensor:
        batch = collate([[example]], pad_id=0, packing=True)
        return fast_model.loss(batch.input_ids, batch.labels, None, batch.position_ids, reduction="sum")

    with torch.no_grad():
        together = packed_loss(first, second, third)
        separately = alone(first) + alone(second) + alone(third)
    torch.testing.assert_close(together, separately, rtol=1e-5, atol=1e-5)

    # Only the second example takes loss; the first one (packed before it) is then rewritten.
    silent = SimpleNamespace(input_ids=first.input_ids, labels=[-100] * len(first.labels))
    changed = SimpleNamespace(input_ids=[t + 1 for t in first.input_ids], labels=silent.labels)
    results = []
    for neighbour in (silent, changed):
        model.zero_grad(set_to_none=True)
        loss = packed_loss(neighbour, second, SimpleNamespace(input_ids=third.input_ids,
                                                              labels=[-100] * len(third.labels)))
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a > 0
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7)


def test_packing_bucket_layout_keeps_examples_apart() -> None:
    """The CUDA-graph layout pads the flat stream to 256 tokens with padding examples no longer than
    max_len and fills the remaining slots with empty examples: boundaries are kept, the padding
    takes no loss, and the example count and longest example are powers of two."""
    model = fast.FastModel.__new__(fast.FastModel)
    model._graphs = None
    ids = torch.arange(1, 11)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    targets = torch.arange(10)[None]
    seg = Segments(cu=torch.tensor([0, 3, 5, 10], dtype=torch.int32), max_len=5)
    ids, pos, targets, seg = model._static_layout(ids, pos, targets, seg, width=10)
    assert ids.shape[1] == 256 and seg.cu.numel() == 33 and seg.max_len == 128
    assert seg.cu.dtype == torch.int32  # what the flash-attention kernel takes
    cu = seg.cu.tolist()
    assert cu[:4] == [0, 3, 5, 10] and cu == sorted(cu) and cu[-1] == 256
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    assert max(lengths) <= seg.max_len and lengths[3:5] == [128, 118] and set(lengths[5:]) == {0}
    starts = [a for a, b in zip(cu[:-1], cu[1:], strict=True) if b > a]  # the empty examples have no token
    assert torch.nonzero(pos[0] == 0).flatten().tolist() == starts
    assert (targets[0, 10:] == -100).all() and targets[0, :10].tolist() == list(range(10))


def test_a_wider_layout_replaces_the_narrower_one_of_the_same_length() -> None:
    """A stream with more examples than the captured layout of its length has slots gets a layout
    wide enough for both (its capture drops the narrower layout's graphs, DPO's reference graph with
    the policy's); a later narrower stream reuses it. A layout whose reference pass alone is captured
    yet (a DPO step's first moment) counts as captured."""
    from studio.engine.fast.graphs import Graphs

    graphs = Graphs.__new__(Graphs)
    graphs.graphed = {((1, 2048, 8), 33, 512, True): "A", ((2, 512, 8), 1, 0, True): "rows"}
    graphs.references = {((1, 2048, 8), 33, 512): "A's reference", ((1, 4096, 8), 17, 1024): "B's reference"}
    assert graphs.fit(2048, 64, 256) == (64, 512)  # wider in slots, as long in max_len
    assert graphs.fit(2048, 32, 128) == (32, 512)  # fits: A is reused
    assert graphs.fit(4096, 32, 128) == (32, 1024)  # another length: B's layout, widened in slots
    assert graphs.fit(1024, 32, 128) == (32, 128)  # another length: its own layout
    assert graphs.fit(512, 8, 128) == (8, 128)  # rows without boundaries (cu of 1) are no flat layout
    graphs._replace(((1, 2048, 8), 65, 512))
    assert list(graphs.graphed.values()) == ["rows"]  # rows without boundaries are never replaced
    assert list(graphs.references.values()) == ["B's reference"]
    graphs._replace(((1, 4096, 8), 17, 1024))  # the layout itself: its reference graph stays for its policy's
    assert list(graphs.references.values()) == ["B's reference"]


def test_unsupported_models_fall_back_with_a_reason(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    fast_model, why = fast.prepare(plain)
    assert fast_model is None and why
    on_cpu, why = fast.enable(plain, torch.device("cpu"))
    assert on_cpu is None and "CUDA" in why


def test_flops_per_token_counts_the_frozen_matrices_twice() -> None:
    """4N (forward and input-gradient backward) plus attention, for a Llama-2-7B-shaped config."""
    config = SimpleNamespace(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
    n = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 32000 * 4096
    flops = fast.model_flops_per_token(config, 512)
    assert flops == pytest.approx(4 * n + 6 * 32 * 512 * 4096)


def test_evaluation_scores_equal_the_full_logits_ones_in_chunks(tiny_model: Path, monkeypatch) -> None:
    """Evaluation on the fast path (loss sum and argmax hits) goes through the vocabulary a few rows
    at a time, and still gives the full-logits numbers."""
    from studio.engine.fast import loss as fast_loss
    from studio.engine.fast import model as fast_model_module

    model = _peft_model(tiny_model, None, ALL)
    model.eval()
    batch = collate([[e] for e in _examples([21, 14, 9], seed=3)], pad_id=0, packing=False)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, :-1].float()
    targets = batch.labels[:, 1:]
    keep = targets != -100
    expected_loss = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    expected_hits = int((logits[keep].argmax(-1) == targets[keep]).sum())

    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    chunks: list[int] = []
    real_rows = fast_loss.chunk_rows
    monkeypatch.setattr(fast_loss, "chunk_rows", lambda *a: chunks.append(real_rows(*a)) or 5)
    monkeypatch.setattr(fast_model_module, "SCORE_TOKENS", batch.input_ids.shape[1])  # one row a pass
    loss, hits = fast_model.score(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    assert len(chunks) == 3, "each of the three rows was scored on its own, in chunks"
    assert int(keep.sum()) > 5, "more target rows than one chunk holds"
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-4)
    assert int(hits) == expected_hits
    assert not loss.requires_grad


def test_trainer_evaluation_on_the_fast_path_matches_the_plain_path(tiny_config, monkeypatch) -> None:
    """The Trainer's evaluation goes through the fast path's chunked scores when that path is on,
    with the plain path's loss and token accuracy."""
    from studio.core import events as ev
    from studio.core.runs import create_run
    from studio.engine.session import Session

    calls: list[int] = []
    score = fast.FastModel.score
    monkeypatch.setattr(fast.FastModel, "score", lambda self, *a: calls.append(1) or score(self, *a))
    results = {}
    for wanted in ("0", "1"):
        monkeypatch.setenv(fast.FAST_PATH_ENV, wanted)
        events: list = []
        session = Session(tiny_config, create_run(tiny_config), events.append)
        session.load()
        assert (session.fast is not None) == (wanted == "1")
        loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))  # recorded on a CPU too
        assert (loaded.path, bool(loaded.path_reason)) == ("fast" if wanted == "1" else "plain", True)
        assert wanted == "1" or loaded.path_reason == f"{fast.FAST_PATH_ENV}=0"
        results[wanted] = session.evaluate()
        assert any(isinstance(e, ev.EvalLogged) for e in events)
    assert calls, "the fast path's chunked scores served the evaluation"
    plain, fused = results["0"], results["1"]
    assert plain.rows == fused.rows > 0
    # To rounding in the compute dtype the machine chose (fp32 on CPU, bf16 on a GPU, where a
    # near-tie in the argmax may also fall the other way)
    loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))
    half = loaded.dtype != "float32"
    assert fused.loss == pytest.approx(plain.loss, rel=2e-3 if half else 1e-5)
    assert fused.token_accuracy == pytest.approx(plain.token_accuracy, abs=0.01 if half else 1e-9)


def test_the_run_s_fast_path_settings_reach_the_engine(tiny_config, monkeypatch) -> None:
    """The session builds the fast path with the run's ``trainer.fast_path``: with ``host_offload``
    off no layer input is kept on the host, with ``cuda_graphs`` off no graph is captured (on the
    CPU neither runs anyway: the settings are what the engine was given)."""
    from studio.core.runs import create_run
    from studio.engine.session import Session

    monkeypatch.setenv(fast.FAST_PATH_ENV, "1")
    tiny_config.trainer.fast_path.cuda_graphs = False
    tiny_config.trainer.fast_path.host_offload = False
    session = Session(tiny_config, create_run(tiny_config), lambda event: None)
    session.load()
    assert session.fast is not None
    assert session.fast.options == tiny_config.trainer.fast_path
    assert session.fast._graphs is None and session.fast._host is None


@pytest.mark.parametrize(("env", "change", "fast_expected"), [
    ("1", {}, True), ("1", {"use_dora": True}, False), ("1", {"targets": ["q_proj", "lm_head"]}, False),
    ("0", {}, False)])
def test_the_loader_foresees_the_path_the_trainer_takes(tiny_config, monkeypatch, env, change,
                                                       fast_expected) -> None:
    """engine/model.fast_path_ahead decides from the config, before the adapter exists, whether the
    base keeps its compute dtype (no fp32 upcast for the fast path); it must agree with the decision
    engine/fast/build takes on the model with its adapter (STUDIO_FAST_PATH=1 stands in for CUDA)."""
    from transformers import AutoModelForCausalLM

    from studio.core.plan import choose_path
    from studio.engine.fast.build import path_facts
    from studio.engine.model import BaseModel, attach_lora, fast_path_ahead

    monkeypatch.setenv("STUDIO_FAST_PATH", env)
    tiny_config.lora.use_dora = change.get("use_dora", False)
    tiny_config.lora.target_modules = change.get("targets", "all-linear")
    model = AutoModelForCausalLM.from_pretrained(tiny_config.model.base_model, dtype=torch.float32)
    ahead = fast_path_ahead(model, tiny_config)
    base = BaseModel(model=model, tokenizer=None, device=torch.device("cpu"), compute_dtype=torch.float32,
                     quantization="fp32", path=str(tiny_config.model.base_model))
    peft_model = attach_lora(base, tiny_config)
    taken = choose_path(path_facts(peft_model, torch.device("cpu"), tiny_config.trainer.method)).path
    assert ahead == fast_expected
    assert (taken == "fast") == ahead


@pytest.mark.parametrize("bits", [None, 4])
def test_split_products_equal_the_fused_matrix(tiny_model: Path, bits) -> None:
    """gate/up multiplied one projection at a time, each into its own output columns, give the
    product of the two weights stacked into one matrix, forward and backward; the shared
    dequantization buffer holds one projection, not the pair."""
    from studio.engine.fast.frozen import FrozenWeights, Workspace

    model = _peft_model(tiny_model, bits, ALL)
    mlp = model.base_model.model.model.layers[0].mlp
    bases = [mlp.gate_proj.get_base_layer(), mlp.up_proj.get_base_layer()]
    device = bases[0].weight.device
    workspace = Workspace()
    split = FrozenWeights(bases, torch.float32, workspace)
    if bits == 4:
        assert workspace.numel == max(split.out_features) * split.in_features
        assert workspace.numel < sum(split.out_features) * split.in_features
    workspace.allocate(torch.float32, device)
    x = torch.randn(7, split.in_features, device=device)
    dy = torch.randn(7, sum(split.out_features), device=device)
    w = torch.cat([split.piece(index).clone() for index in range(len(bases))])
    torch.testing.assert_close(split.forward_product(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.backward_product(dy), dy @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapted", [True, False])
def test_a_product_without_its_value_still_gives_its_backward(tiny_model: Path, adapted) -> None:
    """A recomputed layer's last product (layer.py's ``recompute``): its value is never read, so
    it is not computed (the output is a zero that owns one element), yet the gradients of its
    input and adapters are those of the full product."""
    from studio.engine.fast.frozen import Workspace
    from studio.engine.fast.projection import Projection

    model = _peft_model(tiny_model, None, ALL if adapted else ["q_proj"])
    proj = Projection([model.base_model.model.model.layers[0].mlp.down_proj], "default", torch.float32,
                      Workspace())
    assert bool(proj.a) == adapted
    x = torch.randn(2, 5, proj.weights.in_features, requires_grad=True)
    dy = torch.randn(2, 5, proj.weights.out_features[0])
    results = []
    for value in (True, False):
        x.grad = None
        for p in proj.a + proj.b:
            p.grad = None
        y = proj(x, value=value)
        assert y.shape == dy.shape
        if not value:
            assert y.untyped_storage().nbytes() == y.element_size() and not y.any()
        y.backward(dy)
        results.append([x.grad.clone(), *[p.grad.clone() for p in proj.a + proj.b]])
    for full, skipped in zip(*results, strict=True):
        assert full.abs().sum() > 0
        torch.testing.assert_close(skipped, full)


@pytest.mark.parametrize(("bits", "targets"), [(None, ALL), (4, ALL), (None, ["q_proj"])])
def test_the_base_product_adds_itself_to_the_update_and_the_residual(tiny_model: Path, bits, targets) -> None:
    """products.LoraProduct's order (the LoRA update's product writes the output, the base product
    adds itself in its epilogue, the residual comes last; the LoRA term writes the input gradient
    and the base products add themselves) gives the value and gradients of the plain formula
    ``r + x W^T + s (x A^T) B^T`` through autograd, on split products (gate/up) and single ones
    (down), with and without an adapter and a residual."""
    from studio.engine.fast.frozen import Workspace
    from studio.engine.fast.projection import Projection

    if bits == 4 and not torch.cuda.is_available():
        pytest.skip("4-bit products on the CPU dequantize in bf16 (see the plain-path test)")
    model = _peft_model(tiny_model, bits, targets)
    mlp = model.base_model.model.model.layers[0].mlp
    device = next(model.parameters()).device
    for modules in ([mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
        workspace = Workspace()
        proj = Projection(modules, "default", torch.float32, workspace)
        workspace.allocate(torch.float32, device)
        w = torch.cat([proj.weights.piece(index).clone() for index in range(len(modules))])
        width = sum(proj.weights.out_features)
        x = torch.randn(2, 5, proj.weights.in_features, device=device, requires_grad=True)
        r = torch.randn(2, 5, width, device=device, requires_grad=True)
        dy = torch.randn(2, 5, width, device=device)
        for residual in (True, False):
            results = []
            for fused in (True, False):
                for t in (x, r, *proj.a, *proj.b):
                    t.grad = None
                if fused:
                    y = proj(x, residual=r if residual else None)
                else:
                    a, bt, scale = proj.adapters()
                    y = x @ w.t() if a is None else x @ w.t() + scale * (x @ a.t()) @ bt
                    y = y + r if residual else y
                y.backward(dy)
                results.append((y.detach(), [x.grad.clone(), *[p.grad.clone() for p in proj.a + proj.b]], r.grad))
            (y0, g0, r0), (y1, g1, r1) = results
            torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-5)
            for got, want in zip(g0, g1, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if residual:
                torch.testing.assert_close(r0, dy)
                torch.testing.assert_close(r1, dy)
            else:
                assert r0 is None and r1 is None


def test_a_small_update_survives_meeting_the_residual_stream_in_bf16(tiny_model: Path) -> None:
    """In bf16, an update under half the stream's last digit rounds away if it meets the residual
    stream first (the eighth session's order: the losses lagged the HF loop's by 3.3%). It has to
    meet the base product first, as in the plain order: the base product's varied values then
    carry it through the stream's rounding, so the output moves by the update on average."""
    from studio.engine.fast.frozen import Workspace
    from studio.engine.fast.projection import Projection

    model = _peft_model(tiny_model, None, ["down_proj"], dtype=torch.bfloat16)
    module = model.base_model.model.model.layers[0].mlp.down_proj
    workspace = Workspace()
    proj = Projection([module], "default", torch.bfloat16, workspace)
    workspace.allocate(torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, proj.weights.in_features, generator=gen).bfloat16()
    stream = (8 + 8 * torch.rand(1, 512, sum(proj.weights.out_features), generator=gen)).bfloat16()
    with torch.no_grad():
        a, bt, scale = proj.adapters()
        update = scale * (x.float() @ a.float().t()) @ bt.float()
        # The update's spread: a sixteenth of the stream's last digit (1/16 in [8, 16)).
        proj.b[0].mul_(1 / 256 / update.std().item())
        update = scale * (x.float() @ a.float().t()) @ proj.adapters()[1].float()
    # Under half a digit: added to the stream alone, (almost) all of it would vanish.
    assert (update.abs() < 1 / 32).float().mean() > 0.999
    with torch.no_grad():
        moved = {"product": proj(x, residual=stream).float() - proj(x, residual=stream, adapters=(None, None, 1.0))
                 .float()}
        # The plain order, in bf16: the base product, the update added to it, then the stream.
        a, bt, scale = proj.adapters()
        x2, stream2 = x.reshape(-1, x.shape[-1]), stream.reshape(-1, stream.shape[-1])
        w = proj.weights.piece(0).t()
        plain = (x2 @ w).addmm_(x2 @ a.t(), bt, alpha=scale).add_(stream2)
        moved["plain"] = (plain.float() - torch.addmm(stream2, x2, w).float()).view(update.shape)
    # How much of the update reaches the output (1: all of it, on average over the elements).
    slopes = {order: float((m * update).sum() / (update * update).sum()) for order, m in moved.items()}
    assert slopes["plain"] > 0.8
    assert abs(slopes["product"] - slopes["plain"]) < 0.2, slopes


def test_the_gradient_sink_gives_the_gradients_autograd_would(tiny_model: Path) -> None:
    """graphs.GradSink, run eagerly (on CUDA only the captured pass goes through it): the adapters'
    gradients land in the sink's tensors, once, over micro-batches that accumulate; a new step
    (``.grad`` set to None) starts them from zero, and a gradient an eager step made is kept."""
    import functools

    from studio.engine.fast.graphs import GradSink

    model = _peft_model(tiny_model, None, ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"])
    device = next(model.parameters()).device
    batches = [collate([[e] for e in _examples(lengths, seed=s)], pad_id=0, packing=True).to(device)
               for s, lengths in enumerate(([21, 14, 9], [30, 6, 8]))]
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why

    def step(micro_batches) -> None:
        for batch in micro_batches:
            fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()

    model.zero_grad(set_to_none=True)
    step(batches)
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    step(batches[:1])
    first_only = _grads(model)

    sink = GradSink(fast_model.trainable())
    plain_stack = fast_model.stack
    fast_model.stack = functools.partial(plain_stack, sink=sink)
    for _ in range(2):  # the second step must not carry the first one's sums
        model.zero_grad(set_to_none=True)
        sink.bind()
        step(batches)
        got = _grads(model)
        assert all(p.grad is g for p, g in zip(sink.params, sink.grads, strict=True))
        for name, grad in reference.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)

    # The first micro-batch eager (no sink), the second through it: the eager one's sum is kept.
    model.zero_grad(set_to_none=True)
    fast_model.stack = plain_stack
    step(batches[:1])
    torch.testing.assert_close(_grads(model), first_only)
    fast_model.stack = functools.partial(plain_stack, sink=sink)
    sink.bind()
    step(batches[1:])
    got = _grads(model)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


def test_the_last_layer_s_tensors_stay_on_the_device(tmp_path: Path, monkeypatch) -> None:
    """The last layer's input and kept q, k and v are never copied to the host and back (its
    backward comes right after the loss): no host buffer for that layer, and the same loss and
    gradients as torch's checkpointing."""

    from studio.engine.fast.offload import HostInputs

    _save_llama(tmp_path, 3, 2)
    model = _peft_model(tmp_path, None, ALL)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    results = []
    for host in (None, HostInputs(device)):
        fast_model._host = host
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    layers = {key[0] if isinstance(key, tuple) else key for key in host._host}
    assert layers == {0, 1}
    assert not host._stored and not host._fetched
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys() and grads0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)


def test_the_fused_loss_compiles_both_of_its_integer_cases_at_the_first_step(monkeypatch) -> None:
    """loss.warm_cases: before the first fused loss of a shape, two small losses whose target-row
    counts fall on both sides of Triton's multiple-of-16 specialization (16 and 17 rows), once a
    process; the real loss then runs as before."""
    from studio.engine.fast import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_WARM", set())
    calls = []

    class FakeFused:
        @staticmethod
        def apply(h, weight, targets, *rest):
            calls.append((h.shape[0], int((targets != loss_mod.IGNORE_INDEX).sum()), h.requires_grad, rest[-1]))
            return ((h @ weight.t()).float().logsumexp(-1).mean(),)

    kernels = {"flce": FakeFused}
    weight = torch.randn(11, 8)
    h = torch.randn(40, 8, requires_grad=True)
    targets = torch.randint(0, 11, (40,))
    targets[:5] = loss_mod.IGNORE_INDEX
    first = loss_mod.cross_entropy(h, weight, targets, "mean", kernels)
    again = loss_mod.cross_entropy(h, weight, targets, "mean", kernels)
    assert calls == [(16, 16, True, "mean"), (17, 17, True, "mean"), (40, 35, True, "mean"), (40, 35, True, "mean")]
    assert torch.equal(first, again)
    loss_mod.cross_entropy(h, weight, targets, "sum", kernels)  # another reduction: warmed apart
    assert [c[:2] for c in calls[4:]] == [(16, 16), (17, 17), (40, 35)]
