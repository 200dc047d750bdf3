"""bench/fused_gate_up.py's kernel: the product with SwiGLU and the LoRA update in its epilogue that
issue 13's notes measure against cuBLAS plus Studio's SwiGLU. A timing only means something if the
fused kernel computes what the engine computes, so it is checked here against the engine's order in
fp32 (on the CPU in Triton's interpreter, on a GPU compiled), edge tiles and every output mode included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from bench.fused_gate_up import config_name, fused_gate_up, parse_config  # noqa: E402
from studio.engine.fast import update  # noqa: E402


def _inputs(device, m: int, k: int, ffn: int, rank: int):
    gen = torch.Generator().manual_seed(m + ffn)
    x = torch.randn(m, k, generator=gen)
    w = 0.1 * torch.randn(2 * ffn, k, generator=gen)
    xa = torch.randn(m, 2 * rank, generator=gen)
    bt = torch.zeros(2 * rank, 2 * ffn)
    bt[:rank, :ffn] = 0.1 * torch.randn(rank, ffn, generator=gen)
    bt[rank:, ffn:] = 0.1 * torch.randn(rank, ffn, generator=gen)
    return [t.to(device, torch.bfloat16) for t in (x, w, xa, bt)]


@pytest.mark.parametrize("config", ["32x32x32x1x4", "64x64x32x1x4-g2n", "32x32x32x1x4-f", "32x32x32x1x4-k"])
@pytest.mark.parametrize(("m", "ffn"), [(80, 96), (64, 64)])
def test_the_fused_kernel_gives_the_product_and_swiglu_of_product_plus_update(kernel_device, config, m, ffn):
    """Gate's and up's base outputs (written for the backward) and ``silu(g + upd) * (u + upd)``
    equal the plain formula in fp32 to a few bf16 roundings (the interpreter truncates where the
    compiled kernel rounds); rows and columns that do not fill a tile included; persistent,
    one-program-a-tile and flattened loops alike."""
    k, rank, scale = 64, 4, 2.0
    x, w, xa, bt = _inputs(kernel_device, m, k, ffn, rank)
    cfg = parse_config(config)
    gu, act = fused_gate_up(x, w, xa, bt, scale, rank, cfg, write_gu=True, swiglu=True, programs=3)

    base = x.float() @ w.float().T
    upd = scale * (xa.float() @ bt.float())
    want_act = F.silu(base[:, :ffn] + upd[:, :ffn]) * (base[:, ffn:] + upd[:, ffn:])
    tol = 2 ** -7 * 4
    assert (gu.float() - base).abs().max().item() <= tol * base.abs().max().item()
    assert (act.float() - want_act).abs().max().item() <= tol * want_act.abs().max().item()
    # the engine's own SwiGLU kernel on the rounded base output: the same values to its rounding
    engine = update.gated(base.to(torch.bfloat16), xa, bt, scale, (0, rank, rank, rank))
    assert (act.float() - engine.float()).abs().max().item() <= tol * want_act.abs().max().item()

    # the forward's mode writes SwiGLU's output alone; without adapters it is the base's SwiGLU
    none, act_only = fused_gate_up(x, w, xa, bt, scale, rank, cfg, write_gu=False, swiglu=True, programs=3)
    assert none is None and torch.equal(act_only, act)
    _, plain = fused_gate_up(x, w, None, bt, scale, rank, cfg, write_gu=False, swiglu=True, programs=3)
    want_plain = F.silu(base[:, :ffn]) * base[:, ffn:]
    assert (plain.float() - want_plain).abs().max().item() <= tol * want_plain.abs().max().item()


def test_configs_read_and_name_back():
    assert parse_config("128x128x64x3x8") == (128, 128, 64, 3, 8, 8, False, True, "")
    assert parse_config("64x128x64x4x4-g16fn") == (64, 128, 64, 4, 4, 16, True, False, "")
    assert parse_config("128x128x64x3x8-nk")[-2:] == (False, "k")
    for text in ("128x128x64x3x8", "128x128x64x3x8-f", "128x64x64x4x4-g4n", "128x128x64x3x8-w"):
        assert config_name(parse_config(text)) == text
