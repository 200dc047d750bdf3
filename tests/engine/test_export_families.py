"""GGUF export of every family the exporter covers, on tiny random models with a LoRA merged in (on a
mixture of experts' attention and expert weights): the file, read as llama.cpp reads it
(tests/helpers/gguf_reading.py), predicts the merged model's next tokens (>= 99% at f16, >= 90% at
q8_0), its tokenizer metadata encodes text as the model's own tokenizer does, the LoRA GGUF holds the
adapter's delta, and the Modelfile carries the family's chat turns."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from helpers.gguf_reading import (  # noqa: E402
    load_as_llama_cpp,
    metadata,
    tokenizer_reader_is_faithful,
    transformers_reads,
)
from helpers.tiny_families import FAMILIES, build, build_gemma3_multimodal, expert_targets, lora_targets  # noqa: E402

from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402
from studio.engine.gguf_families import FAMILIES as GGUF_FAMILIES  # noqa: E402

WRITTEN = [name for name, spec in FAMILIES.items() if spec["model_type"] in GGUF_FAMILIES]
"""The tiny families the GGUF exporter writes (OLMo 2, SmolLM3 and Granite it refuses)."""

FLOORS = {"f16": 0.99, "q8_0": 0.90}
TEXTS = ["Reverse the letters of the word.", "  two  spaces, then\nnew lines\n\n", "Écrire 123 + 4567 = 4690!",
         "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>assistant\nok<|im_end|>", "🦙 tabs\tand \u2581 marks"]
GPT2, SPM = ("gpt2", "gpt-2", False), ("llama", "default", False)
EXPECTED_TOKENIZER = {"llama": GPT2, "mistral": GPT2, "qwen3": GPT2, "gemma2": SPM, "gemma3": SPM,
                      "qwen3_moe": GPT2, "mixtral": GPT2, "olmoe": GPT2,
                      "phi3": ("llama", "default", True),
                      # transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which saves
                      # Qwen's own split expression: llama.cpp's "qwen2"
                      "qwen2": ("gpt2", "qwen2", False)}
"""tokenizer.ggml.model, .pre and .add_space_prefix that llama.cpp's converter writes for each."""


