"""GGUF export of the mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) beyond what every family gets in
test_export_families.py: the experts stacked under llama.cpp's names and shapes with the expert counts,
from either layout transformers stores experts in; the reader of ours (tests/helpers/gguf_reading.py)
against transformers' own on a Qwen3-MoE file; OLMoE's output head written even when tied; and the
LoRA GGUF: left out, with the reason, for an adapter on the expert weights, written for one on the
attention alone (Mixtral's q/k rows reordered as llama.cpp's llama architecture rotates them); and the
released Qwen3-30B-A3B, Mixtral-8x7B and OLMoE-1B-7B configs pass the checks of what llama.cpp fixes."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from helpers.gguf_reading import load_as_llama_cpp, metadata, transformers_reads, values  # noqa: E402
from helpers.tiny_families import FAMILIES, build, expert_targets, lora_targets  # noqa: E402

from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402
from studio.engine.gguf_export import write_gguf  # noqa: E402

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
"""llama.cpp's architecture of each tiny mixture of experts."""


def _tensors(path: Path) -> dict:
    return {t.name: values(t) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("name", list(ARCH))
def test_experts_are_stacked_under_llama_cpps_names_with_their_counts(name: str, tmp_path: Path) -> None:
    """ffn_gate_exps / ffn_up_exps [experts, expert width, hidden], ffn_down_exps [experts, hidden,
    width], ffn_gate_inp [experts, hidden], each expert in its place; expert_count, expert_used_count
    (and Qwen3-MoE's expert width) in the metadata; no per-expert or dense MLP tensor left."""
    from safetensors.torch import load_file

    base = build(name, tmp_path / "base")
    spec = {**FAMILIES[name]["config"]}
    experts = spec.get("num_experts") or spec["num_local_experts"]
    width = spec.get("moe_intermediate_size", 128)
    write_gguf(base, tmp_path / "m.gguf", "f32")
    meta, names = metadata(tmp_path / "m.gguf")
    arch = ARCH[name]
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (experts, 2)
    assert meta.get(f"{arch}.expert_feed_forward_length") == (32 if name == "qwen3_moe" else None)
    tensors = _tensors(tmp_path / "m.gguf")
    saved = load_file(base / "model.safetensors")
    # transformers saves one tensor an expert: Mixtral's w1 / w3 / w2, the others' gate / up / down_proj
    gate, up, down = ("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3",
                      "block_sparse_moe.experts.{}.w2") if name == "mixtral" else \
        ("mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")
    router = "block_sparse_moe.gate" if name == "mixtral" else "mlp.gate"
    for layer in range(2):
        block, source = f"blk.{layer}.", f"model.layers.{layer}."
        assert tensors[block + "ffn_gate_exps.weight"].shape == (experts, width, 64)
        assert tensors[block + "ffn_down_exps.weight"].shape == (experts, 64, width)
        assert tensors[block + "ffn_gate_inp.weight"].shape == (experts, 64)
        for e in range(experts):
            for gguf_name, hf_name in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
                assert (tensors[block + gguf_name + ".weight"][e] ==
                        saved[source + hf_name.format(e) + ".weight"].numpy()).all(), (gguf_name, e)
        assert (tensors[block + "ffn_gate_inp.weight"] == saved[source + router + ".weight"].numpy()).all()
    assert not [n for n in names if ".experts." in n or n.endswith(("ffn_gate.weight", "ffn_up.weight"))]


def test_the_fused_expert_layout_is_written_as_the_per_expert_one(tmp_path: Path) -> None:
    """A checkpoint storing the experts as transformers holds them in memory (one 3-D gate_up_proj,
    gate rows first, and down_proj a layer: a state dict saved as it is) gives the same file as the
    one tensor an expert that save_pretrained writes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = build("qwen3_moe", tmp_path / "base")
    fused = tmp_path / "fused"
    fused.mkdir()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors")
    for file in base.iterdir():
        if file.suffix != ".safetensors":
            (fused / file.name).write_bytes(file.read_bytes())
    write_gguf(base, tmp_path / "per-expert.gguf", "f32")
    write_gguf(fused, tmp_path / "fused.gguf", "f32")
    per_expert, from_fused = _tensors(tmp_path / "per-expert.gguf"), _tensors(tmp_path / "fused.gguf")
    assert per_expert.keys() == from_fused.keys()
    assert all((per_expert[n] == from_fused[n]).all() for n in per_expert)


def test_our_reader_reads_a_qwen3_moe_file_as_transformers_does(tmp_path: Path) -> None:
    """The reader the Mixtral and OLMoE files are checked with gives transformers' own reader's model
    for a Qwen3-MoE file (q8_0: its dequantization too), logits for logits."""
    if not transformers_reads("qwen3_moe"):
        pytest.skip("this transformers has no GGUF reader for Qwen3-MoE to compare with")
    base = build("qwen3_moe", tmp_path / "base")
    write_gguf(base, base / "m.gguf", "q8_0")
    ids = torch.randint(4, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_as_llama_cpp(base, "m.gguf", reader="ours")(ids).logits
        theirs = load_as_llama_cpp(base, "m.gguf", reader="transformers")(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_mxfp4_writes_the_experts_in_mxfp4_and_the_rest_as_llama_quantize_does(tmp_path: Path) -> None:
    """--quant mxfp4 on a Qwen3-MoE, as llama.cpp's MXFP4_MOE: the stacked experts MXFP4 (each weight
    within twice its block's scale: MXFP4's widest step, 4 to 6, or its clipping above 6), every other
    matrix q8_0, the router f32; the file type says MXFP4_MOE."""
    from safetensors.torch import load_file

    base = build("qwen3_moe", tmp_path / "base")
    write_gguf(base, tmp_path / "m.gguf", "mxfp4")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {k for n, k in kinds.items() if "_exps." in n} == {"MXFP4"}
    assert {kinds[f"blk.0.attn_{p}.weight"] for p in ("q", "k", "v", "output")} == {"Q8_0"}
    assert kinds["blk.0.ffn_gate_inp.weight"] == "F32" and kinds["output.weight"] == "Q8_0"
    saved = load_file(base / "model.safetensors")
    gate = _tensors(tmp_path / "m.gguf")["blk.0.ffn_gate_exps.weight"].reshape(-1, 32)
    want = torch.stack([saved[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(4)]).reshape(-1, 32)
    step = 2.0 ** (np.floor(np.log2(want.abs().max(dim=1).values.numpy())) - 2)  # the block's scale
    assert (np.abs(gate - want.numpy()) <= 2 * step[:, None]).all()


def test_olmoe_tied_embeddings_are_written_as_the_output_head_llama_cpp_needs(tmp_path: Path) -> None:
    base = build("olmoe", tmp_path / "base")
    assert FAMILIES["olmoe"]["config"]["tie_word_embeddings"]
    write_gguf(base, tmp_path / "m.gguf", "f32")
    tensors = _tensors(tmp_path / "m.gguf")
    assert (tensors["output.weight"] == tensors["token_embd.weight"]).all()


def _run(name: str, tmp_path: Path, experts: bool):
    """A run on the family's tiny base whose adapter is a random LoRA on the attention and, with
    ``experts``, on the expert weights; its PeftModel (float32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = build(name, tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(base)
    run = create_run(config)
    torch.manual_seed(1)
    model_type = FAMILIES[name]["model_type"]
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model_type),
                                           target_parameters=expert_targets(model_type) if experts else None,
                                           init_lora_weights=False))
    peft_model.save_pretrained(run.adapter_dir)
    return run, base


