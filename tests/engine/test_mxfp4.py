"""gpt-oss' MXFP4 experts kept as the checkpoint ships them (studio/engine/mxfp4.py), on the CPU:
the dequantization is transformers' own (integrations/mxfp4.py) on the same blocks and scales; a
4-bit load of a tiny gpt-oss checkpoint that ships its experts in MXFP4 keeps them so as they load
(4.25 bits a weight, the parameters holding nothing, no expert weight ever dequantized during the
load; a failure fails the 4-bit load), transformers' forward on the weights lent to it answers
as the same model with transformers' dequantized experts, and the fast path's loss and LoRA
gradients (the experts' adapters included) equal transformers' on those weights."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from helpers.gpt_oss import mxfp4_folder, random_mxfp4
from test_fast_families import _check_family
from test_fast_moe import EXPERTS

from studio.core.config import RunConfig
from studio.engine.mxfp4 import FP4_VALUES, Mxfp4Experts, dequantize_mxfp4, mxfp4_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dequantization_is_transformers_own(dtype: torch.dtype, monkeypatch) -> None:
    """Every code and a spread of scales, dequantized in chunks that cut rows and experts apart, into
    a new tensor and into a transposed view (the parameter's layout): transformers' values, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr("studio.engine.mxfp4.CHUNK_VALUES", 3 * 96)  # 3 rows of 96: chunks across experts
    blocks, scales = random_mxfp4((4, 40, 96), seed=0)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [experts, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (4, 40, 96) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), theirs)
    into = torch.empty(4, 96, 40, dtype=dtype)
    dequantize_mxfp4(blocks, scales, dtype, into.transpose(1, 2))
    assert torch.equal(into, theirs)
    stored = Mxfp4Experts(torch.nn.Parameter(torch.empty(4, 96, 40)), blocks, scales)
    assert stored.shape == (4, 40, 96) and stored.nbytes() * 32 == 4 * 40 * 96 * 17  # 4.25 bits a weight
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., :-1], dtype)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="the torch way on a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_under_every_scale_byte_is_the_ocp_value(dtype: torch.dtype, device: str) -> None:
    """Each code's FP4 number times 2^(s - 127) under each scale byte ``s`` (OCP MX), computed exactly
    and rounded once to the dtype: 2^-127 exact (CUDA's exp2 is one subnormal step off there), fp16's
    values rounded from the exact product (a scale rounded to fp16 first turns 0.5 x 2^16 into
    infinity and 1.5 x 2^-25 into 0), and every value of a block under 255 NaN."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    blocks = codes.view(1, 16, 16).expand(256, 16, 16).contiguous()  # row s: every byte, at scale byte s
    scales = codes.view(256, 1).expand(256, 16).contiguous()
    exact = torch.tensor([[v * 2.0 ** (s - 127) if s != 255 else math.nan for v in FP4_VALUES] for s in range(256)],
                         dtype=torch.float64)
    nibbles = torch.stack([torch.arange(256) & 15, torch.arange(256) >> 4], dim=1).flatten()  # lower first
    expected = exact[:, nibbles].to(dtype)
    ours = dequantize_mxfp4(blocks, scales, dtype, kernel=False).cpu()
    nan = expected.isnan()
    assert torch.equal(ours.isnan(), nan) and nan[255].all() and nan.sum() == 512
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    differ = (ours.view(bits) != expected.view(bits)) & ~nan
    assert not differ.any(), f"{differ.sum().item()} values differ, scale bytes {differ.any(1).nonzero().flatten()}"


def _load(folder: Path):
    from studio.engine.model import load_base

    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits, config.quantization.on_cpu = 4, "keep"
    return load_base(config, device=torch.device("cpu"))


def _transformers_dequantized(folder: Path):
    """transformers' own load of the folder: on a machine without the Hub's MXFP4 kernels it
    dequantizes the experts itself (integrations/mxfp4.py)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_a_4bit_load_keeps_the_shipped_mxfp4_experts(tmp_path: Path) -> None:
    """quantization.bits 4: the attention is NF4 (bitsandbytes), every experts module keeps the
    checkpoint's blocks and scales (the VRAM pane's experts category at 4.25 bits a weight) and its
    parameters hold nothing; the experts are transformers' dequantization of them, and the plain
    forward on the weights lent to it answers as the same load given transformers' dequantized experts."""
    pytest.importorskip("bitsandbytes")
    from studio.engine.memory import parameter_bytes

    folder = mxfp4_folder(tmp_path / "gpt-oss")
    base = _load(folder)
    assert base.quantization == "nf4", base.warnings
    assert type(base.model.model.layers[0].self_attn.q_proj.weight).__name__ == "Params4bit"
    experts = [m for m in base.model.modules() if mxfp4_experts(m)]
    assert len(experts) == 2 and all(set(mxfp4_experts(m)) == set(("gate_up_proj", "down_proj")) for m in experts)

    def freed() -> bool:
        return all(getattr(m, n).untyped_storage().nbytes() <= getattr(m, n).element_size()
                   for m in experts for n in mxfp4_experts(m))

    assert freed()
    shipped = sum(s.nbytes() for m in experts for s in mxfp4_experts(m).values())
    weights = sum(getattr(m, n).numel() for m in experts for n in mxfp4_experts(m))
    assert shipped * 32 == weights * 17
    assert shipped <= parameter_bytes(base.model)["experts"] <= shipped + 4 * 4  # the placeholders' one value

    reference = _transformers_dequantized(folder)
    for module, theirs in zip(experts, (layer.mlp.experts for layer in reference.model.layers), strict=True):
        for name, stored in mxfp4_experts(module).items():
            assert torch.equal(stored.dequantize(torch.float32).transpose(1, 2), getattr(theirs, name).data), name

    # the same 4-bit load with transformers' dequantized experts as plain parameters, its MXFP4
    # holders forgotten: nothing is lent to its forward
    plain = _load(folder).model
    for layer, theirs in zip(plain.model.layers, reference.model.layers, strict=True):
        mxfp4_experts(layer.mlp.experts).clear()
        for name in ("gate_up_proj", "down_proj"):
            # in the load's own device and dtype (bf16 on a GPU): MXFP4 values are exact in bf16
            mine = getattr(layer.mlp.experts, name)
            mine.data = getattr(theirs.mlp.experts, name).data.to(mine.device, mine.dtype)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(base.model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert freed()


def test_the_load_never_holds_expert_weights_dequantized(tmp_path: Path, monkeypatch) -> None:
    """Four sparse layers of eight experts. Counting, each time a projection keeps its MXFP4, the
    expert weights alive in floating point on the device: the load keeps every projection as the
    checkpoint's tensors arrive and never holds one dequantized, where keeping them after a load
    that initialized them held all four layers' at once (the instrument sees it), with a warning."""
    pytest.importorskip("bitsandbytes")
    import gc
    import json

    from bench.moe_load_peak import ExpertBytesProbe, expert_bytes

    folder = mxfp4_folder(tmp_path / "gpt-oss", num_hidden_layers=4, num_local_experts=8, intermediate_size=96)
    shape = json.loads((folder / "config.json").read_text())
    gc.collect()
    probe = ExpertBytesProbe(shape, torch.device("cpu"))
    with probe.watching():
        base = _load(folder)
    assert base.quantization == "nf4" and base.warnings == []
    assert len(probe.samples) == 8  # two projections in each of four layers, each kept once
    assert probe.peak == 0
    kept = [m for m in base.model.modules() if mxfp4_experts(m)]
    assert len(kept) == 4 and all(set(mxfp4_experts(m)) == {"gate_up_proj", "down_proj"} for m in kept)
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = base.model(input_ids=ids).logits
    del base, kept
    gc.collect()

    with monkeypatch.context() as patch:
        # the loader without keeping on load: transformers initializes the experts it finds no
        # tensor for, and the shipped ones replace them once loaded
        from studio.engine.quantized_experts import ExpertsLoad

        patch.setattr("studio.engine.quantized_experts.experts_packed_on_load", lambda: nullcontext(ExpertsLoad()))
        after = ExpertBytesProbe(shape, torch.device("cpu"))
        with after.watching():
            late = _load(folder)
    assert len(after.samples) == 8
    assert after.peak >= expert_bytes(shape, 4, 4)  # every layer's, in fp32 on the CPU
    assert len(late.warnings) == 1 and "4 experts modules took their MXFP4 weights after the load" in late.warnings[0]
    with torch.no_grad():
        assert torch.equal(late.model(input_ids=ids).logits, logits)


def test_keeping_the_mxfp4_that_fails_fails_the_4bit_load_instead_of_leaving_random_experts(
        tmp_path: Path, monkeypatch) -> None:
    """transformers logs a failed conversion and initializes that weight at random; the loader
    refuses such a model: on the CPU the base loads in fp32 (transformers' dequantization of the
    checkpoint) with a warning naming the projection and the error."""
    pytest.importorskip("bitsandbytes")
    from studio.engine import mxfp4

    folder = mxfp4_folder(tmp_path / "gpt-oss")
    keeping, calls = mxfp4._keep, []

    def failing(module, name, *args):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("out of memory (injected)")
        return keeping(module, name, *args)

    monkeypatch.setattr(mxfp4, "_keep", failing)
    base = _load(folder)
    assert base.quantization == "float32" and not any(mxfp4_experts(m) for m in base.model.modules())
    assert any("failed (model.layers.1.mlp.experts." in w and "out of memory (injected)" in w
               for w in base.warnings), base.warnings
    reference = _transformers_dequantized(folder)
    for layer, theirs in zip(base.model.model.layers, reference.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp.experts, name), getattr(theirs.mlp.experts, name))


