"""Why a CUDA graph capture through the gradient sink (engine/fast/graphs.py's GradSink) fails: one
variant a process (a failed capture leaves the process's CUDA generator unusable), each printing the
first error with its traceback.

    python3 bench/diag_sink.py             # every variant, one line (or a traceback) each
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("sink", "sink_no_offload", "sink_mid_window")


def run(variant: str) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from test_fast_dropout import _batch, _model  # noqa: PLC0415

    from studio.core.config import FastPathConfig
    from studio.engine import fast
    from studio.engine.tiny import build_tiny_model

    real = torch.cuda.make_graphed_callables
    first: list[str] = []

    def traced(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except Exception:
            first.append(traceback.format_exc()[-4000:])
            raise
    torch.cuda.make_graphed_callables = traced

    model = _model(build_tiny_model(), 0.0, "cuda", torch.bfloat16)
    options = FastPathConfig(host_offload=variant != "sink_no_offload")
    fast_model, why = fast.prepare(model, options=options)
    assert fast_model is not None, why
    # two layouts in one step: the second is captured while the first one's gradients accumulate
    batches = [_batch("cuda")] + ([_batch("cuda", seed=1, lengths=(30, 6, 8))] if variant == "sink_mid_window" else [])
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        for batch in batches:
            loss = fast_model.loss(batch.input_ids, batch.labels, batch.attention_mask, batch.position_ids)
            loss.backward()
            del loss
    if fast_model.graphs_failed:
        return "FAILED\n" + (first[0] if first else fast_model.graphs_failed[:3000])
    return f"ok ({len(fast_model._graphs.graphed)} layouts graphed)"


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from bench.diag_capture import each_in_its_own_process  # noqa: PLC0415

    return each_in_its_own_process(__file__, VARIANTS, run)


if __name__ == "__main__":
    raise SystemExit(main())
