"""GGUF export of every family the exporter covers, on tiny random models with a LoRA merged in: the
file, read as llama.cpp reads it (tests/gguf_reading.py), predicts the merged model's next tokens
(>= 99% at f16, >= 90% at q8_0), its tokenizer metadata encodes text as the model's own tokenizer
does, the LoRA GGUF holds the adapter's delta, and the Modelfile carries the family's chat turns."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from gguf_reading import load_as_llama_cpp, metadata  # noqa: E402
from tiny_families import FAMILIES, build, lora_targets  # noqa: E402

from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402

FLOORS = {"f16": 0.99, "q8_0": 0.90}
TEXTS = ["Reverse the letters of the word.", "  two  spaces, then\nnew lines\n\n", "Écrire 123 + 4567 = 4690!",
         "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>assistant\nok<|im_end|>", "🦙 tabs\tand \u2581 marks"]
GPT2, SPM = ("gpt2", "gpt-2", False), ("llama", "default", False)
EXPECTED_TOKENIZER = {"llama": GPT2, "mistral": GPT2, "qwen3": GPT2, "gemma2": SPM, "gemma3": SPM,
                      "phi3": ("llama", "default", True),
                      # transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which saves
                      # Qwen's own split expression: llama.cpp's "qwen2"
                      "qwen2": ("gpt2", "qwen2", False)}
"""tokenizer.ggml.model, .pre and .add_space_prefix that llama.cpp's converter writes for each."""


def _run_with_adapter(name: str, tmp_path: Path):
    """A run on the family's tiny base with a random (non-zero) LoRA on every projection, and the
    merged float32 model that the GGUF must reproduce."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = build(name, tmp_path / "base")
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(base)
    config.prompt.template = "chat"
    run = create_run(config)
    torch.manual_seed(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(FAMILIES[name]["model_type"]),
                                           init_lora_weights=False))
    peft_model.save_pretrained(run.adapter_dir)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(run.adapter_dir)).merge_and_unload().eval()
    return run, base, merged


@pytest.mark.parametrize("name", list(FAMILIES))
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
        # transformers' GGUF tokenizer, built from the file's metadata alone, encodes as the model's own.
        from_gguf = AutoTokenizer.from_pretrained(str(tmp_path / quant), gguf_file=file)
        assert [from_gguf.encode(t, add_special_tokens=False) for t in TEXTS] == \
            [own.encode(t, add_special_tokens=False) for t in TEXTS]
    meta, _ = metadata(tmp_path / "f16" / "model-f16.gguf")
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"], meta["tokenizer.ggml.add_space_prefix"]) == \
        EXPECTED_TOKENIZER[name]
    assert meta["tokenizer.chat_template"] == FAMILIES[name]["chat"]
    # The run trained through the chat template: the Modelfile is that template in Go, with the
    # family's end-of-turn marker as a stop.
    modelfile = (tmp_path / "f16" / "Modelfile").read_text()
    assert "{{ range $i, $_ := .Messages }}" in modelfile and "{{ .Content }}" in modelfile
    end = FAMILIES[name]["end"] or own.eos_token
    assert f'PARAMETER stop "{end}"' in modelfile

