"""GGUF export of gpt-oss (studio/engine/gguf_tensors.py, gguf_families.py) on a tiny random gpt-oss
that ships its experts in MXFP4 as OpenAI's checkpoints do (tests/helpers/gpt_oss.py), and on one
saved in bf16:

- the file says what llama.cpp's converter writes: architecture ``gpt-oss``, every key its loader
  reads, every tensor under llama.cpp's name with the shape its loader asks for and the type the
  converter gives it;
- MXFP4 experts are written as shipped: the file's bytes are the checkpoint's blocks repacked into
  GGML's layout (checked against a repacking written here from the format's definition), and
  gguf-py's decoding of them (llama.cpp's) is transformers' decoding of the checkpoint, bit for bit;
- a run's adapter on the attention leaves the experts so; an adapter on the experts writes them in
  ``--quant`` (f16), or with ``--quant mxfp4`` each weight the nearest MXFP4 value at llama.cpp's
  scale for its block;
- read back as llama.cpp runs gpt-oss (tests/helpers/gguf_reading.py), the file predicts the next
  tokens as the merged model does (YaRN's correction range rounded as llama.cpp rounds it, which
  transformers' gpt-oss does not: ``truncate: false``);
- a gpt-oss that llama.cpp would run as another model is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from helpers.gguf_reading import load_as_llama_cpp, metadata, values  # noqa: E402
from helpers.gpt_oss import GPT_OSS, gpt_oss_config, mxfp4_folder  # noqa: E402

from studio.core.config import RunConfig  # noqa: E402
from studio.core.paths import sample_data_dir  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402
from studio.engine.gguf_export import GgufExportError, check_architecture, write_gguf  # noqa: E402

FLOORS = {"f16": 0.99, "q8_0": 0.85}
"""Next-token agreement with the merged model, on 1024 positions. q8_0's is below the other families'
0.90: its rounding of the attention flips a token's top-2 experts more often in this tiny random
gpt-oss (measured 89.6-90.6% of 1024 to 2048 positions, f16 99.6-99.7%; the f32 file's logits are
the model's exactly)."""
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WIDTH, EXPERTS = 64, 4, 2, 32, 128, 4
"""The tiny gpt-oss' shape (tests/helpers: _SIZE and GPT_OSS)."""
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""E2M1: the value of each 4-bit code (OCP Microscaling formats, MXFP4)."""


def _tensors(path: Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _reference_repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGML's block_mxfp4 written out from its definition, one block at a time: the scale byte, then
    byte j = code of weight j | code of weight j + 16 << 4; the checkpoint holds weight 2j in the low
    nibble of byte j and weight 2j + 1 in its high one."""
    rows = blocks.reshape(-1, 16)
    out = np.empty((rows.shape[0], 17), dtype=np.uint8)
    for i, (block, scale) in enumerate(zip(rows, scales.reshape(-1), strict=True)):
        codes = [(int(block[k // 2]) >> (4 * (k % 2))) & 0xF for k in range(32)]
        out[i] = [scale] + [codes[j] | codes[j + 16] << 4 for j in range(16)]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def _llama_cpp_rounding(model):
    """``model`` with YaRN's correction range rounded outwards, as llama.cpp computes it
    (ggml_rope_yarn_corr_dims: floor / ceil); transformers' gpt-oss takes it unrounded."""
    from transformers import AutoModelForCausalLM

    config = model.config
    config = type(config).from_dict({**config.to_dict(), "rope_parameters": {**config.rope_parameters, "truncate": True}})
    twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


def _agreement(reference, folder: Path, file: str) -> float:
    ids = torch.randint(4, reference.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits.argmax(-1)
        got = load_as_llama_cpp(folder, file)(ids).logits.argmax(-1)
    agree = (got == expected).float().mean().item()
    print(f"gpt-oss {file}: {agree:.1%} of {expected.numel()} next-token predictions agree")
    return agree


def test_the_shipped_checkpoint_is_written_as_llama_cpps_converter_writes_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = mxfp4_folder(tmp_path / "gpt-oss")
    write_gguf(folder, tmp_path / "m.gguf", "f16")
    meta, _ = metadata(tmp_path / "m.gguf")
    assert meta["general.architecture"] == "gpt-oss"
    assert meta["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    yarn = GPT_OSS["rope_parameters"]
    expected = {"context_length": 256, "embedding_length": HIDDEN, "block_count": 2, "feed_forward_length": WIDTH,
                "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS,
                "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
                "expert_count": EXPERTS, "expert_used_count": 2, "expert_feed_forward_length": WIDTH,
                "attention.sliding_window": 8, "rope.freq_base": 150000.0, "rope.scaling.type": "yarn",
                "rope.scaling.factor": yarn["factor"],
                "rope.scaling.original_context_length": yarn["original_max_position_embeddings"],
                "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    assert {k: meta[f"gpt-oss.{k}"] for k in expected} == expected
    assert meta["gpt-oss.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta["tokenizer.ggml.model"] == "gpt2"

    # every tensor: llama.cpp's name, the shape its openai-moe loader asks for (numpy order), the converter's type
    f32, f16, mxfp4 = (gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "MXFP4"))
    vocab = meta["gpt-oss.vocab_size"]
    want = {"token_embd.weight": ((vocab, HIDDEN), f16), "output.weight": ((vocab, HIDDEN), f16),
            "output_norm.weight": ((HIDDEN,), f32)}
    for i in range(2):
        want.update({f"blk.{i}.{name}": spec for name, spec in {
            "attn_norm.weight": ((HIDDEN,), f32), "post_attention_norm.weight": ((HIDDEN,), f32),
            "attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), f16), "attn_q.bias": ((HEADS * HEAD_DIM,), f32),
            "attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), f16), "attn_k.bias": ((KV_HEADS * HEAD_DIM,), f32),
            "attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), f16), "attn_v.bias": ((KV_HEADS * HEAD_DIM,), f32),
            "attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), f16), "attn_output.bias": ((HIDDEN,), f32),
            "attn_sinks.weight": ((HEADS,), f32),
            "ffn_gate_inp.weight": ((EXPERTS, HIDDEN), f32), "ffn_gate_inp.bias": ((EXPERTS,), f32),
            "ffn_gate_exps.weight": ((EXPERTS, WIDTH, HIDDEN), mxfp4), "ffn_gate_exps.bias": ((EXPERTS, WIDTH), f32),
            "ffn_up_exps.weight": ((EXPERTS, WIDTH, HIDDEN), mxfp4), "ffn_up_exps.bias": ((EXPERTS, WIDTH), f32),
            "ffn_down_exps.weight": ((EXPERTS, HIDDEN, WIDTH), mxfp4), "ffn_down_exps.bias": ((EXPERTS, HIDDEN), f32),
        }.items()})
    tensors = _tensors(tmp_path / "m.gguf")
    assert {n: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type) for n, t in tensors.items()} == want

    saved = load_file(folder / "model.safetensors")
    for i in range(2):
        layer = f"model.layers.{i}.mlp.experts."
        for proj, parts in (("gate_up_proj", (("gate", slice(0, None, 2)), ("up", slice(1, None, 2)))),
                            ("down_proj", (("down", slice(None)),))):
            blocks, scales = saved[layer + proj + "_blocks"].numpy(), saved[layer + proj + "_scales"].numpy()
            decoded = convert_moe_packed_tensors(saved[layer + proj + "_blocks"], saved[layer + proj + "_scales"],
                                                 dtype=torch.float32).transpose(1, 2).numpy()  # [experts, out, in]
            bias = saved[layer + proj + "_bias"].float().numpy()
            for name, rows in parts:
                tensor = tensors[f"blk.{i}.ffn_{name}_exps.weight"]
                # the bytes: the checkpoint's codes and scales, only reordered
                assert np.array_equal(np.asarray(tensor.data), _reference_repack(blocks[:, rows], scales[:, rows]))
                # the values llama.cpp decodes: transformers' decoding of the checkpoint, exactly
                assert np.array_equal(values(tensor), decoded[:, rows]), (i, name)
                assert np.array_equal(values(tensors[f"blk.{i}.ffn_{name}_exps.bias"]), bias[:, rows])


def test_the_file_computes_the_checkpoints_model(tmp_path: Path) -> None:
    """Read as llama.cpp runs gpt-oss, the f32 file (its experts MXFP4 as shipped) gives the
    checkpoint's logits to float32 rounding: every tensor is in its place; f16 and q8_0 predict its
    next tokens within the floors every family meets."""
    from transformers import AutoModelForCausalLM

    folder = mxfp4_folder(tmp_path / "gpt-oss")
    reference = _llama_cpp_rounding(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    ids = torch.randint(4, reference.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    write_gguf(folder, folder / "m-f32.gguf", "f32")
    with torch.no_grad():
        torch.testing.assert_close(load_as_llama_cpp(folder, "m-f32.gguf")(ids).logits, reference(ids).logits,
                                   rtol=0, atol=1e-4)
    for quant, floor in FLOORS.items():
        write_gguf(folder, folder / f"m-{quant}.gguf", quant)
        assert _agreement(reference, folder, f"m-{quant}.gguf") >= floor, quant


def _run(tmp_path: Path, experts: bool):
    """A run on the tiny MXFP4 gpt-oss whose adapter is a random LoRA on the attention and, with
    ``experts``, on the expert weights; the merged float32 model (PEFT's merge over transformers'
    decoding of the experts)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = mxfp4_folder(tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(base)
    run = create_run(config)
    torch.manual_seed(1)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                           target_parameters=targets, init_lora_weights=False))
    peft_model.save_pretrained(run.adapter_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(run.adapter_dir)).merge_and_unload().eval()
    return run, base, merged


def test_an_attention_adapter_leaves_the_experts_as_shipped(tmp_path: Path) -> None:
    """LoRA on the attention: the export's experts are the checkpoint's MXFP4 bytes (the base's own
    GGUF's), the file predicts as the merged model, and the LoRA GGUF, applied as llama.cpp applies
    it, rebuilds the merged attention from the base's."""
    run, base, merged = _run(tmp_path, experts=False)
    write_gguf(base, tmp_path / "base.gguf", "f32")
    original = _tensors(tmp_path / "base.gguf")
    reference = _llama_cpp_rounding(merged)
    for quant in ("f32", *FLOORS):
        result = export_run(run, tmp_path / quant, "gguf", quant=quant)
        assert result.ok and "adapter-lora-f32.gguf" in result.message, result.message
        file = tmp_path / quant / f"model-{quant}.gguf"
        written = _tensors(file)
        experts = [n for n in written if "_exps.weight" in n]
        assert len(experts) == 6 and all(written[n].tensor_type == gguf.GGMLQuantizationType.MXFP4 for n in experts)
        assert all(np.array_equal(np.asarray(written[n].data), np.asarray(original[n].data)) for n in experts)
        if quant in FLOORS:
            assert _agreement(reference, tmp_path / quant, file.name) >= FLOORS[quant], quant
    merged_f32 = {n: values(t) for n, t in _tensors(tmp_path / "f32" / "model-f32.gguf").items()}
    lora = gguf.GGUFReader(tmp_path / "f32" / "adapter-lora-f32.gguf")
    assert lora.fields["general.architecture"].contents() == "gpt-oss"
    alpha = float(lora.fields["adapter.lora.alpha"].parts[-1][0])
    parts = {t.name: t.data for t in lora.tensors}
    names = sorted(n.removesuffix(".lora_a") for n in parts if n.endswith(".lora_a"))
    assert names == sorted(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in ("q", "k", "v", "output"))
    for tensor in names:
        a, b = parts[tensor + ".lora_a"], parts[tensor + ".lora_b"]
        assert abs(values(original[tensor]) + alpha / a.shape[0] * (b @ a) - merged_f32[tensor]).max() < 1e-4


def test_an_adapter_on_the_experts_writes_them_in_the_quant_or_requantized_to_mxfp4(tmp_path: Path) -> None:
    """LoRA on the experts too: the merge moves them off the MXFP4 grid, so they are written as the
    other MoE families' are (f16: the merged weights rounded to f16; the file predicts as the merged
    model) or, with --quant mxfp4, quantized as llama.cpp quantizes (scale byte floor(log2(max |w|))
    - 2 + 127 a block of 32, each weight the nearest value on that scale's grid), the other matrices
    q8_0, the router and biases float32. No LoRA GGUF: llama.cpp's adapters have no expert form."""
    run, _, merged = _run(tmp_path, experts=True)
    state = merged.state_dict()
    result = export_run(run, tmp_path / "f16", "gguf", quant="f16")
    assert result.ok and "no LoRA GGUF" in result.message, result.message
    written = _tensors(tmp_path / "f16" / "model-f16.gguf")
    assert metadata(tmp_path / "f16" / "model-f16.gguf")[0]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)

    def merged_expert(i: int, name: str) -> np.ndarray:  # [experts, out, in], as the file holds it
        layer = f"model.layers.{i}.mlp.experts."
        if name == "down":
            return state[layer + "down_proj"].transpose(1, 2).numpy()
        columns = slice(0, None, 2) if name == "gate" else slice(1, None, 2)
        return state[layer + "gate_up_proj"][..., columns].transpose(1, 2).numpy()

    for i in range(2):
        for name in ("gate", "up", "down"):
            tensor = written[f"blk.{i}.ffn_{name}_exps.weight"]
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_allclose(values(tensor), merged_expert(i, name), rtol=1e-3, atol=1e-6)
    assert _agreement(_llama_cpp_rounding(merged), tmp_path / "f16", "model-f16.gguf") >= FLOORS["f16"]

    assert export_run(run, tmp_path / "mxfp4", "gguf", quant="mxfp4").ok
    file = tmp_path / "mxfp4" / "model-mxfp4.gguf"
    assert metadata(file)[0]["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    written = _tensors(file)
    types = {n: t.tensor_type.name for n, t in written.items()}
    assert {types[n] for n in types if "_exps.weight" in n} == {"MXFP4"}
    assert {types[f"blk.{i}.attn_{p}.weight"] for i in range(2) for p in ("q", "k", "v", "output")} == {"Q8_0"}
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.ffn_gate_exps.bias"] == "F32"
    for i in range(2):
        for name in ("gate", "up", "down"):
            tensor = written[f"blk.{i}.ffn_{name}_exps.weight"]
            x = merged_expert(i, name).reshape(-1, 32)
            got = values(tensor).reshape(-1, 32)
            exponent = np.asarray(tensor.data).reshape(-1, 17)[:, 0].astype(int) - 127
            assert np.array_equal(exponent, np.floor(np.log2(np.abs(x).max(axis=1))).astype(int) - 2)
            scale = np.exp2(exponent.astype(float))[:, None]
            assert np.isin(got / scale, FP4).all()
            nearest = np.abs(x[:, :, None] - (FP4[None, :] * scale)[:, None, :]).min(axis=2)
            assert (np.abs(got - x) <= nearest + 1e-6 * np.abs(x).max()).all(), (i, name)


def test_a_bf16_gpt_oss_is_written_with_its_experts_in_the_quant(tmp_path: Path) -> None:
    """A gpt-oss saved in bf16 (no MXFP4 anywhere): its experts split from transformers' interleaved
    [experts, in, 2 x width] layout into the quant (f16: each value exactly, bf16 being exact in
    float32 and these in f16), or quantized with --quant mxfp4."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(vocab_size=len(tokenizer))).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    tokenizer.save_pretrained(tmp_path / "bf16")
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    write_gguf(tmp_path / "bf16", tmp_path / "m.gguf", "f32")
    written = {n: values(t) for n, t in _tensors(tmp_path / "m.gguf").items()}
    assert metadata(tmp_path / "m.gguf")[0]["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    for i in range(2):
        layer = f"model.layers.{i}.mlp.experts."
        gate_up, down = saved[layer + "gate_up_proj"].float(), saved[layer + "down_proj"].float()
        for e in range(EXPERTS):
            assert np.array_equal(written[f"blk.{i}.ffn_gate_exps.weight"][e], gate_up[e][:, 0::2].T.numpy())
            assert np.array_equal(written[f"blk.{i}.ffn_up_exps.weight"][e], gate_up[e][:, 1::2].T.numpy())
            assert np.array_equal(written[f"blk.{i}.ffn_down_exps.weight"][e], down[e].T.numpy())
    write_gguf(tmp_path / "bf16", tmp_path / "q.gguf", "mxfp4")
    assert {t.tensor_type.name for n, t in _tensors(tmp_path / "q.gguf").items() if "_exps.weight" in n} == {"MXFP4"}


def test_merged_export_of_an_mxfp4_base_is_the_adapter_over_the_decoded_experts(tmp_path: Path) -> None:
    """--format merged on a gpt-oss run: the base's MXFP4 experts decoded (as transformers decodes
    them), the adapter merged; the folder loads as gpt-oss and answers as PEFT's merge."""
    from transformers import AutoModelForCausalLM

    run, _, merged = _run(tmp_path, experts=True)
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert result.ok, result.message
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.randint(4, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, rtol=0, atol=1e-4)


def test_gpt_oss_that_llama_cpp_runs_otherwise_is_refused_in_one_line(tmp_path: Path) -> None:
    """llama.cpp's gpt-oss fixes its sliding pattern (even layers slide), the SwiGLU's constants and
    the attention biases: a config that differs would load and compute another model, so it is
    refused, every reason in one line; --quant mxfp4 on a model without experts too. The released
    gpt-oss-20b and gpt-oss-120b configs pass."""
    tiny = gpt_oss_config().to_dict()
    with pytest.raises(GgufExportError) as refused:
        check_architecture({**tiny, "layer_types": ["full_attention", "sliding_attention"], "swiglu_limit": 10.0,
                            "attention_bias": False})
    message = str(refused.value)
    assert "\n" not in message and message.startswith("gpt_oss: llama.cpp's gpt-oss cannot run this variant")
    assert all(why in message for why in ("layer_types differ from llama.cpp's fixed pattern", "swiglu_limit 10.0",
                                          "attention_bias: false", "serve that folder with transformers"))
    for model in ("gpt-oss-20b", "gpt-oss-120b"):
        shipped = json.loads((sample_data_dir() / "model_configs/openai" / model / "config.json").read_text())
        assert check_architecture(shipped).interleaved_experts
    dense = tmp_path / "dense"
    from helpers.tiny_families import build

    build("qwen3", dense)
    with pytest.raises(GgufExportError, match="--quant mxfp4 stores a mixture of experts' expert weights"):
        write_gguf(dense, tmp_path / "d.gguf", "mxfp4")
