"""bench/nf4_grouped_probe.py on the CPU, under Triton's interpreter: both products of engine/fast/
nf4_experts.py's kernels (the forward's and the backward's, for each way a model stores its experts)
equal the dequantized weights' products within bf16 rounding, with rows of each expert in partial
tiles, uniform and skewed. Its timings need a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from bench import nf4_grouped_probe as probe  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on the CPU; the GPU runs the bench itself")
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("name", list(probe.TINY))
def test_both_products_multiply_the_nf4_experts_they_decode(monkeypatch, name, routing) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = probe.case(name, probe.TINY[name], probe.tiles(tiny=True), iters=1, routing=routing)
    assert out["shape"]["rows"] == 3 * 20 and out["routing"] == routing
    assert set(out["passes"]) == {"forward", "backward"}
    for entry in out["passes"].values():
        (tile,) = entry["tiles"]
        assert "error" not in tile and tile["max_rel_err"] < 0.02
    assert out["bf16_weights_gb"] == 4 * out["packed_gb"]
