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


@pytest.mark.parametrize(("bits", "targets"), [(None, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
                                                (4, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
                                                (None, ["q_proj", "v_proj", "gate_proj"])])
def test_layer_inputs_kept_on_the_host_give_the_same_loss_and_gradients(tiny_model: Path, bits, targets,
                                                                       monkeypatch) -> None:
    """The eager steps' offloaded recomputation (engine/fast/offload.py) against per-layer
    checkpointing: the same function, so the same loss and adapter gradients to rounding (on the
    CPU the host copies are plain copies; the stream handling runs on CUDA only). With a 4-bit base
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
            # one host buffer per layer but the last, whose input stays on the device (its copies
            # could hide behind no compute: HostInputs.last_on_device)
            assert len(host._host) == len(fast_model.layers) - 1
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
    assert len(host._host) == len(fast_model.layers) - 1  # a smaller batch reuses each layer's buffer
    (loss0, grads0), (loss1, grads1), (loss2, grads2) = results
    torch.testing.assert_close(loss2, loss0, rtol=1e-6, atol=1e-6)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads2[name], grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys() and grads0
    for name, grad in grads0.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("bits", "targets", "kv_heads", "separate"), [
    (None, ALL, 4, True), (None, ALL, 2, True), (None, ALL, 2, False),
    (4, ["q_proj", "v_proj", "down_proj"], 4, True), (None, ["o_proj", "gate_proj"], 4, False)])
def test_q_k_v_kept_on_the_host_give_the_recomputation_the_same_gradients(tmp_path: Path, bits, targets,
                                                                          kv_heads, separate, monkeypatch) -> None:
    """With ``keep_qkv`` each offloaded layer's rotated q, k and v wait on the host beside its input
    and its recomputation takes them instead of running the q/k/v product and RoPE
    (weights.KeptQKV, whose backward is RoPE's inverse rotation and the product's own): the loss and
    every adapter gradient equal the recomputing run's, with grouped-query attention, q/k/v as
    three products or one, a 4-bit base, and adapters on q/k/v or on none of them. A budget that
    fits one layer's kept tensors keeps that layer's only; the other layers recompute as before."""

    from studio.engine.fast.offload import QKV, HostInputs

    _save_llama(tmp_path, 3, kv_heads)
    model = _peft_model(tmp_path, bits, targets)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model, fast.FastOptions(separate_qkv=separate))
    assert fast_model is not None, why
    assert fast_model.layers[0].qkv.separated is separate
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
    for host in (HostInputs(device), HostInputs(device, keep_qkv=True),
                 HostInputs(device, keep_qkv=True, keep_budget=one_layer)):
        fast_model._host = host
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
        assert not host._stored and not host._fetched  # everything kept came back once
        kept_layers = {key[0] for key in host._host if isinstance(key, tuple)}
        # the last layer (2) keeps its q, k and v on the device, beyond the budget
        expected = {0: set(), 1: {0, 1}, 2: {0}}[len(results) - 1]
        assert kept_layers == expected
        assert all((i, name) in host._host for i in kept_layers for name in QKV)
        assert len(calls) == len(expected) + (len(results) > 1)  # the recomputations that took them
    loss0, grads0 = results[0]
    assert grads0
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
        assert grads.keys() == grads0.keys()
        for name, grad in grads0.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)


def test_rope_unrotation_is_the_rotation_s_backward() -> None:
    """ops.unrotate_torch (what KeptQKV's backward applies on the CPU) equals autograd's gradient
    through rope_torch."""
    from studio.engine.fast.ops import rope_torch, unrotate_torch

    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k = torch.randn(2, 5, 2, 8, requires_grad=True)
    angles = torch.randn(2, 5, 8)
    cos, sin = angles.cos(), angles.sin()
    dq, dk = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    rq, rk = rope_torch(q, k, cos, sin)
    gq, gk = torch.autograd.grad((rq, rk), (q, k), (dq, dk))
    uq, uk = unrotate_torch(dq, dk, cos, sin)
    torch.testing.assert_close(uq, gq, rtol=0, atol=1e-6)
    torch.testing.assert_close(uk, gk, rtol=0, atol=1e-6)


def test_layers_on_the_host_train_their_adapters_even_when_not_hoisting(tiny_model: Path, monkeypatch) -> None:
    """FastOptions(hoist_adapters=False) with the layer inputs on the host: the adapters still get
    their gradients (OffloadedLayer takes them as inputs; bench/speed.py's no_hoist lever used to
    end in "element 0 of tensors does not require grad")."""
    from studio.engine.fast.model import FastOptions
    from studio.engine.fast.offload import HostInputs

    model = _peft_model(tiny_model, None, ALL)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    results = []
    for hoist, host in ((True, False), (False, True)):
        fast_model, why = fast.prepare(model, FastOptions(hoist_adapters=hoist))
        assert fast_model is not None, why
        fast_model._host = HostInputs(device) if host else None
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for name, grad in grads0.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)


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
    run theirs, and the adapters' gradients equal those of a run that computes every input gradient."""
    from studio.engine.fast.offload import HostInputs
    from studio.engine.fast.weights import FrozenWeights

    model = _peft_model(tiny_model, None, targets)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model, fast.FastOptions(checkpointing=mode != "eager"))
    assert fast_model is not None, why
    host = mode == "host"
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: host)
    fast_model._host = HostInputs(device, keep_qkv=True) if host else None
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

    # The reference: every input gradient computed (the benchmarks' lever for it).
    fast_model.options.input_gradient_of_first_layer = True
    ran.clear()
    model.zero_grad(set_to_none=True)
    fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()
    assert all(layer.qkv.weights in ran for layer in fast_model.layers)
    expected = _grads(model)
    assert got.keys() == expected.keys() and got
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("separate,backward_first", [(True, True), (False, True), (True, False)])
def test_grouped_query_attention_on_the_fast_path_equals_the_plain_path(tmp_path: Path, separate,
                                                                         backward_first) -> None:
    """Two key/value heads for four query heads: q, k and v of different widths, from their own
    products (weights.SeparateLoraProduct) or as column blocks of one, give the plain path's loss
    and gradients, with the input gradient's LoRA term first (the default) or last."""

    _save_llama(tmp_path, 2, 2)
    model = _peft_model(tmp_path, None, ALL)
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True)
    plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, labels=batch.labels).loss
    plain.backward()
    expected = _grads(model)
    model.zero_grad(set_to_none=True)
    fast_model, why = fast.prepare(model, fast.FastOptions(separate_qkv=separate, fused_backward=backward_first))
    assert fast_model is not None, why
    assert fast_model.layers[0].qkv.separate is separate
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
    wide enough for both (its capture drops the narrower graph); a later narrower stream reuses it."""
    from studio.engine.fast.graphs import Graphs

    graphs = Graphs.__new__(Graphs)
    graphs.graphed = {((1, 2048, 8), 33, 512, True): "A", ((2, 512, 8), 1, 0, True): "rows"}
    assert graphs.fit(2048, 64, 256) == (64, 512)  # wider in slots, as long in max_len
    assert graphs.fit(2048, 32, 128) == (32, 512)  # fits: A is reused
    assert graphs.fit(4096, 32, 128) == (32, 128)  # another length: its own layout
    assert graphs.fit(512, 8, 128) == (8, 128)  # rows without boundaries (cu of 1) are no flat layout
    graphs._replace(((1, 2048, 8), 65, 512, True))
    assert list(graphs.graphed.values()) == ["rows"]  # rows without boundaries are never replaced


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
    """gate/up (and q/k/v) multiplied one projection at a time, each into its own output columns,
    give the fused matrix's product forward and backward; the shared dequantization buffer then
    holds one projection, not the pair."""
    from studio.engine.fast.weights import FrozenWeights, Workspace

    model = _peft_model(tiny_model, bits, ALL)
    mlp = model.base_model.model.model.layers[0].mlp
    bases = [mlp.gate_proj.get_base_layer(), mlp.up_proj.get_base_layer()]
    device = bases[0].weight.device
    split_ws, fused_ws = Workspace(), Workspace()
    split = FrozenWeights(bases, torch.float32, False, split_ws, split=True)
    fused = FrozenWeights(bases, torch.float32, False, fused_ws, split=False)
    if bits == 4:
        assert split_ws.numel * 2 == fused_ws.numel == sum(split.out_features) * split.in_features
    split_ws.allocate(torch.float32, device)
    fused_ws.allocate(torch.float32, device)
    x = torch.randn(7, split.in_features, device=device)
    dy = torch.randn(7, sum(split.out_features), device=device)
    w = fused.matrix().clone()
    torch.testing.assert_close(split.forward_product(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.forward_product(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split.backward_product(dy), dy @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapted", [True, False])
def test_a_product_without_its_value_still_gives_its_backward(tiny_model: Path, adapted) -> None:
    """A recomputed layer's last product (layer.py's ``recompute``): its value is never read, so
    it is not computed (the output is a zero that owns one element), yet the gradients of its
    input and adapters are those of the full product."""
    from studio.engine.fast.weights import Projection

    model = _peft_model(tiny_model, None, ALL if adapted else ["q_proj"])
    proj = Projection([model.base_model.model.model.layers[0].mlp.down_proj], "default", torch.float32, False)
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
    """weights.LoraProduct's order (the LoRA update's product writes the output, with the residual,
    and the base product adds itself in its epilogue) gives the value and gradients of the plain
    order (base product, then the update, then the residual in a pass of its own), on split
    products (gate/up) and single ones (down), with and without an adapter; so does the same
    order in the backward (the LoRA term writes the input gradient, the base products add
    themselves), in every combination with the forward's."""
    from studio.engine.fast.weights import Projection, Workspace

    if bits == 4 and not torch.cuda.is_available():
        pytest.skip("4-bit products on the CPU dequantize in bf16 (see the plain-path test)")
    model = _peft_model(tiny_model, bits, targets)
    mlp = model.base_model.model.model.layers[0].mlp
    device = next(model.parameters()).device
    for modules in ([mlp.gate_proj, mlp.up_proj], [mlp.down_proj]):
        workspace = Workspace()
        proj = Projection(modules, "default", torch.float32, False, workspace)
        workspace.allocate(torch.float32, device)
        width = sum(proj.weights.out_features)
        x = torch.randn(2, 5, proj.weights.in_features, device=device, requires_grad=True)
        r = torch.randn(2, 5, width, device=device, requires_grad=True)
        dy = torch.randn(2, 5, width, device=device)
        results = []
        orders = ((True, True, True), (False, True, True), (True, False, False), (False, False, False),
                  (True, True, False), (False, False, True))
        for first, backward_first, residual in orders:
            proj.update_first, proj.backward_first = first, backward_first
            for t in (x, r, *proj.a, *proj.b):
                t.grad = None
            y = proj(x, residual=r if residual else None)
            y.backward(dy)
            grads = [x.grad.clone(), *[p.grad.clone() for p in proj.a + proj.b]]
            results.append((y.detach() - (r.detach() if residual else 0), grads, r.grad))
        (y0, g0, r0), (y1, g1, r1), (y2, g2, r2), (y3, g3, r3), (y4, g4, r4), (y5, g5, r5) = results
        for rk in (r0, r1, r5):
            torch.testing.assert_close(rk, dy)
        assert r2 is None and r3 is None and r4 is None
        for yk, gk in ((y1, g1), (y2, g2), (y3, g3), (y4, g4), (y5, g5)):
            torch.testing.assert_close(yk, y0, rtol=1e-5, atol=1e-5)
            for a, b in zip(gk, g0, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_small_update_survives_meeting_the_residual_stream_in_bf16(tiny_model: Path) -> None:
    """In bf16, an update under half the stream's last digit rounds away if it meets the residual
    stream first (the eighth session's order: the losses lagged the HF loop's by 3.3%). It has to
    meet the base product first, as in the plain order: the base product's varied values then
    carry it through the stream's rounding, so the output moves by the update on average."""
    from studio.engine.fast.weights import Projection, Workspace

    model = _peft_model(tiny_model, None, ["down_proj"], dtype=torch.bfloat16)
    module = model.base_model.model.model.layers[0].mlp.down_proj
    workspace = Workspace()
    proj = Projection([module], "default", torch.bfloat16, False, workspace)
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
    slopes = {}
    for first in (True, False):
        proj.update_first = first
        with torch.no_grad():
            moved = (proj(x, residual=stream).float() - proj(x, residual=stream, adapters=(None, None, 1.0))
                     .float())
        # How much of the update reaches the output (1: all of it, on average over the elements).
        slopes[first] = float((moved * update).sum() / (update * update).sum())
    assert slopes[False] > 0.8  # the plain order: base product, update, then the stream
    assert abs(slopes[True] - slopes[False]) < 0.2, slopes


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


@pytest.mark.parametrize(("packing", "kv_heads", "bits"), [(False, 4, None), (True, 4, None), (False, 2, None),
                                                          (True, 2, 4)])
def test_attention_kept_on_the_host_gives_the_recomputation_the_same_gradients(tmp_path: Path, packing, kv_heads,
                                                                               bits, monkeypatch) -> None:
    """With the attention kept (``keep_attention_from``), each offloaded layer's attention output and
    log-sum-exp wait on the host beside its q, k and v (the last layer's on the device), and the recomputation runs no attention:
    attention.KeptAttention returns the kept output and its backward is the kernel's own on the
    kept tensors. Loss and every adapter gradient equal the run that recomputes the attention:
    rows of one example (the kernel SDPA picks) and packed examples (varlen on CUDA, a
    block-diagonal mask on the CPU), grouped-query attention, a 4-bit base. On CUDA the model is
    bf16, so that the kernels are cuDNN's or flash-attention's as in training. A threshold above
    the longest example keeps no attention."""

    from studio.engine.fast import attention
    from studio.engine.fast.offload import ATTENTION, HostInputs

    cuda = torch.cuda.is_available()
    if bits == 4 and not cuda:
        pytest.skip("bitsandbytes' 4-bit layers need CUDA here")
    dtype = torch.bfloat16 if cuda else torch.float32
    _save_llama(tmp_path, 3, kv_heads, hidden=128)
    model = _peft_model(tmp_path, bits, ALL, dtype=dtype)
    if cuda and bits is None:
        model.to("cuda")  # a 4-bit model is loaded there
    device = next(model.parameters()).device
    lengths = [21, 14, 9] if packing else [24, 24]
    batch = collate([[e] for e in _examples(lengths)], pad_id=0, packing=packing).to(device)
    fast_model, why = fast.prepare(model, fast.FastOptions(cuda_graphs=False))
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    calls = []
    real = attention.KeptAttention.apply

    def counting(*args):
        calls.append(args[3].kind)
        return real(*args)

    monkeypatch.setattr(attention.KeptAttention, "apply", counting)
    results = []
    for host in (HostInputs(device, keep_qkv=True), HostInputs(device, keep_qkv=True, keep_attention_from=0),
                 HostInputs(device, keep_qkv=True, keep_attention_from=100)):
        fast_model._host = host
        calls.clear()
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach().float(), _grads(model)))
        assert not host._stored and not host._fetched and not host._extra  # all came back once
        kept = {key[0] for key in host._host if isinstance(key, tuple) and key[1] in ATTENTION}
        if len(results) == 2:
            assert kept == {0, 1} and len(calls) == 3, calls  # the last layer's stay on the device
            expected = ("varlen" if packing else ("cudnn", "flash")) if cuda else ("cpu_flash",)
            assert set(calls) <= set(expected if isinstance(expected, tuple) else (expected,)), calls
        else:
            assert not kept and not calls
    loss0, grads0 = results[0]
    rtol, atol = (2e-2, 1e-3) if cuda else (1e-5, 1e-7)
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, rtol=1e-6 if not cuda else 1e-3, atol=1e-6)
        assert grads.keys() == grads0.keys() and grads0
        for name, grad in grads0.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=rtol, atol=atol)


