"""bench/nf4_grouped_probe.py on the CPU, under Triton's interpreter: both products of bench/
nf4_grouped.py's kernels (the forward's and the backward's, for each way a model stores its experts)
equal the dequantized weights' products within bf16 rounding, with rows of each expert in partial
tiles, uniform and skewed; they multiply dequant.py's weights to the bit; every tile the probe sweeps
compiles for an H100 (sm_90, Triton's own ptxas). The byte-permute decoding (bench/nf4_decode_asm.py),
which only a GPU runs, is checked here by an emulator of its PTX instructions. Its timings need a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from bench import nf4_decode_asm  # noqa: E402
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
        assert entry["tiles"] and all("error" not in t and t["max_rel_err"] < 0.02 for t in entry["tiles"])
    assert out["bf16_weights_gb"] == 4 * out["packed_gb"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on the CPU")
@pytest.mark.parametrize("nested", [False, True])
def test_the_products_multiply_dequant_py_s_weights_to_the_bit(monkeypatch, nested) -> None:
    """One-hot rows pick single weights out: each product's output is the dequantized weight."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bench.nf4_grouped import Nf4Products
    from studio.engine.fast.frozen import dequantize_packed
    from studio.engine.quantized_experts import _quantize

    experts, a, b = 2, 64, 128
    w = (torch.randn(experts, a, b, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    packed, state = _quantize(w, "nf4", nested)
    dense = torch.empty(experts, a, b, dtype=torch.bfloat16)
    dequantize_packed(packed, state, dense, None)
    prod = Nf4Products(packed, state, (experts, a, b), torch.device("cpu"))
    picks_b = torch.eye(b).repeat(experts, 1).to(torch.bfloat16)  # row r of expert e: y = W_e[:, r]
    y = prod.reduce_b(picks_b, torch.tensor([b, 2 * b], dtype=torch.int32), prod.window())
    assert torch.equal(y.view(experts, b, a), dense.transpose(1, 2))
    picks_a = torch.eye(a).repeat(experts, 1).to(torch.bfloat16)  # y = W_e[r, :]
    y = prod.reduce_a(picks_a, torch.tensor([a, 2 * a], dtype=torch.int32), prod.window())
    assert torch.equal(y.view(experts, a, b), dense)


def test_every_tile_the_probe_sweeps_compiles_for_an_h100(monkeypatch) -> None:
    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this Triton has no NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench import nf4_grouped

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = nf4_grouped.KERNELS.get()
    kinds = {"packed_ptr": "*u8", "absmax_ptr": "*u8", "code2_ptr": "*fp32", "absmax2_ptr": "*fp32",
             "offset_ptr": "*fp32", "code_ptr": "*fp32", "offs_ptr": "*i32"}
    built = 0
    for name, sweep in probe.tiles(tiny=False).items():
        fn = kernels[name]
        for tile in sweep:
            constants = dict(EXPERTS=128, BLOCKSIZE=64, NESTED=True, BLOCKSIZE2=256, FP32_DOT=False,
                             ROUND_BY_HAND=False, **{k: v for k, v in tile.items() if not k.startswith("num_")})
            signature = {arg: "constexpr" if arg in constants else kinds.get(arg, "*bf16" if arg.endswith("_ptr")
                                                                             else "i32") for arg in fn.arg_names}
            kernel = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": tile["num_warps"], "num_stages": tile["num_stages"]})
            assert kernel.metadata.shared <= 232448, (name, tile)
            built += 1
    assert built == sum(len(t) for t in probe.tiles(tiny=False).values()) > 10


def test_the_byte_permutes_decode_every_byte_to_bitsandbytes_nf4_values() -> None:
    """Every byte value in each of the four positions of the input word, as the PTX program
    computes it (prmt's default mode, lop3, by the PTX ISA): the high nibbles' fp32 code values in
    outputs 0-3, the low nibbles' in 4-7, bit for bit bitsandbytes' table."""
    import bitsandbytes.functional as bnbf

    table = [int(v) for v in bnbf.get_4bit_type("nf4", device="cpu").float().view(torch.int32)]
    assert [nf4_decode_asm._bits(v) for v in nf4_decode_asm.NF4] == [t & 0xFFFFFFFF for t in table]
    bits = [t & 0xFFFFFFFF for t in table]
    for byte in range(256):
        other = (byte * 37 + 11) & 0xFF
        for position in range(4):
            word = sum((byte if i == position else (other + i) & 0xFF) << (8 * i) for i in range(4))
            parts = [(word >> (8 * i)) & 0xFF for i in range(4)]
            assert nf4_decode_asm.emulate(word) == [bits[p >> 4] for p in parts] + [bits[p & 15] for p in parts]
    text = nf4_decode_asm.asm()
    assert text.count("prmt.b32") == 2 + 2 * (4 * 2 + 8) and "$8" in text and all(f"${i}," in text for i in range(8))
