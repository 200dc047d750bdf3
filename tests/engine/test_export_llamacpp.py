"""llama.cpp itself (through llama-cpp-python) on the GGUF files `studio export --format gguf` writes:
the tiny mixtures of experts (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) and every dense family the exporter
writes (Llama the control), each with a random LoRA merged in. The other export tests read the files
back with transformers' GGUF loader or with our own reader (tests/helpers/gguf_reading.py), which could
share a misconception with the writer; here llama.cpp loads the file, checks it as it checks any file,
and computes the logits.

- f32 file, f32 KV cache: llama.cpp's logits are the float32 merged model's to float32 rounding
  (every key, tensor name, layout and llama.cpp's fixed choices right). gpt-oss is compared with the
  merge whose YaRN correction range is rounded as llama.cpp rounds it; where its experts are MXFP4
  as shipped, llama.cpp multiplies them by inputs rounded to 8 bits, so the merge does that too;
- the LoRA GGUF, applied by llama.cpp over the base's f32 GGUF, gives the merged model's logits;
- f16, q8_0 (and gpt-oss' mxfp4) files, llama.cpp's default f16 KV cache: its next-token choices
  agree with the merged model's at the floors the other export tests hold;
- the file's vocabulary, tokenized by llama.cpp, encodes text as the model's own tokenizer does.

Skipped where llama-cpp-python is not installed (CI does not install it: it builds llama.cpp from
source). docs/export.md ("Verified by a real GGUF reader") says how to build it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (it builds llama.cpp "
                                "from source; docs/export.md, 'Verified by a real GGUF reader', says how)")

from helpers.tiny_families import MOE_TYPES  # noqa: E402
from test_export_families import FLOORS, TEXTS, WRITTEN, _run_with_adapter  # noqa: E402
from test_export_gpt_oss import FLOORS as GPT_OSS_FLOORS  # noqa: E402
from test_export_gpt_oss import _llama_cpp_rounding  # noqa: E402
from test_export_gpt_oss import _run as _gpt_oss_run  # noqa: E402

from studio.engine.exporting import export_run  # noqa: E402
from studio.engine.gguf_export import write_gguf  # noqa: E402

ROWS, LENGTH = 16, 64
"""1024 positions a model, in rows longer than gpt-oss' sliding window (8). On 512 a near-tie or two
decides the f16 floor (Qwen3-MoE: 98.8% there for our reader of the same file too)."""
F32_TOLERANCE = 1e-3
"""Largest difference allowed between llama.cpp's logits of an f32 file (f32 KV cache) and the merged
model's: float32 arithmetic in another order (the tiny models' logits are of order 1)."""
GELU_TOLERANCE = 1e-2
"""The same for Gemma: llama.cpp's CPU GELU looks its value up in a table of f16 inputs and outputs
(GGML_GELU_FP16 in ggml-cpu), about 1e-3 on these logits."""
MXFP4_FLOOR = 0.70
"""gpt-oss' experts merged with their LoRA and quantized again to MXFP4 (`--quant mxfp4`): 4 bits
lose more than q8_0 (our reader, computing the same file in float32: 78%)."""


def _logits(path: Path, ids: torch.Tensor, cache: str = "f16", lora: Path | None = None) -> torch.Tensor:
    """llama.cpp's logits [rows, positions, vocab] for each row of ``ids`` decoded from an empty KV
    cache held in ``cache`` (f16: llama.cpp's default; f32), with the LoRA GGUF ``lora`` applied."""
    options = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if cache == "f32" else {}
    if lora is not None:
        options["lora_path"] = str(lora)
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=ids.shape[1], logits_all=True, n_threads=1,
                            verbose=False, **options)
    rows = []
    try:
        for row in ids.tolist():
            model.reset()
            model.eval(row)
            rows.append(torch.from_numpy(model.scores[:len(row)].copy()))
    finally:
        model.close()
    return torch.stack(rows)


def _agreement(label: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"llama.cpp {label}: {agree:.1%} of {expected.shape[0] * expected.shape[1]} next-token predictions agree")
    return agree


