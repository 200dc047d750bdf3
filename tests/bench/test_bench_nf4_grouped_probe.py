"""bench/nf4_grouped_probe.py on the CPU, under Triton's interpreter: the fused kernel's product over
NF4 experts (bitsandbytes' packing, blocks along the output) equals the dequantized weights' product
within bf16 rounding, at a shape with partial tiles of rows. Its timings need a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from bench import nf4_grouped_probe as probe  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on the CPU; the GPU runs the bench itself")
def test_the_fused_kernel_multiplies_the_nf4_experts_it_decodes(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = probe.case("tiny", (3, 20, 128, 256), probe.TILES[:1], iters=1)
    (tile,) = out["tiles"].values()
    assert "error" not in tile and tile["max_rel_err"] < 0.02
    assert out["shape"] == {"experts": 3, "rows_per_expert": 20, "in": 128, "out": 256}
    assert out["bf16_weights_gb"] == 4 * out["packed_gb"]
