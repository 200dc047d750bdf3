"""A run's adapter: which one it is (RunDir.adapter), copied out as a PEFT folder, and merged into its
base model (studio.engine.exporting's merged export, as the worker serves ExportRun(format="merged")),
on the tiny model."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from studio.core import events as ev  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.runs import copy_adapter, create_run  # noqa: E402
from studio.engine.exporting import export_run  # noqa: E402


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
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32", emit=events.append)
    assert result.ok, result.message
    assert [e.fraction for e in events if isinstance(e, ev.ExportProgress)][-1] == 1.0
    assert events[-1] == result
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        got = merged(ids).logits
    assert torch.allclose(got, expected, atol=1e-4)
    assert (tmp_path / "merged" / "tokenizer.json").exists()

    again = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert not again.ok and "already exists" in again.message


def test_no_adapter_is_a_clear_message(tmp_path):
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    result = export_run(run, tmp_path / "out", "merged")
    assert not result.ok and "no saved adapter yet" in result.message
    assert not (tmp_path / "out").exists()


def _fake_adapter(folder, step: int | None = None) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    if step is not None:
        (folder / "studio_step.json").write_text(json.dumps({"step": step}))


def test_run_adapter_is_the_final_one_unless_a_resume_checkpointed_past_it(tmp_path):
    run = create_run(RunConfig(output_dir=str(tmp_path / "runs")))
    assert run.adapter() is None
    (run.checkpoints_dir / "step-2").mkdir()  # a checkpoint with no adapter in it is no adapter
    assert run.adapter() is None
    _fake_adapter(run.checkpoints_dir / "step-3" / "adapter")
    assert run.adapter() == run.checkpoints_dir / "step-3" / "adapter"  # killed before the end
    _fake_adapter(run.adapter_dir, step=3)
    assert run.adapter() == run.adapter_dir  # finished (or stopped) at the newest checkpoint
    _fake_adapter(run.checkpoints_dir / "step-5" / "adapter")
    assert run.adapter() == run.checkpoints_dir / "step-5" / "adapter"  # resumed, then killed at 5
    (run.adapter_dir / "studio_step.json").unlink()
    assert run.adapter() == run.adapter_dir  # no step recorded: the final folder counts as final


def test_exported_adapter_is_a_peft_folder_without_the_checkpoint_state(tmp_path, tiny_dir):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(tiny_dir)
    run = create_run(config)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    step = run.checkpoints_dir / "step-4"
    model.save_pretrained(step / "adapter")  # as engine/checkpoint.py lays a checkpoint out
    torch.save({"state": {}}, step / "optimizer.pt")
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        expected = model(ids).logits

    dest = copy_adapter(run, tmp_path / "exported")
    assert sorted(p.name for p in dest.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "studio_config.yaml"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), dest)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
    with pytest.raises(FileExistsError, match="already exists"):
        copy_adapter(run, dest)
    with pytest.raises(FileNotFoundError, match="no saved adapter yet"):
        copy_adapter(create_run(config), tmp_path / "other")


def test_an_unexpected_failure_says_where_its_traceback_is_and_puts_it_there(tmp_path, tiny_dir, monkeypatch, capfd):
    """A failure no check foresaw (here a NotImplementedError without a message, as a GPU library
    raised one) is one line naming the run's log, and the traceback is on stderr: in a worker, that
    log. Before, the line pointed to a log that did not have it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from studio.engine import merge as engine_merge

    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.model.base_model = str(tiny_dir)
    run = create_run(config)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), LoraConfig(r=4, target_modules=["q_proj"])
                   ).save_pretrained(run.adapter_dir)

    def unforeseen(*args, **kwargs):
        raise NotImplementedError

    monkeypatch.setattr(engine_merge, "merge_adapter", unforeseen)
    result = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert not result.ok and result.message.startswith(f"exporting run {run.id} as merged failed: NotImplementedError")
    assert str(run.log_path) in result.message
    err = capfd.readouterr().err
    assert "Traceback" in err and "in unforeseen" in err and "NotImplementedError" in err
    assert not (tmp_path / "merged").exists()
