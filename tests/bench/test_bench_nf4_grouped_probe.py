"""bench/nf4_grouped_probe.py on the CPU, under Triton's interpreter: both products of engine/fast/
stored_experts.py (the forward's and the backward's, for each way a model stores its experts) equal the
dequantized weights' products within bf16 rounding, NF4 and MXFP4, with rows of each expert in
partial tiles, uniform and skewed, at the engine's BLOCK_M and another. Its timings need a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from bench import nf4_grouped_probe as probe  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on the CPU; the GPU runs the bench itself")
@pytest.mark.parametrize("fmt", ["nf4", "mxfp4"])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("name", list(probe.TINY))
def test_both_products_multiply_the_experts_they_decode(monkeypatch, name, routing, fmt) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = probe.case(name, probe.TINY[name], iters=1, routing=routing, block_ms=(16,), fmt=fmt)
    assert out["format"] == fmt
    assert out["shape"]["rows"] == 3 * 20 and out["routing"] == routing and out["engine_reads_stored"]
    assert set(out["passes"]) == {"forward", "backward"}
    for entry in out["passes"].values():
        assert set(entry["fused"]) == {"BLOCK_M 64", "BLOCK_M 16"}
        assert all("error" not in t and t["max_rel_err"] < 0.02 for t in entry["fused"].values())
    assert out["bf16_weights_gb"] == 4 * out["packed_gb"]  # two values a byte, two bytes a bf16 value
