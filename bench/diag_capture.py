"""Which part of adapter dropout breaks CUDA graph capture (a diagnostic, one case a process: a failed
capture leaves the process's CUDA generator unusable).

    python3 bench/diag_capture.py            # runs every case in its own process, prints one line each
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

CASES = ("kernel_warm", "kernel_accumulate", "kernel_cold_shape", "kernel_first_use", "model_graphs",
         "test_sequence_0.1", "test_sequence_0.0", "test_sequence_0.1_graphs_only",
         "test_sequence_0.0_no_offload", "test_sequence_0.0_collect", "test_sequence_0.0_released")


def _capture(fn) -> str:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the diagnostic reports it
        return f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}"


def run(case: str) -> str:
    from studio.engine.fast import dropout as module

    seed = torch.tensor([42], device="cuda", dtype=torch.int64)
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    if case == "kernel_first_use":  # the kernel built (and self-checked) inside the capture
        return _capture(lambda: module.dropout(x, 0.1, seed, 5))
    assert module._triton_kernel(), "the Triton kernel failed its self-check"
    module.dropout(x, 0.1, seed, 5)
    out = torch.zeros_like(x)
    module.dropout(x, 0.1, seed, 5, out=out, accumulate=True)
    if case == "kernel_warm":
        return _capture(lambda: module.dropout(x, 0.1, seed, 5))
    if case == "kernel_accumulate":
        return _capture(lambda: module.dropout(x, 0.1, seed, 6, out=out, accumulate=True))
    if case == "kernel_cold_shape":  # a size not seen before (Triton specializes on n % 16)
        y = torch.randn(4097, 511, device="cuda", dtype=torch.bfloat16)
        return _capture(lambda: module.dropout(y, 0.1, seed, 7))
    if case.startswith("test_sequence"):  # tests/engine/test_fast_dropout.py's CUDA test, step by step
        return _sequence(float(case.split("_")[2]), eager_first=not case.endswith("graphs_only"),
                         offload=not case.endswith("no_offload"), collect=case.endswith("collect"),
                         release=case.endswith("released"))
    if case == "model_graphs":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
        from test_fast_dropout import _batch, _model  # noqa: PLC0415

        from studio.engine import fast
        from studio.engine.tiny import build_tiny_model

        model = _model(build_tiny_model(), 0.1, "cuda", torch.bfloat16)
        fast_model, why = fast.prepare(model)
        assert fast_model is not None, why
        batch = _batch("cuda")
        loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
        loss.backward()
        if fast_model.graphs_failed:
            return "FAILED " + fast_model.graphs_failed[:3000]
        return f"ok ({len(fast_model._graphs.graphed)} layouts graphed)"
    raise SystemExit(f"unknown case {case}")


def _sequence(rate: float, eager_first: bool, offload: bool = True, collect: bool = False,
              release: bool = False) -> str:
    """The eager steps, then the graphed ones, on one model; the last loss stays alive from one
    micro-batch to the next (as a loop variable does) unless ``release``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
    from test_fast_dropout import _batch, _model  # noqa: PLC0415

    from studio.core.config import FastPathConfig
    from studio.engine import fast
    from studio.engine.tiny import build_tiny_model

    events = []
    model = _model(build_tiny_model(), rate, "cuda", torch.bfloat16)
    batches = [_batch("cuda", seed=s) for s in (0, 1)]
    for graphs in ((False, True) if eager_first else (True,)):
        if collect:  # the eager model and its host buffers gone before the capture
            fast_model = None
            import gc  # noqa: PLC0415
            gc.collect()
            torch.cuda.synchronize()
        fast_model, why = fast.prepare(model, options=FastPathConfig(cuda_graphs=graphs, host_offload=offload))
        assert fast_model is not None, why
        torch.manual_seed(11)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            for index, batch in enumerate(batches):
                loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
                loss.backward()
                events.append(f"graphs={graphs} step {step} batch {index}: loss {loss.item():.5f}")
                if release:
                    del loss
        if graphs:
            if fast_model.graphs_failed:
                return f"FAILED: capture failed: {fast_model.graphs_failed[:2500]}\n  " + "\n  ".join(events)
            events.append(f"captured layouts {sorted(fast_model._graphs.graphed)}")
    return "ok\n  " + "\n  ".join(events)


def each_in_its_own_process(script: str, cases, run_one) -> int:
    """With a case on the command line, run it here and print its line; without, run every case in
    a fresh process of ``script`` (a failed capture spoils its process's CUDA generator)."""
    if len(sys.argv) > 1:
        print(f"{sys.argv[1]}: {run_one(sys.argv[1])}", flush=True)
        return 0
    for case in cases:
        done = subprocess.run([sys.executable, script, case], capture_output=True, text=True, timeout=300)
        print(done.stdout.strip() or f"{case}: exit {done.returncode}\n{done.stderr[-3000:]}", flush=True)
    return 0


def main() -> int:
    return each_in_its_own_process(__file__, CASES, run)


if __name__ == "__main__":
    raise SystemExit(main())