def _run_with_adapter(name: str, tmp_path: Path):
    """A run on the family's tiny base with a random (non-zero) LoRA on every projection (a mixture of
    experts': its attention's and its expert weights), and the merged float32 model that the GGUF must
    reproduce."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = build(name, tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(base)
    config.prompt.template = "chat"
    run = create_run(config)
    torch.manual_seed(1)
    model_type = FAMILIES[name]["model_type"]
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model_type),
                                           target_parameters=expert_targets(model_type), init_lora_weights=False))
    peft_model.save_pretrained(run.adapter_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(run.adapter_dir)).merge_and_unload().eval()
    return run, base, merged


@pytest.mark.parametrize("name", WRITTEN)
def test_each_family_exports_a_gguf_that_predicts_like_the_merged_model(name: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    run, base, merged = _run_with_adapter(name, tmp_path)
    # Rows longer than the Gemma models' sliding window (8), so the window and the global layers both count.
    ids = torch.randint(4, merged.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged(ids).logits.argmax(-1)
    own = AutoTokenizer.from_pretrained(base)
    for quant, floor in FLOORS.items():
        result = export_run(run, tmp_path / quant, "gguf", quant=quant)
        assert result.ok, result.message
        file = f"model-{quant}.gguf"
        with torch.no_grad():
            got = load_as_llama_cpp(tmp_path / quant, file)(ids).logits.argmax(-1)
        agree = (got == expected).float().mean().item()
        print(f"{name} {quant}: {agree:.1%} of {expected.numel()} next-token predictions agree")
        assert agree >= floor, f"{name} {quant}: {agree:.1%} < {floor:.0%}"
        if tokenizer_reader_is_faithful() and transformers_reads(FAMILIES[name]["model_type"]):
            # transformers' GGUF tokenizer, built from the file's metadata alone, encodes as the model's own.
            from_gguf = AutoTokenizer.from_pretrained(str(tmp_path / quant), gguf_file=file)
            assert [from_gguf.encode(t, add_special_tokens=False) for t in TEXTS] == \
                [own.encode(t, add_special_tokens=False) for t in TEXTS]
    meta, _ = metadata(tmp_path / "f16" / "model-f16.gguf")
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"], meta["tokenizer.ggml.add_space_prefix"]) == \
        EXPECTED_TOKENIZER[name]
    assert meta["tokenizer.chat_template"] == FAMILIES[name]["chat"]
    # llama.cpp ends generation at the end-of-turn marker it finds by its text among control tokens.
    end = FAMILIES[name]["end"] or own.eos_token
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.token_type"][tokens.index(end)] == 3  # gguf.TokenType.CONTROL
    assert tokens[meta["tokenizer.ggml.eos_token_id"]] == own.eos_token
    # The run trained through the chat template: the Modelfile is that template in Go, with the
    # family's end-of-turn marker as a stop.
    modelfile = (tmp_path / "f16" / "Modelfile").read_text()
    assert "{{ range $i, $_ := .Messages }}" in modelfile and "{{ .Content }}" in modelfile
    assert f'PARAMETER stop "{end}"' in modelfile



@pytest.mark.parametrize("name", ["qwen2", "phi3", "gemma3"])
def test_lora_gguf_holds_the_adapter_delta_in_each_familys_layout(name: str, tmp_path: Path) -> None:
    """llama.cpp applies W + alpha/r * B @ A per tensor: rebuilt from the LoRA GGUF over the base's GGUF,
    that is the merged GGUF's weight (Qwen2 with attention biases, Phi-3's fused projections, Gemma 3)."""
    import gguf

    from studio.engine.gguf_export import write_gguf

    run, base, _ = _run_with_adapter(name, tmp_path)
    assert export_run(run, tmp_path / "g", "gguf", quant="f32").ok
    write_gguf(base, tmp_path / "base.gguf", "f32")
    merged = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "g" / "model-f32.gguf").tensors}
    original = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "base.gguf").tensors}
    lora = gguf.GGUFReader(tmp_path / "g" / "adapter-lora-f32.gguf")
    assert lora.fields["general.architecture"].contents() == metadata(tmp_path / "base.gguf")[0]["general.architecture"]
    alpha = float(lora.fields["adapter.lora.alpha"].parts[-1][0])
    parts = {t.name: t.data for t in lora.tensors}
    names = sorted(n.removesuffix(".lora_a") for n in parts if n.endswith(".lora_a"))
    assert len(names) == len(lora_targets(FAMILIES[name]["model_type"])) * merged_layers(merged)
    for tensor in names:
        a, b = parts[tensor + ".lora_a"], parts[tensor + ".lora_b"]
        delta = alpha / a.shape[0] * (b @ a)
        assert abs(original[tensor] + delta - merged[tensor]).max() < 1e-4, tensor


def merged_layers(tensors: dict) -> int:
    return len({n.split(".")[1] for n in tensors if n.startswith("blk.")})


def test_pre_tokenizer_is_named_as_llama_cpp_names_it(tmp_path: Path) -> None:
    """Each split llama.cpp knows, built as a tokenizer.json, is told apart by what it does to text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from studio.engine.gguf_vocab import _SPLITS, pre_tokenizer_name

    def named(pre_tokenizer, ignore_merges: bool = False) -> str:
        tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizer
        tok.train_from_iterator(["Hello World 123 4567 I'VE don't HelloWorld\n\n  ok"] * 3,
                                trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        path = tmp_path / "tokenizer.json"
        tok.save(str(path))
        return pre_tokenizer_name(path)

    def split(name: str):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    assert named(split("qwen2")) == "qwen2"
    assert named(split("llama-bpe"), ignore_merges=True) == "llama-bpe"  # Llama 3
    assert named(split("llama-bpe")) == "dbrx"  # the same split, merges applied to whole words (Phi-4)
    assert named(split("gpt-4o")) == "gpt-4o"  # Phi-4-mini
    assert named(split("tekken")) == "tekken"  # Mistral Nemo
    # GPT-2's split, with a multi-digit token learned ("123"): not SmolLM's digit-by-digit split
    assert named(pre_tokenizers.ByteLevel(add_prefix_space=False)) == "gpt-2"
    with pytest.raises(Exception, match="splits text in a way Studio cannot name"):
        named(pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(use_regex=False)]))


