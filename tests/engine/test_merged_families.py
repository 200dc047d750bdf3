"""Merged export (``studio export --format merged``) and ``studio embed`` on a tiny random model of every
covered family (tests/helpers/tiny_families.py: Llama 2 / 3.x (one model_type, one class), Mistral, Qwen2 / 2.5,
Qwen3, Gemma 2, Gemma 3 text and its multimodal checkpoint, Phi-3 / 3.5 / 4-mini, OLMo 2, SmolLM3,
Granite 3, and the mixtures of experts Qwen3-MoE, Mixtral and OLMoE), each with a non-zero random LoRA on
every projection the family has, under PEFT's names (a mixture's expert weights through PEFT's
``target_parameters``, as ``lora.target_experts`` trains them).

The bases are stored in bfloat16, as the Hub's are, and the runs keep the default config (QLoRA,
``quantization.bits: 4``): the merge loads the base unquantized whatever the run trained on. What the
CPU cannot show: a run whose base was quantized on a GPU by bitsandbytes' CUDA kernels. The export never
quantizes (it loads the full-precision checkpoint on the CPU), so the path is the same there; a base that
exists only as a 4-bit checkpoint is dequantized on the CPU by bitsandbytes' CPU backend, as tested here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

# The references are computed in fp32 on the CPU: the engine must export and embed there too (on a
# GPU box it would load the base in bf16 on the card, and the exact comparisons would not hold).
pytestmark = pytest.mark.usefixtures("on_cpu")

from helpers.tiny_families import FAMILIES, build, build_gemma3_multimodal, expert_targets, lora_targets  # noqa: E402

from studio.core import events as ev  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import RunDir, create_run  # noqa: E402
from studio.engine.embed import embed_run, embed_texts, pool  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402
from studio.engine.generate import prompt_ids  # noqa: E402

MULTIMODAL = "gemma3-multimodal"
CASES = [*FAMILIES, MULTIMODAL]
ROWS = ["Reverse the letters of the word.", "hello", "two words, then a few more of them to pad the others"]


def _base(name: str, folder: Path) -> Path:
    if name == MULTIMODAL:
        return build_gemma3_multimodal(folder, dtype="bfloat16")
    return build(name, folder, dtype="bfloat16")


def _run(base: Path, runs: Path, scale: float = 1.0) -> tuple[RunDir, object]:
    """A run on ``base`` whose saved adapter is a random LoRA on every projection (its B times
    ``scale``: 0 gives an adapter that changes nothing), and that adapter on a float32 base (PEFT)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = RunConfig(output_dir=str(runs))
    config.model.base_model = str(base)
    run = create_run(config)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)
    model_type = model.config.model_type
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                  target_modules=lora_targets(model_type),
                                                  target_parameters=expert_targets(model_type)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(run.adapter_dir)
    return run, peft_model.eval()


