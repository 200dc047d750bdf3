"""engine/fast/stored_experts.py: grouped products that decode 4-bit experts (NF4, gpt-oss' MXFP4)
inside them, and moe.py's use of them where each expert gets few rows.

On the CPU the kernels run in Triton's interpreter, which decodes the code by a tree of selects; the
GPU's decoding is PTX byte permutes (engine/fast/fourbit_decode.py), checked here by running its
instruction list on integers by the PTX ISA's definitions. On a GPU the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from helpers.gpt_oss import random_mxfp4  # noqa: E402

from studio.engine.fast import fourbit_decode, moe, stored_experts  # noqa: E402
from studio.engine.fast.frozen import Workspace, dequantize_packed  # noqa: E402
from studio.engine.mxfp4 import FP4_VALUES, Mxfp4Experts, dequantize_mxfp4  # noqa: E402
from studio.engine.quantized_experts import PackedExperts, _quantize  # noqa: E402


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` in its default mode: each output byte is the byte of ``{b, a}`` the
    selector's nibble names (bits 0-2), or that byte's sign replicated (bit 3)."""
    data = a | (b << 32)
    out = 0
    for i in range(4):
        field = (c >> (4 * i)) & 0xF
        byte = (data >> (8 * (field & 7))) & 0xFF
        if field & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, table: int) -> int:
    """PTX ``lop3.b32``: each bit is ``table``'s bit at index ``a << 2 | b << 1 | c``."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((table >> index) & 1) << bit
    return out


def _emulate(x: int, code) -> list[int]:
    regs = {"x": x}

    def val(s):
        return regs[s] if isinstance(s, str) else s

    ops = {"mov": lambda a: a, "and": lambda a, b: a & b, "shr": lambda a, b: a >> b,
           "shl": lambda a, b: (a << b) & 0xFFFFFFFF, "prmt": _prmt}
    for op, dst, *src in fourbit_decode.program(code):
        if op == "lop3":
            regs[dst] = _lop3(val(src[0]), val(src[1]), val(src[2]), src[3])
        else:
            regs[dst] = ops[op](*(val(s) for s in src))
    return [regs[f"out{i}"] for i in range(8)]


@pytest.mark.parametrize("name", ["nf4", "fp4"])
def test_the_byte_permutes_decode_every_byte_to_the_code_s_values(name: str) -> None:
    """Every byte value in each of the four places of the input word: the high nibbles' fp32 code
    values come out in outputs 0-3, the low nibbles' in 4-7, bit for bit the table's (bitsandbytes'
    NF4; MXFP4's FP4, engine/mxfp4.py's); the PTX names every output and the input."""
    import bitsandbytes.functional as bnbf

    code = fourbit_decode.NF4 if name == "nf4" else fourbit_decode.FP4
    if name == "nf4":
        table = bnbf.get_4bit_type("nf4", device="cpu").float()
    else:
        table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    bits = [int(v) & 0xFFFFFFFF for v in table.view(torch.int32)]
    assert [fourbit_decode._bits(v) for v in code] == bits
    for byte in range(256):
        other = (byte * 37 + 11) & 0xFF
        for place in range(4):
            word = sum((byte if i == place else (other + i) & 0xFF) << (8 * i) for i in range(4))
            parts = [(word >> (8 * i)) & 0xFF for i in range(4)]
            assert _emulate(word, code) == [bits[p >> 4] for p in parts] + [bits[p & 15] for p in parts]
    text = fourbit_decode.asm(code)
    assert "$8" in text and all(f"${i}," in text for i in range(8))
    assert text.count("prmt.b32") == sum(1 for op in fourbit_decode.program(code) if op[0] == "prmt")


@pytest.mark.parametrize("nested", [False, True])
def test_the_products_multiply_dequant_py_s_weights_to_the_bit(kernel_device, nested) -> None:
    """One-hot rows pick single weights out: each product's output is the dequantized weight, every
    expert's (its rows in tiles of their own)."""
    experts, a, b = 2, 64, 128
    w = (torch.randn(experts, a, b, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    packed, state = _quantize(w.to(kernel_device), "nf4", nested)
    dense = torch.empty(experts, a, b, dtype=torch.bfloat16, device=kernel_device)
    dequantize_packed(packed, state, dense, None)
    assert stored_experts.supports(state, (experts, a, b))
    prod = stored_experts.StoredProducts.nf4(packed, state, (experts, a, b), kernel_device)
    offs = torch.tensor([b, 2 * b], dtype=torch.int32, device=kernel_device)
    y = prod.reduce_b(torch.eye(b, device=kernel_device).repeat(experts, 1).to(torch.bfloat16), offs, prod.window())
    assert torch.equal(y.view(experts, b, a), dense.transpose(1, 2))
    offs = torch.tensor([a, 2 * a], dtype=torch.int32, device=kernel_device)
    y = prod.reduce_a(torch.eye(a, device=kernel_device).repeat(experts, 1).to(torch.bfloat16), offs, prod.window())
    assert torch.equal(y.view(experts, a, b), dense)


def test_the_mxfp4_products_multiply_mxfp4_dequant_s_weights_to_the_bit(kernel_device) -> None:
    """gpt-oss' MXFP4 experts as shipped (every code, scales around 2^-4): one-hot rows give back
    mxfp4.py's dequantized weights, in bf16 and fp16. A block whose scale byte is 0 (2^-127: its
    weights are subnormal) comes out within 1e-37 of them (the interpreter's cast, like a tensor
    core, may flush a subnormal to 0)."""
    experts, out, inner = 2, 64, 96
    blocks, scales = random_mxfp4((experts, out, inner), seed=3)
    blocks, scales = blocks.to(kernel_device), scales.to(kernel_device)
    prod = stored_experts.StoredProducts.mxfp4(blocks, scales, kernel_device)
    for dtype in (torch.bfloat16, torch.float16):
        dense = dequantize_mxfp4(blocks, scales, dtype, kernel=False)  # [experts, out, in]
        offs = torch.tensor([inner, 2 * inner], dtype=torch.int32, device=kernel_device)
        y = prod.reduce_b(torch.eye(inner, device=kernel_device).repeat(experts, 1).to(dtype), offs, prod.window())
        assert torch.equal(y.view(experts, inner, out), dense.transpose(1, 2)), dtype
        offs = torch.tensor([out, 2 * out], dtype=torch.int32, device=kernel_device)
        y = prod.reduce_a(torch.eye(out, device=kernel_device).repeat(experts, 1).to(dtype), offs, prod.window())
        assert torch.equal(y.view(experts, out, inner), dense), dtype
    tiny = scales.clone()
    tiny[0, 5, 1] = 0
    prod = stored_experts.StoredProducts.mxfp4(blocks, tiny, kernel_device)
    dense = dequantize_mxfp4(blocks, tiny, torch.bfloat16, kernel=False)
    offs = torch.tensor([out, 2 * out], dtype=torch.int32, device=kernel_device)
    y = prod.reduce_a(torch.eye(out, device=kernel_device).repeat(experts, 1).to(torch.bfloat16), offs, prod.window())
    difference = (y.view(experts, out, inner).float() - dense.float()).abs()
    assert difference.max() <= 1e-37 and torch.equal(difference[1], torch.zeros_like(difference[1]))


def _weights(device, transposed: bool, parts: int, experts=3, out=256, inner=128, mxfp4: bool = False):
    """A projection's 4-bit experts as moe.py reads them (NF4 ``[experts, out, in]``, or gpt-oss'
    ``[experts, in, out]``; MXFP4 as shipped), with its workspace allocated."""
    shape = (experts, inner, out) if transposed else (experts, out, inner)
    param = torch.nn.Parameter((torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05)
                               .to(torch.bfloat16).to(device), requires_grad=False)
    if mxfp4:
        blocks, scales = random_mxfp4((experts, out, inner), seed=4)
        stored = Mxfp4Experts(param, blocks.to(device), scales.to(device))
    else:
        packed, state = _quantize(param, "nf4", True)
        stored = PackedExperts(param, packed, state)
    space = Workspace()
    weights = moe.ExpertWeights(param, torch.bfloat16, stored, space, kernel=True, transposed=transposed, parts=parts)
    space.allocate(torch.bfloat16, torch.device(device))
    return weights


@pytest.mark.parametrize(("transposed", "mxfp4"), [(False, False), (True, False), (True, True)],
                         ids=["nf4_out_in", "nf4_in_out", "mxfp4"])
@pytest.mark.parametrize("parts", [1, 2])
def test_an_expert_product_reads_the_stored_weights_as_it_dequantizes_them(kernel_device, transposed, mxfp4, parts,
                                                                         monkeypatch) -> None:
    """ExpertProduct over 4-bit experts with each expert's LoRA: the output and the gradients of
    the rows, A and B read the stored weights (few rows an expert: the whole output at once) as
    they do dequantized, within bf16 rounding; one expert has no rows, another a partial tile."""
    weights = _weights(kernel_device, transposed, parts, mxfp4=mxfp4)
    assert weights.stored is not None and weights.parts == parts and weights.stored.mx == mxfp4
    counts = [37, 0, 70]
    groups = moe.Groups(torch.tensor(counts, device=kernel_device).cumsum(0).to(torch.int32))
    rows, r = sum(counts), 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, weights.in_features, generator=gen).to(torch.bfloat16).to(kernel_device)
    a = (torch.randn(3, r, weights.in_features, generator=gen) * 0.1).to(torch.bfloat16).to(kernel_device)
    b = (torch.randn(3, weights.out_features, r, generator=gen) * 0.1).to(torch.bfloat16).to(kernel_device)
    dy = torch.randn(rows, weights.out_features, generator=gen).to(torch.bfloat16).to(kernel_device)
    results = []
    for most in (64, 0):  # read as stored, then dequantized
        monkeypatch.setattr(stored_experts, "MOST_ROWS", most)
        assert weights.reads_stored(rows, groups) == bool(most)
        xg, ag, bg = (t.clone().requires_grad_() for t in (x, a, b))
        if parts > 1 and not most:
            n = weights.out_features // parts
            y = torch.cat([moe.ExpertProduct.apply(xg, weights, groups, ag, bg[:, p * n:(p + 1) * n], 0.5, True, p)
                           for p in range(parts)], dim=1)
        else:
            y = moe.ExpertProduct.apply(xg, weights, groups, ag, bg, 0.5)
        y.backward(dy)
        results.append([t.detach().float() for t in (y, xg.grad, ag.grad, bg.grad)])
    for got, want, what in zip(*results, ("y", "dx", "dA", "dB"), strict=True):
        error = float((got - want).norm() / want.norm())
        assert error < 0.01, f"{what}: {error:.4f}"


def test_gate_up_read_as_stored_is_one_product_and_falls_back_to_halves(kernel_device, monkeypatch) -> None:
    """With gate/up dequantized in halves, reading it as stored takes the whole output in one
    product; where the kernels fail mid-run the product dequantizes the halves after all, forward
    and backward, and gives the same values."""
    weights = _weights(kernel_device, True, 2)
    groups = moe.Groups(torch.tensor([20, 40, 60], device=kernel_device, dtype=torch.int32))
    x = torch.randn(60, weights.in_features).to(torch.bfloat16).to(kernel_device)
    dy = torch.randn(60, weights.out_features).to(torch.bfloat16).to(kernel_device)
    calls = []
    real = stored_experts.StoredProducts._launch

    def counted(self, name, *args):
        calls.append(name)
        return real(self, name, *args)

    monkeypatch.setattr(stored_experts.StoredProducts, "_launch", counted)
    y, dx = weights.product(x, groups), weights.product(dy, groups, backward=True)
    assert calls == ["reduce_a", "reduce_b"] and y.shape == dy.shape and dx.shape == x.shape

    def fails(run):
        return False, None

    monkeypatch.setattr(stored_experts.KERNELS, "attempt", fails)
    y2, dx2 = weights.product(x, groups), weights.product(dy, groups, backward=True)
    assert calls == ["reduce_a", "reduce_b"]
    assert float((y2.float() - y.float()).norm() / y.float().norm()) < 0.01
    assert float((dx2.float() - dx.float()).norm() / dx.float().norm()) < 0.01


def test_only_layers_of_few_rows_an_expert_read_as_stored(monkeypatch) -> None:
    """The rule: 64 rows an expert or fewer on average; the per-expert loop (the tests' reference)
    and bitsandbytes' FP4 experts always dequantize."""
    assert stored_experts.worth_it(64 * 128, 128) and not stored_experts.worth_it(64 * 128 + 1, 128)
    param = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    _, fp4 = _quantize(param, "fp4", True)
    _, nf4 = _quantize(param, "nf4", False)
    assert not stored_experts.supports(fp4, (2, 64, 128)) and stored_experts.supports(nf4, (2, 64, 128))
    assert not stored_experts.supports(nf4, (2, 128, 96))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weights = _weights("cpu", False, 1)
    offs = torch.tensor([10, 20, 30], dtype=torch.int32)
    assert weights.reads_stored(30, moe.Groups(offs)) and not weights.reads_stored(30, moe.Groups(offs, loop=True))