def test_a_kept_tensor_comes_back_with_its_layout() -> None:
    """offload._dense / _undense: a transposed view (an attention kernel's output) is copied as
    one block and given back with its original shape and strides."""
    from studio.engine.fast.offload import _dense, _undense

    base = torch.randn(1, 7, 4, 16)  # [B, T, H, D] memory
    view = base.transpose(1, 2)  # [B, H, T, D], as the kernels hand it out
    dense, order = _dense(view)
    assert dense.is_contiguous() and order is not None
    back = _undense(dense.clone(), order)
    assert back.shape == view.shape and back.stride() == view.stride()
    torch.testing.assert_close(back, view)
    plain = torch.randn(3, 5)
    assert _dense(plain) == (plain, None)


def test_a_kept_attention_whose_backward_fails_recomputes_and_keeps_no_more(tmp_path: Path, monkeypatch) -> None:
    """Should the kernel's backward operator fail on some torch, attention.KeptAttention's backward
    recomputes the attention through the layer's own call instead: the gradients are still the
    recomputing run's, and no later micro-batch keeps the attention."""

    from studio.engine.fast import attention
    from studio.engine.fast.offload import ATTENTION, HostInputs

    _save_llama(tmp_path, 2, 4)
    model = _peft_model(tmp_path, None, ALL)
    device = next(model.parameters()).device
    if device.type == "cuda":
        pytest.skip("the CPU's kernels: on CUDA the operators are the real ones")
    batch = collate([[e] for e in _examples([20, 20])], pad_id=0, packing=False).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    monkeypatch.setattr(attention, "_BROKEN", [])

    def failing(*args, **kwargs):
        raise RuntimeError("no such operator here")

    results = []
    for host, patch in ((HostInputs(device, keep_qkv=True), False),
                        (HostInputs(device, keep_qkv=True, keep_attention_from=0), True)):
        if patch:
            monkeypatch.setattr(attention, "backward", failing)
        fast_model._host = host
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append(_grads(model))
    assert attention.broken() == "RuntimeError: no such operator here"
    for name, grad in results[0].items():
        torch.testing.assert_close(results[1][name], grad, rtol=1e-5, atol=1e-7)
    host = fast_model._host
    host._host.clear()
    fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids).backward()
    assert not any(isinstance(key, tuple) and key[1] in ATTENTION for key in host._host)