def _ids(model) -> torch.Tensor:
    # Rows longer than the Gemma models' sliding window (8), so windowed and global layers both count.
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(4, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", CASES)
def test_merged_export_loads_as_the_base_class_and_answers_like_the_adapter(name: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = _base(name, tmp_path / "base")
    run, peft_model = _run(base, tmp_path / "runs")
    ids = _ids(peft_model)
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            untuned = peft_model(input_ids=ids).logits
    assert (expected - untuned).abs().max() > 0.1  # the adapter moves the logits, far past the tolerance

    for dtype in ("float32", "bfloat16"):
        result = export_run(run, tmp_path / dtype, "merged", dtype=dtype)
        assert result.ok, result.message
    folder = tmp_path / "float32"
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "prompt_template.txt"} <= {p.name for p in folder.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(merged) is type(peft_model.get_base_model())  # Gemma3ForConditionalGeneration stays itself
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-4), f"{name}: {(got - expected).abs().max():.2e}"
    tied = merged.get_output_embeddings().weight is merged.get_input_embeddings().weight
    assert tied == bool(peft_model.config.get_text_config().tie_word_embeddings)

    # bfloat16: each weight is the float32 merge rounded once (the base is stored in bfloat16, so the
    # sum of base and update, made in float32, is the only thing rounded).
    rounded, full = load_file(tmp_path / "bfloat16" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert rounded.keys() == full.keys()
    for key, tensor in rounded.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[key].to(torch.bfloat16)), key
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16").dtype == torch.bfloat16
    if name == MULTIMODAL:
        # The vision tower's own LoRA (q/k/v there too) is merged, and the image processor travels along.
        vision = [k for k in full if "vision" in k and "q_proj.weight" in k]
        assert vision and all(not torch.equal(full[k], load_file(base / "model.safetensors")[k].float())
                              for k in vision)
        assert (folder / "preprocessor_config.json").read_text() == (base / "preprocessor_config.json").read_text()


def _layer_states(model, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The text decoder's first-layer input, first-layer output and final norm output, read by hooks."""
    decoder = model.get_base_model().get_decoder() if hasattr(model, "get_base_model") else model.get_decoder()
    seen: dict[str, torch.Tensor] = {}

    def layer_input(_module, args, kwargs) -> None:
        seen["input"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def output_as(key: str):
        def hook(_module, _args, output) -> None:
            seen[key] = output[0] if isinstance(output, tuple) else output
        return hook

    hooks = [decoder.layers[0].register_forward_pre_hook(layer_input, with_kwargs=True),
             decoder.layers[0].register_forward_hook(output_as("layer 1")),
             decoder.norm.register_forward_hook(output_as("norm"))]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("name", CASES)
def test_embed_reads_the_text_decoders_layers_and_the_adapter(name: str, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    base = _base(name, tmp_path / "base")
    run, peft_model = _run(base, tmp_path / "runs")
    tokenizer = AutoTokenizer.from_pretrained(base)
    layers = peft_model.config.get_text_config().num_hidden_layers

    # --layer N is transformers' hidden_states[N] of the text decoder: 0 what its first layer receives
    # (Gemma's and Granite's scaled embeddings), 1 that layer's output, -1 (and N = layers) the final norm's.
    ids = [prompt_ids(tokenizer, t) for t in ROWS]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    states = _layer_states(peft_model, input_ids, mask)
    head_positions: list[int] = []

    def head_input(_module, args, _output) -> None:
        head_positions.append(args[0].shape[1])

    head = peft_model.get_output_embeddings().register_forward_hook(head_input)
    for layer, state in ((0, "input"), (1, "layer 1"), (-1, "norm"), (layers, "norm")):
        for how in ("mean", "last"):
            got = embed_texts(peft_model, tokenizer, ROWS, layer=layer, how=how)
            assert torch.allclose(got, pool(states[state].float(), mask, how), atol=1e-5), (layer, how)
    head.remove()
    assert set(head_positions) == {1}  # no logits for every token: one position's, which embed throws away

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ROWS))
    zero, _ = _run(base, tmp_path / "zero-runs", scale=0.0)
    vectors = {}
    for who, source, use_base in (("tuned", run, False), ("base", run, True), ("zero", zero, False)):
        out = tmp_path / f"{who}.parquet"
        result = embed_run(source, ev.Embed(data=str(data), out=str(out), pool="last", base=use_base), lambda _e: None)
        assert result.ok, result.message
        vectors[who] = torch.tensor(pq.read_table(out).column("embedding").to_pylist())
    assert vectors["tuned"].shape == (len(ROWS), peft_model.config.get_text_config().hidden_size)
    with torch.no_grad():
        expected = embed_texts(peft_model, tokenizer, ROWS, how="last")
    assert torch.allclose(vectors["tuned"], expected, atol=1e-4)  # the run's adapter, loaded by the worker's path
    assert (vectors["tuned"] - vectors["base"]).abs().max() > 1e-2
    assert torch.allclose(vectors["zero"], vectors["base"], atol=1e-6)  # an adapter that changes nothing
    wrong = embed_run(run, ev.Embed(data=str(data), out=str(tmp_path / "w.parquet"), layer=layers + 1), lambda _e: None)
    assert not wrong.ok and wrong.message == (f"--layer {layers + 1}: this model has layers 0..{layers} "
                                              "(or -1 for the last)")


@pytest.mark.parametrize("name", ["llama", MULTIMODAL])
def test_adapted_tied_embeddings_are_untied_in_the_merge(name: str, tmp_path: Path) -> None:
    """A LoRA on the output head (and the token embeddings) of a model that ties them: merged into one
    shared tensor, the head's update would change the embeddings too. The export saves them apart."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = _base(name, tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(base)
    run = create_run(config)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, init_lora_weights=False,
                                                  target_modules=["q_proj", "lm_head", "embed_tokens"]))
    peft_model.save_pretrained(run.adapter_dir)
    ids = _ids(model)
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert result.ok, result.message
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.get_output_embeddings().weight is not merged.get_input_embeddings().weight
    assert not merged.config.get_text_config().tie_word_embeddings
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-4)


def test_a_4bit_checkpoint_base_is_dequantized_before_the_merge(tmp_path: Path) -> None:
    """A base that exists only as a bitsandbytes NF4 checkpoint (as ``unsloth/...-bnb-4bit`` ones do):
    the export is its dequantized weights plus the update, in full precision, with no quantization left."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    full = build("llama", tmp_path / "full")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(full, quantization_config=nf4, device_map={"": "cpu"})
    except Exception as exc:  # bitsandbytes without a CPU backend raises many kinds
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {exc}")
    quantized.save_pretrained(tmp_path / "nf4")
    AutoTokenizer.from_pretrained(full).save_pretrained(tmp_path / "nf4")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(tmp_path / "nf4")
    run = create_run(config)
    dequantized = AutoModelForCausalLM.from_pretrained(tmp_path / "nf4", device_map={"": "cpu"})
    dequantized.dequantize()
    torch.manual_seed(1)
    peft_model = get_peft_model(dequantized, LoraConfig(r=4, init_lora_weights=False,
                                                        target_modules=lora_targets("llama")))
    peft_model.save_pretrained(run.adapter_dir)
    ids = _ids(peft_model)
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits

    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert result.ok, result.message
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, expected, atol=1e-4)


REFUSED = {
    "qwen2_moe": (dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), ["q_proj", "v_proj"]),
    "mamba": (dict(hidden_size=64, state_size=8, num_hidden_layers=2, intermediate_size=128), ["in_proj", "x_proj"]),
    "t5": (dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16), ["q", "v"]),
}
"""A tiny mixture of experts the GGUF writer does not cover (a shared expert), a state-space and an
encoder-decoder model, and LoRA targets each has."""


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_what_studio_does_not_cover_is_one_line(model_type: str, tmp_path: Path) -> None:
    """The GGUF writer refuses all three in one line before merging; an encoder-decoder is refused by
    the merge and ``studio embed`` too (there is no causal LM to merge into). A mixture-of-experts or
    state-space model merges as transformers loads it (what the GGUF refusal tells the person to do)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    from studio.engine.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    shape, targets = REFUSED[model_type]
    kind = AutoModelForSeq2SeqLM if model_type == "t5" else AutoModelForCausalLM
    model = kind.from_config(AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **shape))
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(tmp_path / "base")
    run = create_run(config)
    get_peft_model(model, LoraConfig(r=4, target_modules=targets)).save_pretrained(run.adapter_dir)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")

    events: list[ev.Event] = []
    gguf = export_run(run, tmp_path / "gguf", "gguf", emit=events.append)
    assert not gguf.ok and "\n" not in gguf.message
    assert not any(e.stage.startswith("merging") for e in events if isinstance(e, ev.ExportProgress))
    merged = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    embedded = embed_run(run, ev.Embed(data=str(data), out=str(tmp_path / "e.parquet")), lambda _e: None)
    if model_type == "t5":
        for result in (gguf, merged, embedded):
            assert not result.ok
            assert result.message == (f"{tmp_path / 'base'} is an encoder-decoder model (model_type 't5'); Studio "
                                      "exports and embeds decoder-only causal LMs")
    else:
        assert ("mixture-of-experts model that Studio does not write as GGUF (it writes Qwen3-MoE, Mixtral, "
                "OLMoE and gpt-oss)" if model_type == "qwen2_moe" else "this model is 'mamba'") in gguf.message
        assert "--format merged" in gguf.message
        assert merged.ok and embedded.ok, (merged.message, embedded.message)