def test_a_load_in_the_compute_dtype_dequantizes_the_shipped_experts(tmp_path: Path) -> None:
    """quantization.bits null: the experts in the compute dtype, transformers' dequantization of them."""
    from studio.engine.model import load_base

    folder = mxfp4_folder(tmp_path / "gpt-oss")
    config = RunConfig()
    config.model.base_model = str(folder)
    config.quantization.bits = None
    model = load_base(config, device=torch.device("cpu")).model
    reference = _transformers_dequantized(folder)
    assert not any(mxfp4_experts(m) for m in model.modules())
    for layer, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(layer.mlp.experts, name), getattr(theirs.mlp.experts, name))


def _exact_4bit_products(monkeypatch) -> None:
    """bitsandbytes' CPU product dequantizes a 4-bit weight to the dtype its checkpoint had (bf16
    here) although the model computes in fp32; the reference's products dequantize to the input's
    dtype instead, as the fast path does (tests/engine/test_fast_path.py does the same)."""
    import copy

    import bitsandbytes
    import bitsandbytes.functional as bnbf

    def exact(a, b, out=None, quant_state=None, bias=None):
        state = copy.copy(quant_state)
        state.dtype = a.dtype
        y = a @ bnbf.dequantize_4bit(b, state).t()
        return y if bias is None else y + bias.to(a.dtype)

    monkeypatch.setattr(bitsandbytes, "matmul_4bit", exact)


@pytest.mark.parametrize("on_experts", [True, False])
def test_the_fast_path_over_mxfp4_experts_is_transformers_on_the_same_weights(on_experts: bool, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """LoRA on the attention and (lora.target_experts) on the MXFP4 experts: the fast path's loss and
    every LoRA gradient equal transformers' forward through the hook, padded and packed."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    _exact_4bit_products(monkeypatch)
    model = _load(mxfp4_folder(tmp_path / "gpt-oss")).model
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             target_parameters=EXPERTS if on_experts else None))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    _check_family(model, monkeypatch, padded_reference=True)
    from studio.engine import fast

    fast_model, _ = fast.prepare(model)
    assert all(isinstance(layer.gate_up.weights.packed, Mxfp4Experts) for layer in fast_model.layers)
    # gate/up read in two halves of its rows (engine/fast/moe.py's PARTS): what _check_family checked
    assert {(layer.gate_up.weights.parts, layer.down.weights.parts) for layer in fast_model.layers} == {(2, 1)}