def _close_in_f32(label: str, got: torch.Tensor, expected: torch.Tensor, tolerance: float = F32_TOLERANCE) -> None:
    worst = (got - expected).abs().max().item()
    print(f"llama.cpp {label}: largest logit difference {worst:.1e} (logits up to {expected.abs().max().item():.1f})")
    assert worst < tolerance, f"{label}: llama.cpp's logits differ from the merged model's by {worst:.1e}"


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(4, vocab_size, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", WRITTEN)
def test_llama_cpp_computes_the_merged_model(name: str, tmp_path: Path) -> None:
    """LoRA on every projection (a mixture of experts': its attention and its experts), merged and
    exported through `studio export`'s own path; llama.cpp runs each file, and a dense family's LoRA
    GGUF over the base's f32 GGUF (an adapter on a mixture's experts has none)."""
    from transformers import AutoTokenizer

    tolerance = GELU_TOLERANCE if name.startswith("gemma") else F32_TOLERANCE
    run, base, merged = _run_with_adapter(name, tmp_path)
    ids = _ids(merged.config.vocab_size)
    with torch.no_grad():
        expected = merged(ids).logits
    for quant in ("f32", *FLOORS):
        result = export_run(run, tmp_path / quant, "gguf", quant=quant)
        assert result.ok, result.message
        file = tmp_path / quant / f"model-{quant}.gguf"
        if quant == "f32":
            _close_in_f32(f"{name} f32", _logits(file, ids, cache="f32"), expected, tolerance)
        else:
            agree = _agreement(f"{name} {quant}", _logits(file, ids), expected)
            assert agree >= FLOORS[quant], f"{name} {quant}: {agree:.1%} < {FLOORS[quant]:.0%}"
    adapter = tmp_path / "f32" / "adapter-lora-f32.gguf"
    assert adapter.exists() == (name not in MOE_TYPES)
    if adapter.exists():
        write_gguf(base, tmp_path / "base.gguf", "f32")
        lora = _logits(tmp_path / "base.gguf", ids, cache="f32", lora=adapter)
        _close_in_f32(f"{name} base f32 + LoRA GGUF", lora, expected, tolerance)
    # llama.cpp's own tokenizer, built from the file's vocabulary, merges and pre-tokenizer name
    vocab = llama_cpp.Llama(model_path=str(tmp_path / "f16" / "model-f16.gguf"), vocab_only=True, n_ctx=256,
                            verbose=False)
    own = AutoTokenizer.from_pretrained(base)
    try:
        assert [vocab.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS] == \
            [own.encode(t, add_special_tokens=False) for t in TEXTS]
    finally:
        vocab.close()


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as ggml's CPU backend rounds a matrix product's input for MXFP4 (and q8_0)
    weights (quantize_row_q8_0): blocks of 32 along the last axis, codes round(x * 127 / max |x|),
    scale max |x| / 127 stored in f16."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(blocks * torch.where(top > 0, 127 / top, torch.zeros_like(top)))
    return (codes * (top / 127).half().float()).reshape(x.shape)


def _with_8_bit_expert_inputs(model: Any) -> Any:
    """``model`` (a transformers gpt-oss) with its experts' two products taking their inputs rounded
    by :func:`_q8_0`, as llama.cpp computes MXFP4 experts (the layer's input, and the gated
    activation the down projection takes)."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.register_forward_pre_hook(lambda _m, args: (_q8_0(args[0]), *args[1:]))
        gate = experts._apply_gate
        experts._apply_gate = lambda gate_up, gate=gate: _q8_0(gate(gate_up))
    return model


def test_llama_cpp_computes_gpt_oss_with_its_experts_as_shipped(tmp_path: Path) -> None:
    """LoRA on the attention: every file keeps the checkpoint's MXFP4 experts. The f32 file, and the
    base's f32 GGUF with the LoRA GGUF applied, predict as the merge computed as llama.cpp computes
    MXFP4 experts (inputs rounded to 8 bits): llama.cpp's own decoding of the blocks is transformers'.
    Against the plain merge every file is held to q8_0's floor: whatever --quant, the experts'
    products take 8-bit inputs."""
    run, base, merged = _gpt_oss_run(tmp_path, experts=False)
    ids = _ids(merged.config.vocab_size)
    with torch.no_grad():
        plain = _llama_cpp_rounding(merged)(ids).logits
        eight_bit = _with_8_bit_expert_inputs(_llama_cpp_rounding(merged))(ids).logits
    for quant in ("f32", *GPT_OSS_FLOORS):
        assert export_run(run, tmp_path / quant, "gguf", quant=quant).ok
        file = tmp_path / quant / f"model-{quant}.gguf"
        label = f"gpt-oss (attention LoRA, MXFP4 experts) {quant}"
        got = _logits(file, ids, cache="f32" if quant == "f32" else "f16")
        if quant == "f32":
            agree = _agreement(f"{label} against 8-bit expert inputs", got, eight_bit)
            assert agree >= GPT_OSS_FLOORS["f16"], f"{label}: {agree:.1%} against 8-bit expert inputs"
        agree = _agreement(f"{label} against the plain merge", got, plain)
        assert agree >= GPT_OSS_FLOORS["q8_0"], f"{label}: {agree:.1%}"
    write_gguf(base, tmp_path / "base.gguf", "f32")
    lora = _logits(tmp_path / "base.gguf", ids, cache="f32", lora=tmp_path / "f32" / "adapter-lora-f32.gguf")
    agree = _agreement("gpt-oss base f32 + LoRA GGUF against 8-bit expert inputs", lora, eight_bit)
    assert agree >= GPT_OSS_FLOORS["f16"]


def test_llama_cpp_computes_gpt_oss_with_merged_experts(tmp_path: Path) -> None:
    """LoRA on the attention and the experts: the experts are written in the quant (f32 or f16), or
    quantized again with --quant mxfp4."""
    run, _, merged = _gpt_oss_run(tmp_path, experts=True)
    ids = _ids(merged.config.vocab_size)
    with torch.no_grad():
        expected = _llama_cpp_rounding(merged)(ids).logits
    for quant, floor in (("f32", None), *GPT_OSS_FLOORS.items(), ("mxfp4", MXFP4_FLOOR)):
        assert export_run(run, tmp_path / quant, "gguf", quant=quant).ok
        file = tmp_path / quant / f"model-{quant}.gguf"
        label = f"gpt-oss (attention + experts LoRA) {quant}"
        if floor is None:
            _close_in_f32(label, _logits(file, ids, cache="f32"), expected)
        else:
            agree = _agreement(label, _logits(file, ids), expected)
            assert agree >= floor, f"{label}: {agree:.1%} < {floor:.0%}"