def test_an_adapter_on_the_experts_gets_no_lora_gguf_and_says_why(tmp_path: Path) -> None:
    """llama.cpp's LoRA adapters add B @ A to linear weights: an adapter on the expert weights has no
    such form. The export writes the model GGUF (the adapter merged) and the Modelfile without an
    ADAPTER line, and its message says why there is no LoRA GGUF."""
    run, _ = _run("qwen3_moe", tmp_path, experts=True)
    result = export_run(run, tmp_path / "g", "gguf", quant="f16")
    assert result.ok, result.message
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["Modelfile", "model-f16.gguf", "prompt_template.txt"]
    assert "no LoRA GGUF: llama.cpp's LoRA adapters cover linear layers, and this one also adapts the expert " \
           "weights (lora.target_experts); the model GGUF has it merged" in result.message
    assert "ADAPTER" not in (tmp_path / "g" / "Modelfile").read_text()


def test_an_attention_adapter_on_mixtral_is_a_lora_gguf_in_llama_cpps_layout(tmp_path: Path) -> None:
    """LoRA on the attention alone: the LoRA GGUF, applied as llama.cpp applies it (W + alpha/r B @ A),
    rebuilds the merged GGUF's q/k/v/o weights from the base's (q and k rows reordered into llama.cpp's
    rotary pairs), and the experts are the base's."""
    run, base = _run("mixtral", tmp_path, experts=False)
    result = export_run(run, tmp_path / "g", "gguf", quant="f32")
    assert result.ok and "adapter-lora-f32.gguf" in result.message, result.message
    write_gguf(base, tmp_path / "base.gguf", "f32")
    merged, original = _tensors(tmp_path / "g" / "model-f32.gguf"), _tensors(tmp_path / "base.gguf")
    lora = gguf.GGUFReader(tmp_path / "g" / "adapter-lora-f32.gguf")
    alpha = float(lora.fields["adapter.lora.alpha"].parts[-1][0])
    parts = {t.name: t.data for t in lora.tensors}
    names = sorted(n.removesuffix(".lora_a") for n in parts if n.endswith(".lora_a"))
    assert names == sorted(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in ("q", "k", "v", "output"))
    for tensor in names:
        a, b = parts[tensor + ".lora_a"], parts[tensor + ".lora_b"]
        assert abs(original[tensor] + alpha / a.shape[0] * (b @ a) - merged[tensor]).max() < 1e-4, tensor
    assert all((merged[n] == original[n]).all() for n in merged if "_exps" in n or "gate_inp" in n)


SHIPPED = {
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                               norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, use_sliding_window=False,
                               rope_theta=1000000.0, rope_scaling=None, num_attention_heads=32, num_key_value_heads=4),
    "mistralai/Mixtral-8x7B-v0.1": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                        rope_theta=1000000.0, sliding_window=None, num_attention_heads=32,
                                        num_key_value_heads=8),
    "allenai/OLMoE-1B-7B-0924": dict(model_type="olmoe", num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                     clip_qkv=None, rope_theta=10000.0, rope_scaling=None, num_attention_heads=16,
                                     num_key_value_heads=16),
}
"""The keys that decide, as the released models' config.json files set them."""


@pytest.mark.parametrize("model", list(SHIPPED))
def test_the_released_models_are_written(model: str) -> None:
    from studio.engine.gguf_export import check_architecture

    assert check_architecture(SHIPPED[model]).moe
