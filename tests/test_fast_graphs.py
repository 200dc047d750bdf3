"""The fast path's CUDA graphs (studio/engine/fast/graphs.py), on a CUDA GPU: replayed steps equal
eager ones over gradient accumulation and zeroed gradients; a capture after eager steps works when
their losses were released, and fails while one is alive (docs/speed.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from studio.engine import fast
from studio.engine.batching import collate
from studio.engine.fast.model import FastOptions

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]


def _run(model, batches, options: FastOptions, steps: int = 3):
    fast_model, why = fast.prepare(model, options=options)
    assert fast_model is not None, why
    losses, grads = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        for batch in batches:  # micro-batches accumulate into one step's gradients
            loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
            loss.backward()
            losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    return fast_model, losses, grads


def test_graphed_steps_equal_eager_ones(tiny_model: Path) -> None:
    from test_fast_path import _examples, _peft_model

    # bf16: packed rows are graphed only with flash-attention's varlen kernel (half precision only)
    model = _peft_model(tiny_model, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                        dtype=torch.bfloat16)
    device = next(p for p in model.parameters() if p.requires_grad).device
    model.to(device)
    batches = [collate([[e] for e in _examples(lengths, seed=s)], pad_id=0, packing=True).to(device)
               for s, lengths in enumerate(([21, 14, 9], [30, 6, 8]))]
    _, eager_losses, eager_grads = _run(model, batches, FastOptions(cuda_graphs=False))
    graphed, graph_losses, graph_grads = _run(model, batches, FastOptions())
    assert graphed._graphs is not None and not graphed._graphs.failed, graphed._graphs.failed
    assert graphed._graphs.graphed, "no layout was captured"
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-4)
    for step_eager, step_graph in zip(eager_grads, graph_grads, strict=True):
        for name, grad in step_eager.items():
            assert grad.abs().sum() > 0, name
            rel = (step_graph[name] - grad).norm() / grad.norm()
            assert rel < 1e-2, f"{name}: relative gradient error {rel:.2e}"  # bf16: atomics flip last bits


def _diag(case: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "diag_capture.py"), case],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_capture_after_eager_steps_whose_losses_are_released() -> None:
    """Eager training steps, then the first capture, on one model: it captures when each spent loss
    was released after its backward (as the Trainer does). In its own process: a failed capture
    leaves that process's CUDA generator unusable."""
    out = _diag("test_sequence_0.0_released")
    assert "test_sequence_0.0_released: ok" in out, out[-2000:]


def test_a_capture_while_an_earlier_loss_is_alive() -> None:
    """The fault the Trainer steps around (docs/speed.md): with an earlier forward's loss still alive,
    its gradient accumulators belong to the default stream and the backward capture fails; the step
    falls back to eager. Reported as an expected failure while PyTorch behaves so; when it passes,
    the Trainer's ``del loss`` and the docs can go."""
    out = _diag("test_sequence_0.0")
    if "depend on a capturing blocking stream" in out:
        pytest.xfail("known: a capture while an earlier loss is alive (docs/speed.md)")
    assert "test_sequence_0.0: ok" in out, out[-2000:]