@pytest.mark.parametrize("keep_qkv", [False, True])
def test_the_last_layer_s_tensors_stay_on_the_device(tmp_path: Path, keep_qkv, monkeypatch) -> None:
    """HostInputs.last_on_device: the last layer's input (and kept q, k, v and attention) are never
    copied to the host and back: the same loss and gradients as copying them, and no host buffer
    for that layer."""

    from studio.engine.fast.offload import HostInputs

    _save_llama(tmp_path, 3, 2)
    model = _peft_model(tmp_path, None, ALL)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=True).to(device)
    fast_model, why = fast.prepare(model)
    assert fast_model is not None, why
    monkeypatch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
    results = []
    for last_on_device in (False, True):
        host = HostInputs(device, keep_qkv=keep_qkv, keep_attention_from=0, last_on_device=last_on_device)
        fast_model._host = host
        model.zero_grad(set_to_none=True)
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
        layers = {key[0] if isinstance(key, tuple) else key for key in host._host}
        assert layers == ({0, 1} if last_on_device else {0, 1, 2})
        assert not host._stored and not host._fetched and not host._extra
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads0.keys() == grads1.keys() and grads0
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)


def test_product_library_choices_resolve_most_specific_first() -> None:
    from studio.engine.fast.model import libraries_for

    choice = {"*": "cublas", "*.backward": "cublaslt", "gate_up.forward": "cublaslt", "down": "cublaslt"}
    assert libraries_for(choice, "qkv") == {"forward": "cublas", "backward": "cublaslt"}
    assert libraries_for(choice, "gate_up") == {"forward": "cublaslt", "backward": "cublaslt"}
    assert libraries_for(choice, "down") == {"forward": "cublaslt", "backward": "cublaslt"}
    assert libraries_for(None, "o") == {} and libraries_for({"o.backward": "cublaslt"}, "o") == {"backward": "cublaslt"}
    with pytest.raises(ValueError, match="gate_up.fwd"):
        libraries_for({"gate_up.fwd": "cublaslt"}, "gate_up")
    with pytest.raises(ValueError, match="'cutlass' is not"):
        libraries_for({"*": "cutlass"}, "qkv")