def test_what_llama_cpp_cannot_run_is_refused_with_every_reason() -> None:
    from studio.engine.gguf_export import GgufExportError, check_architecture

    with pytest.raises(GgufExportError, match="'qwen2_moe' is a mixture-of-experts model that Studio does not "
                       r"write as GGUF \(it writes Qwen3-MoE, Mixtral, OLMoE and gpt-oss\).*--format merged"):
        check_architecture({"model_type": "qwen2_moe", "num_experts": 60})
    # what llama.cpp fixes for each mixture of experts, whatever the config says
    with pytest.raises(GgufExportError) as refused:
        check_architecture({"model_type": "qwen3_moe", "num_experts": 8, "norm_topk_prob": False,
                            "mlp_only_layers": [1]})
    assert "norm_topk_prob: false (llama.cpp's qwen3moe always renormalises" in str(refused.value)
    assert "dense MLP layers" in str(refused.value)
    with pytest.raises(GgufExportError, match="norm_topk_prob: false"):  # transformers' default where unset
        check_architecture({"model_type": "qwen3_moe", "num_experts": 8})
    with pytest.raises(GgufExportError) as refused:
        check_architecture({"model_type": "olmoe", "num_experts": 8, "norm_topk_prob": True, "num_attention_heads": 16,
                            "num_key_value_heads": 4, "clip_qkv": 8.0})
    assert all(why in str(refused.value) for why in ("norm_topk_prob: true (llama.cpp's olmoe never",
                                                     "num_key_value_heads 4", "clip_qkv 8.0"))
    gemma = dict(model_type="gemma2", hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2,
                 query_pre_attn_scalar=64, layer_types=["full_attention", "sliding_attention"],
                 hidden_activation="gelu_pytorch_tanh")
    with pytest.raises(GgufExportError) as refused:
        check_architecture(gemma)
    assert "layer_types differ" in str(refused.value) and "query_pre_attn_scalar 64" in str(refused.value)
    with pytest.raises(GgufExportError, match="'dynamic' RoPE scaling"):
        check_architecture({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(GgufExportError, match="use_sliding_window"):
        check_architecture({"model_type": "qwen2", "use_sliding_window": True})


def test_llama3_rope_scaling_is_written_as_the_frequency_factors_llama_cpp_divides_by(tmp_path: Path) -> None:
    """Llama 3.1+ scales RoPE per frequency; llama.cpp reads that as rope_freqs (each base frequency
    divided by its factor), which must give transformers' own scaled frequencies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.engine.gguf_export import write_gguf

    base = build("llama", tmp_path / "base")
    config = AutoConfig.from_pretrained(base)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "scaled")
    (tmp_path / "scaled" / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    (tmp_path / "scaled" / "tokenizer_config.json").write_bytes((base / "tokenizer_config.json").read_bytes())
    write_gguf(tmp_path / "scaled", tmp_path / "scaled.gguf", "f32")
    import gguf

    factors = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "scaled.gguf").tensors}["rope_freqs.weight"]
    dim = config.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    assert torch.allclose(plain / torch.from_numpy(factors).double(), model.model.rotary_emb.inv_freq.double(),
                          rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the ramp are used


def test_phi3_longrope_is_written_as_llama_cpp_reads_it(tmp_path: Path) -> None:
    """Phi-3.5 / Phi-4-mini scale RoPE with long and short per-frequency factors and an attention
    factor: written as rope_factors_long / rope_factors_short and rope.scaling.attn_factor, equal to
    what transformers computes for the same config."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from studio.engine.gguf_export import write_gguf

    base = build("phi3", tmp_path / "base")
    config = AutoConfig.from_pretrained(base)
    half = int(config.hidden_size // config.num_attention_heads * 0.5) // 2
    long, short = [1.0 + i for i in range(half)], [1.0 + i / 8 for i in range(half)]  # exact in float32
    config.original_max_position_embeddings = 64
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "long_factor": long, "short_factor": short, "original_max_position_embeddings": 64}
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "long")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "long" / name).write_bytes((base / name).read_bytes())
    write_gguf(tmp_path / "long", tmp_path / "long.gguf", "f32")
    reader = gguf.GGUFReader(tmp_path / "long.gguf")
    tensors = {t.name: t.data.tolist() for t in reader.tensors}
    assert tensors["rope_factors_long.weight"] == long and tensors["rope_factors_short.weight"] == short
    _, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    assert reader.fields["phi3.rope.scaling.attn_factor"].contents() == pytest.approx(attention_factor, rel=1e-6)
    assert reader.fields["phi3.rope.scaling.original_context_length"].contents() == 64
    assert reader.fields["phi3.rope.dimension_count"].contents() == 2 * half


def test_gemma3_multimodal_wrapper_is_written_as_its_text_model(tmp_path: Path) -> None:
    """Gemma 3 4B+ checkpoints are Gemma3ForConditionalGeneration: the GGUF is the text model (the
    vision tower left out), predicting as the wrapper does on text."""
    from transformers import Gemma3ForConditionalGeneration

    from studio.engine.gguf_export import write_gguf

    build_gemma3_multimodal(tmp_path / "mm")
    wrapper = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm").eval()
    config = wrapper.config
    write_gguf(tmp_path / "mm", tmp_path / "mm" / "model.gguf", "f16")
    _, tensors = metadata(tmp_path / "mm" / "model.gguf")
    assert "token_embd.weight" in tensors
    assert all(t.startswith("blk.") or t in ("token_embd.weight", "output_norm.weight") for t in tensors)
    ids = torch.randint(4, config.text_config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = wrapper(input_ids=ids).logits.argmax(-1)
        got = load_as_llama_cpp(tmp_path / "mm", "model.gguf")(ids).logits.argmax(-1)
    assert (got == expected).float().mean().item() >= FLOORS["f16"]
