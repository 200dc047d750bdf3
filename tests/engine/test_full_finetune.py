"""Full fine-tuning (``lora: null``) on the tiny model, on the CPU: every weight trains and the run
learns the toy task, the run's result is the whole model (``model/``), a stopped run resumes
exactly, and chat, held-out scoring and export work on the run (base answers from the untouched base)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from studio.core import events as ev
from studio.core.config import RunConfig, parse_config
from studio.core.runs import RunDir, create_run, is_full_model
from studio.engine.evaluate import HeldOutScoring
from studio.engine.exporting import export_run
from studio.engine.session import Session

ROW = {"instruction": "Reverse the letters of the word.", "input": "s-t-o-n-e"}


def full_config(config: RunConfig, rows: Path, steps: int) -> RunConfig:
    """The tiny config as a full fine-tune: lora: null through the parser, as a person writes it."""
    text = config.to_yaml().replace("lora:\n", "old_lora:\n", 1)
    head, _, rest = text.partition("old_lora:\n")
    rest = rest.split("\n", 1)[1] if rest else rest
    while rest.startswith("  "):  # drop the old lora section's lines
        rest = rest.split("\n", 1)[1]
    parsed = parse_config(head + "lora: null\n" + rest)
    assert parsed.full_finetune and parsed.quantization.bits is None
    parsed.data.path = str(rows)
    t = parsed.trainer
    t.max_steps, t.learning_rate, t.eval_interval, t.checkpoint_interval = steps, 1e-3, 0, 4
    parsed.generation.temperature = 0.0
    return parsed


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from studio.engine.tiny import reverse_word_rows

    path = tmp_path_factory.mktemp("full") / "reverse.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reverse_word_rows(400, seed=0, test_fraction=0.02)))
    return path


@pytest.fixture(scope="module")
def trained(tiny_model: Path, rows: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 20-step full fine-tune trained in-process on the CPU: (run, session, events, answers before)."""
    from helpers.engine import engine_on_cpu, tiny_run_config

    with engine_on_cpu():
        config = full_config(tiny_run_config(tiny_model, rows, tmp_path_factory.mktemp("runs")), rows, 20)
        run = create_run(config)
        events: list[ev.Event] = []
        session = Session(config, run, events.append)
        session.load()
        before = session.generate(ROW).text
        session.train()
        yield run, session, events, before


def test_every_weight_trains_and_the_model_learns(trained) -> None:
    run, session, events, before = trained
    loaded = next(e for e in events if isinstance(e, ev.ModelLoaded))
    assert loaded.trainable_params == loaded.total_params > 0
    assert not hasattr(session.model, "peft_config")  # no adapter anywhere
    losses = [e.loss for e in events if isinstance(e, ev.StepLogged)]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    evals = [e.loss for e in events if isinstance(e, ev.EvalLogged)]
    assert evals[-1] < 0.75 * evals[0], evals  # step 0 (the base, 2.36) against the end (1.51)
    after = session.generate(ROW).text
    assert after != before
    assert session.generate(ROW, adapter=False).text == before  # base answers: the untouched base


def test_the_runs_result_is_the_whole_model_with_its_tokenizer(trained) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, session, events, _ = trained
    assert run.adapter() == run.model_dir and is_full_model(run.model_dir)
    assert not run.adapter_dir.exists()
    finished = [e for e in events if isinstance(e, ev.TrainingFinished)][-1]
    assert finished.adapter_path == str(run.model_dir)
    saved = AutoModelForCausalLM.from_pretrained(run.model_dir)
    AutoTokenizer.from_pretrained(run.model_dir)
    for name, param in session.model.named_parameters():
        assert torch.equal(dict(saved.named_parameters())[name], param.detach()), name
    assert (run.checkpoints_dir / "step-20" / "model" / "model.safetensors").exists()


def test_a_new_session_on_the_run_answers_with_the_trained_weights(trained) -> None:
    run, session, _, before = trained
    tuned = session.generate(ROW).text
    chat = Session(run.config(), run, lambda _e: None)
    assert chat.load_trained_adapter() == run.model_dir
    assert chat.generate(ROW).text == tuned
    assert chat.generate(ROW, adapter=False).text == before
    scored: list[ev.Event] = []
    scoring = HeldOutScoring(run, ev.ScoreHeldOut(request_id="r", rows=3, max_new_tokens=12),
                             lambda row, adapter, n: chat.generate(row, adapter=adapter, max_new_tokens=n).text,
                             scored.append)
    while not scoring.next_row():
        pass
    rows = [e for e in scored if isinstance(e, ev.HeldOutRowScored)]
    assert len(rows) == 3 and any(r.base != r.tuned for r in rows)
    assert (run.path / "eval.json").exists()


def test_export_merged_is_the_weights_and_adapter_is_refused_in_one_line(trained, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    run, session, _, _ = trained
    done = export_run(run, tmp_path / "merged", "merged", dtype="float32")
    assert done.ok, done.message
    weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    name, param = next(iter(session.model.named_parameters()))
    assert torch.equal(weights[name], param.detach())
    refused = export_run(run, tmp_path / "adapter", "adapter")
    assert not refused.ok and "full fine-tune" in refused.message and "--format merged" in refused.message
    assert "\n" not in refused.message and not (tmp_path / "adapter").exists()


def test_a_stopped_full_fine_tune_resumes_exactly(tiny_model: Path, rows: Path, tmp_path: Path, on_cpu) -> None:
    from helpers.engine import tiny_run_config

    config = full_config(tiny_run_config(tiny_model, rows, tmp_path / "runs"), rows, 8)
    config.trainer.micro_batch_size = 4  # two micro-batches a step: the accumulation is resumed too
    reference: list[ev.Event] = []
    Session(config, create_run(config, tmp_path / "reference"), reference.append).train()
    expected = {e.step: e.loss for e in reference if isinstance(e, ev.StepLogged)}

    run = create_run(config)
    Session(config, run, lambda _e: None, between_steps=lambda t: "stop" if t.step == 4 else None).train()
    saved = run.latest_checkpoint()
    assert saved is not None and saved.name == "step-4" and (saved / "model" / "config.json").exists()
    state = torch.load(saved / "optimizer.pt", weights_only=False)["state"]
    assert len(state) == len(_param_names(config))  # AdamW's m and v for every parameter
    assert all(set(s) >= {"exp_avg", "exp_avg_sq"} for s in state.values())
    events: list[ev.Event] = []
    Session(run.config(), RunDir(run.path), events.append).train(resume=True)
    got = {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}
    assert sorted(got) == [5, 6, 7, 8]
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step


def _param_names(config: RunConfig) -> list[str]:
    from transformers import AutoModelForCausalLM

    return [n for n, _ in AutoModelForCausalLM.from_pretrained(config.model.base_model).named_parameters()]
