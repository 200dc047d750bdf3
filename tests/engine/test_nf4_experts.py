"""engine/fast/nf4_experts.py: grouped products that decode NF4 experts inside them, and moe.py's use
of them where each expert gets few rows.

On the CPU the kernels run in Triton's interpreter, which decodes the code by a tree of selects; the
GPU's decoding is PTX byte permutes (engine/fast/nf4_decode.py), checked here by running its
instruction list on integers by the PTX ISA's definitions. On a GPU the same tests run compiled.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

from studio.engine.fast import moe, nf4_decode, nf4_experts  # noqa: E402
from studio.engine.fast.frozen import Workspace, dequantize_packed  # noqa: E402
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


def _emulate(x: int) -> list[int]:
    regs = {"x": x}

    def val(s):
        return regs[s] if isinstance(s, str) else s

    ops = {"mov": lambda a: a, "and": lambda a, b: a & b, "shr": lambda a, b: a >> b,
           "shl": lambda a, b: (a << b) & 0xFFFFFFFF, "prmt": _prmt}
    for op, dst, *src in nf4_decode.program():
        if op == "lop3":
            regs[dst] = _lop3(val(src[0]), val(src[1]), val(src[2]), src[3])
        else:
            regs[dst] = ops[op](*(val(s) for s in src))
    return [regs[f"out{i}"] for i in range(8)]


def test_the_byte_permutes_decode_every_byte_to_bitsandbytes_nf4_values() -> None:
    """Every byte value in each of the four places of the input word: the high nibbles' fp32 code
    values come out in outputs 0-3, the low nibbles' in 4-7, bit for bit bitsandbytes' table; the
    PTX names every output and the input."""
    import bitsandbytes.functional as bnbf

    bits = [int(v) & 0xFFFFFFFF for v in bnbf.get_4bit_type("nf4", device="cpu").float().view(torch.int32)]
    assert [nf4_decode._bits(v) for v in nf4_decode.NF4] == bits
    for byte in range(256):
        other = (byte * 37 + 11) & 0xFF
        for place in range(4):
            word = sum((byte if i == place else (other + i) & 0xFF) << (8 * i) for i in range(4))
            parts = [(word >> (8 * i)) & 0xFF for i in range(4)]
            assert _emulate(word) == [bits[p >> 4] for p in parts] + [bits[p & 15] for p in parts]
    text = nf4_decode.asm()
    assert "$8" in text and all(f"${i}," in text for i in range(8))
    assert text.count("prmt.b32") == sum(1 for op in nf4_decode.program() if op[0] == "prmt")


@pytest.mark.parametrize("nested", [False, True])
def test_the_products_multiply_dequant_py_s_weights_to_the_bit(kernel_device, nested) -> None:
    """One-hot rows pick single weights out: each product's output is the dequantized weight, every
    expert's (its rows in tiles of their own)."""
    experts, a, b = 2, 64, 128
    w = (torch.randn(experts, a, b, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    packed, state = _quantize(w.to(kernel_device), "nf4", nested)
    dense = torch.empty(experts, a, b, dtype=torch.bfloat16, device=kernel_device)
    dequantize_packed(packed, state, dense, None)
    assert nf4_experts.supports(state, (experts, a, b))
    prod = nf4_experts.Nf4Products(packed, state, (experts, a, b), kernel_device)
    offs = torch.tensor([b, 2 * b], dtype=torch.int32, device=kernel_device)
    y = prod.reduce_b(torch.eye(b, device=kernel_device).repeat(experts, 1).to(torch.bfloat16), offs, prod.window())
    assert torch.equal(y.view(experts, b, a), dense.transpose(1, 2))
    offs = torch.tensor([a, 2 * a], dtype=torch.int32, device=kernel_device)
    y = prod.reduce_a(torch.eye(a, device=kernel_device).repeat(experts, 1).to(torch.bfloat16), offs, prod.window())
    assert torch.equal(y.view(experts, a, b), dense)


def _weights(device, transposed: bool, parts: int, experts=3, out=256, inner=128):
    """A projection's NF4 experts as moe.py reads them (``[experts, out, in]``, or gpt-oss'
    ``[experts, in, out]``), with its workspace allocated."""
    shape = (experts, inner, out) if transposed else (experts, out, inner)
    param = torch.nn.Parameter((torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05)
                               .to(torch.bfloat16).to(device), requires_grad=False)
    packed, state = _quantize(param, "nf4", True)
    stored = PackedExperts(param, packed, state)
    space = Workspace()
    weights = moe.ExpertWeights(param, torch.bfloat16, stored, space, kernel=True, transposed=transposed, parts=parts)
    space.allocate(torch.bfloat16, torch.device(device))
    return weights


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("parts", [1, 2])
def test_an_expert_product_reads_the_stored_weights_as_it_dequantizes_them(kernel_device, transposed, parts,
                                                                         monkeypatch) -> None:
    """ExpertProduct over NF4 experts with each expert's LoRA: the output and the gradients of the
    rows, A and B read the stored weights (few rows an expert: the whole output at once) as they do
    dequantized, within bf16 rounding; one expert has no rows, another a partial tile."""
    weights = _weights(kernel_device, transposed, parts)
    assert weights.nf4 is not None and weights.parts == parts
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
        monkeypatch.setattr(nf4_experts, "MOST_ROWS", most)
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
    real = nf4_experts.Nf4Products._launch

    def counted(self, name, *args):
        calls.append(name)
        return real(self, name, *args)

    monkeypatch.setattr(nf4_experts.Nf4Products, "_launch", counted)
    y, dx = weights.product(x, groups), weights.product(dy, groups, backward=True)
    assert calls == ["reduce_a", "reduce_b"] and y.shape == dy.shape and dx.shape == x.shape

    def fails(run):
        return False, None

    monkeypatch.setattr(nf4_experts.KERNELS, "attempt", fails)
    y2, dx2 = weights.product(x, groups), weights.product(dy, groups, backward=True)
    assert calls == ["reduce_a", "reduce_b"]
    assert float((y2.float() - y.float()).norm() / y.float().norm()) < 0.01
    assert float((dx2.float() - dx.float()).norm() / dx.float().norm()) < 0.01


def test_only_layers_of_few_rows_an_expert_and_nf4_read_as_stored(monkeypatch) -> None:
    """The rule: 64 rows an expert or fewer on average; the per-expert loop (the tests' reference)
    and FP4 experts always dequantize."""
    assert nf4_experts.worth_it(64 * 128, 128) and not nf4_experts.worth_it(64 * 128 + 1, 128)
    param = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    _, fp4 = _quantize(param, "fp4", True)
    _, nf4 = _quantize(param, "nf4", False)
    assert not nf4_experts.supports(fp4, (2, 64, 128)) and nf4_experts.supports(nf4, (2, 64, 128))
    assert not nf4_experts.supports(nf4, (2, 128, 96))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weights = _weights("cpu", False, 1)
    offs = torch.tensor([10, 20, 30], dtype=torch.int32)
    assert weights.reads_stored(30, moe.Groups(offs)) and not weights.reads_stored(30, moe.Groups(offs, loop=True))
