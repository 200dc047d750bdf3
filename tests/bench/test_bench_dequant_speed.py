"""bench/dequant_speed.py's ``--mxfp4`` part on the CPU, under Triton's interpreter: at small shapes
it runs both ways into both layouts, finds the kernel's values equal to the torch way's for every
tile choice it would sweep on a GPU, and adds the rows up as its GPU result will."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bench.dequant_speed import mxfp4_rows  # noqa: E402
from studio.engine.fast import mxfp4_dequant  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on the CPU; the GPU runs the bench itself")
def test_the_mxfp4_rows_run_both_ways_and_find_the_kernel_exact(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def timed(fn) -> float:
        fn()
        return 2.0 if fn.func.__name__ == "dequantize_mxfp4" else 1.0

    chosen = mxfp4_dequant.ROWS, mxfp4_dequant.GROUPS, mxfp4_dequant.NUM_WARPS
    result = mxfp4_rows({"gate/up": (2, 40, 96), "down": (2, 20, 64)}, torch.device("cpu"), timed, sweep=True)
    assert (mxfp4_dequant.ROWS, mxfp4_dequant.GROUPS, mxfp4_dequant.NUM_WARPS) == chosen
    for name in ("gate/up", "down"):
        row = result["shapes"][name]
        for key in ("torch_contiguous", "triton_contiguous", "torch_transposed", "triton_transposed"):
            assert row[key]["equal_to_torch"], (name, key)
        assert row["speedup_contiguous"] == row["speedup_transposed"] == 2.0
        assert len(row["sweep_us"]) == 24
    assert result["per_layer_step_us"] == {"torch": 12.0, "triton": 6.0}
    assert result["step_ms_gpt_oss_20b"] == {"torch": 0.29, "triton": 0.14}