def test_a_product_library_is_asked_for_around_the_products_and_put_back(tiny_model: Path, monkeypatch) -> None:
    """FastOptions.product_library: each base product runs with its library asked of torch, the
    process-wide choice is put back afterwards, and the loss and gradients are the default's."""
    from studio.engine.fast import weights

    model = _peft_model(tiny_model, None, ALL)
    device = next(model.parameters()).device
    batch = collate([[e] for e in _examples([21, 14, 9])], pad_id=0, packing=False).to(device)
    results = []
    real = weights.blas_library
    for choice in (None, {"gate_up.forward": "cublaslt", "*.backward": "cublaslt"}):
        asked: list[str | None] = []

        def spy(name, real=real, asked=asked):
            asked.append(name)
            return real(name)

        monkeypatch.setattr(weights, "blas_library", spy)
        before = torch.backends.cuda.preferred_blas_library()
        fast_model, why = fast.prepare(model, fast.FastOptions(product_library=choice, cuda_graphs=False))
        assert fast_model is not None, why
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        assert torch.backends.cuda.preferred_blas_library() == before
        results.append((loss.detach(), _grads(model), asked))
        model.zero_grad(set_to_none=True)
    (plain_loss, plain_grads, plain_asked), (loss, grads, asked) = results
    assert set(plain_asked) == {None}
    # Per layer: gate/up's forward (and its recomputation's) and the four backwards (the first
    # layer's q/k/v run none: its input wants no gradient); the other forwards ask for nothing.
    assert asked.count("cublaslt") >= 2 * (1 + 4) - 1 and None in asked
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


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
