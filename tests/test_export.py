"""Merging a run's adapter into its base model (studio.engine.export), on the tiny model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from studio.core import events as ev  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import create_run  # noqa: E402
from studio.engine.export import export_merged  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir():
    from studio.engine.tiny import build_tiny_model

    return build_tiny_model()


def test_merged_model_answers_like_base_plus_adapter(tmp_path, tiny_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(tiny_dir)
    run = create_run(config)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(run.adapter_dir)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        expected = model(ids).logits

    events: list[ev.Event] = []
    result = export_merged(run, tmp_path / "merged", "float32", events.append)
    assert result.ok, result.message
    assert [e.fraction for e in events if isinstance(e, ev.ExportProgress)][-1] == 1.0
    assert events[-1] == result
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        got = merged(ids).logits
    assert torch.allclose(got, expected, atol=1e-4)
    assert (tmp_path / "merged" / "tokenizer.json").exists()

    again = export_merged(run, tmp_path / "merged", "float32")
    assert not again.ok and "already exists" in again.message


def test_no_adapter_is_a_clear_message(tmp_path):
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    result = export_merged(run, tmp_path / "out")
    assert not result.ok and "no saved adapter yet" in result.message
    assert not (tmp_path / "out").exists()
