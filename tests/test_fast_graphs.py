"""The fast path's CUDA graphs (studio/engine/fast/graphs.py), on a CUDA GPU: replayed steps equal
eager ones over gradient accumulation and zeroed gradients; and the one known fault, a 16-bit
model's capture after eager training steps, is still what docs/speed.md says it is."""

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


def test_a_16bit_models_capture_after_eager_steps() -> None:
    """The one known fault (docs/speed.md): a 16-bit model's backward capture after eager training
    steps on it makes the legacy stream depend on the capture, and the step falls back to eager.
    Run in its own process (the failed capture leaves that process's CUDA generator unusable): it
    must run to the end; while the fault stands it is reported as an expected failure, and when it
    is gone this test passes and the docs should say so."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "diag_capture.py"), "test_sequence_0.0"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    if "depend on a capturing blocking stream" in done.stdout:
        pytest.xfail("known fault: a 16-bit model's capture after eager steps (docs/speed.md)")
    assert "test_sequence_0.0: ok" in done.stdout, done.stdout[-2000:]
