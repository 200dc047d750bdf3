"""Adapter dropout on the fast path (studio/engine/fast/dropout.py): masks that are a function of
(seed, site, element), so CUDA graphs and recomputed layers see the masks the step drew.

On the CPU: the masks' rate and independence, the fused product against PEFT's own modules given
the same masks (loss and every adapter gradient), and recomputation (checkpointing, host-held
inputs) regenerating the forward's masks. On CUDA: graph replay against eager steps with dropout."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from studio.core.config import FastPathConfig
from studio.engine import fast
from studio.engine.batching import collate
from studio.engine.fast.dropout import dropout, keep_mask

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ORDER = {"q_proj": (0, 0), "k_proj": (0, 1), "v_proj": (0, 2), "o_proj": (1, 0), "gate_proj": (2, 0),
         "up_proj": (2, 1), "down_proj": (3, 0)}
"""Each module's (fused projection, place among its adapters) as the fast path numbers them."""


def _model(tiny_model: Path, rate: float, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=dtype).to(device)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=rate, target_modules=ALL))
    with torch.no_grad():  # B starts at zero in LoRA: give it values so that every gradient flows
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    model.train()
    return model


def _batch(device, seed: int = 0, lengths=(21, 14, 9)):
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        ids = [rng.randrange(3, 300) for _ in range(n)]
        rows.append([SimpleNamespace(input_ids=ids, labels=[-100] * (n // 3) + ids[n // 3:])])
    return collate(rows, pad_id=0, packing=True).to(device)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


class _SameMask(nn.Module):
    """PEFT's dropout module replaced by the fast path's mask for the same site (the reference)."""

    def __init__(self, p: float, seed: torch.Tensor, site: int):
        super().__init__()
        self.p, self.seed, self.site = p, seed, site

    def forward(self, x):
        shape = x.shape
        return dropout(x.reshape(-1, shape[-1]), self.p, self.seed, self.site).view(shape)


def test_masks_keep_the_rate_and_differ_between_sites_and_seeds() -> None:
    seed = torch.tensor([987654321])
    n, p = 200_000, 0.1
    mask = keep_mask(n, p, seed, 5)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.005
    assert torch.equal(mask, keep_mask(n, p, seed, 5))  # a function of its inputs: no RNG state
    for other in (keep_mask(n, p, seed, 6), keep_mask(n, p, seed + 1, 5)):
        agree = (mask == other).float().mean().item()
        assert abs(agree - ((1 - p) ** 2 + p ** 2)) < 0.005  # independent masks agree this often
    x = torch.randn(300, 700)
    y = dropout(x, 0.25, seed, 1)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    assert abs(kept.float().mean().item() - 0.75) < 0.01


def test_fused_dropout_equals_peft_modules_with_the_same_masks(tiny_model: Path) -> None:
    """The fast path's loss and all 28 adapter gradients equal PEFT's forward and autograd when
    PEFT's dropout modules apply the same masks: the fused product's masked forward and its
    hand-written backward (input and adapter gradients, the masked LoRA terms writing the input
    gradient before the base products add themselves) are right."""
    model = _model(tiny_model, 0.2)
    batch = _batch("cpu")
    fast_model, why = fast.prepare(model, options=FastPathConfig(cuda_graphs=False))
    assert fast_model is not None, why
    assert fast_model._seed is not None
    torch.manual_seed(7)
    loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    seed = fast_model._seed.tensor  # the seed that step used, still in place
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            layer = int(name.split(".layers.")[1].split(".")[0])
            proj, j = ORDER[name.rsplit(".", 1)[1]]
            module.lora_dropout["default"] = _SameMask(0.2, seed, (layer * 4 + proj) * 8 + j)
    plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids, labels=batch.labels).loss
    plain.backward()
    expected = _grads(model)
    # The plain loss is the mean over the same targets (packed examples: their boundaries ignored)
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-5)
    assert got.keys() == expected.keys() and len(got) == 28
    for name, grad in expected.items():
        assert grad.abs().sum() > 0, name
        rel = (got[name] - grad).norm() / grad.norm()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_dropout_changes_with_each_micro_batch_and_not_in_evaluation(tiny_model: Path) -> None:
    model = _model(tiny_model, 0.3)
    batch = _batch("cpu")
    fast_model, _ = fast.prepare(model, options=FastPathConfig(cuda_graphs=False))
    args = (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    torch.manual_seed(1)
    first = fast_model.loss(*args).item()
    second = fast_model.loss(*args).item()  # the next micro-batch: a fresh seed, other masks
    torch.manual_seed(1)
    again = fast_model.loss(*args).item()  # the generator restored (a resumed run): the same masks
    assert first != second and again == first
    model.eval()  # evaluation: no dropout, so the loss no longer depends on the seed
    with torch.no_grad():
        a = fast_model.loss(*args).item()
        b = fast_model.loss(*args).item()
    assert a == b


@pytest.mark.parametrize("recompute", ["checkpointing", "host", "host_qkv"])
def test_recomputed_layers_regenerate_the_forward_masks(tiny_model: Path, recompute, monkeypatch) -> None:
    """Per-layer checkpointing and host-held inputs (with the q, k and v kept beside them too:
    the recomputation's q/k/v adapters then mask their input in products.KeptQKV; or, past the
    budget, recomputed) recompute each layer in the backward: with the masks regenerated from the
    seed, loss and gradients equal a step that keeps every activation."""
    from studio.engine.fast.offload import HostInputs

    model = _model(tiny_model, 0.2)
    batch = _batch("cpu")
    args = (batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
    results = []
    for checkpointing in (False, True):
        fast_model, _ = fast.prepare(model, options=FastPathConfig(cuda_graphs=False))
        with monkeypatch.context() as patch:
            if not checkpointing:  # every activation kept: the layers run straight through
                patch.setattr("studio.engine.fast.model.checkpoint", lambda run, *a, **kw: run(*a))
            elif recompute.startswith("host"):
                patch.setattr("studio.engine.fast.model.offload_for", lambda tokens, dropout, cuda: True)
                budget = None if recompute == "host_qkv" else 0  # 0: only the last layer keeps them
                fast_model._host = HostInputs(torch.device("cpu"), keep_budget=budget)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            loss = fast_model.loss(*args)
            loss.backward()
        results.append((loss.detach(), _grads(model)))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, rtol=1e-5, atol=1e-7)
    if recompute == "host_qkv":
        assert any(isinstance(key, tuple) for key in fast_model._host._host)  # q, k and v were kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_replay_each_steps_dropout_masks(tiny_model: Path) -> None:
    """On CUDA (the Triton mask kernel): a graphed step equals an eager one with the same seed, over
    steps with gradient accumulation and with zeroed (``set_to_none``) gradients between steps; and
    replays with other seeds give other losses (the graph did not freeze one mask). A 4-bit model in
    bf16: packed rows are graphed only with flash-attention's varlen kernel, which takes half
    precision (an fp32 model attends through a block-diagonal mask, eagerly)."""
    from test_fast_path import _peft_model

    model = _peft_model(tiny_model, 4, ALL, dtype=torch.bfloat16, dropout=0.1)
    model.to(next(p for p in model.parameters() if p.requires_grad).device).train()
    assert next(model.parameters()).is_cuda
    batches = [_batch("cuda", seed=s) for s in (0, 1)]
    runs = []
    for graphs in (False, True):
        fast_model, why = fast.prepare(model, options=FastPathConfig(cuda_graphs=graphs))
        assert fast_model is not None, why
        torch.manual_seed(11)
        losses, grads = [], []
        for _step in range(3):
            model.zero_grad(set_to_none=True)
            for batch in batches:  # two micro-batches accumulate into one step's gradients
                loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
                loss.backward()
                losses.append(loss.item())
                del loss  # alive, the spent graph would break the next capture (docs/speed.md)
            grads.append(_grads(model))
        if graphs:
            assert fast_model._graphs is not None and not fast_model._graphs.failed, fast_model._graphs.failed
            assert fast_model._graphs.graphed, "no layout was captured"
        runs.append((losses, grads))
    (eager_losses, eager_grads), (graph_losses, graph_grads) = runs
    assert len(set(graph_losses[0::2])) == 3  # the same batch, three steps: three sets of masks
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)
    for step_eager, step_graph in zip(eager_grads, graph_grads, strict=True):
        for name, grad in step_eager.items():
            rel = (step_graph[name] - grad).norm() / grad.norm()
            assert rel < 1e-2, f"{name}: relative gradient error {rel:.2e}"  # bf16: atomics flip last bits


def test_the_torch_masks_are_the_same_in_chunks(monkeypatch) -> None:
    """The torch version (CPU, or CUDA without Triton) works in chunks to bound its temporaries:
    element i gets the same mask whichever chunk holds it, plain or added into an output."""
    import studio.engine.fast.dropout as module

    x = torch.randn(37, 301)
    seed = torch.tensor([99])
    whole = dropout(x, 0.3, seed, 5)
    monkeypatch.setattr(module, "_CHUNK", 1000)
    torch.testing.assert_close(dropout(x, 0.3, seed, 5), whole, rtol=0, atol=0)
    added = torch.ones_like(x)
    dropout(x, 0.3, seed, 5, out=added, accumulate=True)
    torch.testing.assert_close(added, whole + 1)
