"""No silent zero-token training: rows that would train on no token are counted, and a run whose
training rows all (or mostly) are such is refused before its first step, in one line that says how
many, why and what to do.

The bug this guards: a model folder whose tokenizer encoded every row to nothing trained 12 steps at
loss 0.0000 and said "training finished". Here a copy of the tiny model gets a tokenizer.json that
knows only its special tokens (every text encodes to no ids; the EOS is still appended, so each row
would train on that EOS alone and learn nothing of its text).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studio.cli import main as studio_main
from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.data.encoding import RowEncoder, Vocab, refusal, untrained

pytestmark = pytest.mark.usefixtures("on_cpu")

ROWS = [{"instruction": f"Reverse the word {w}.", "input": "", "output": w[::-1]}
        for w in ["stone", "river", "cloud", "apple", "tiger", "maple", "frost", "ember", "orbit", "candle"] * 2]


@pytest.fixture(scope="module")
def deaf_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose tokenizer encodes every text to nothing (special tokens only)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("deaf") / "tiny-deaf"
    shutil.copytree(tiny_model, folder)
    tok = Tokenizer(models.BPE(vocab={}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|pad|>", "<|bos|>", "<|eos|>")])
    tok.save(str(folder / "tokenizer.json"))
    assert tok.encode("Reverse the word stone.").ids == []
    return folder


def _data(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_tokenizer_that_encodes_every_row_to_nothing_is_named_in_one_line() -> None:
    config = RunConfig()
    config.model.base_model = "models/qwen-like"
    found = untrained(ROWS, RowEncoder(config, Vocab(lambda text: [], eos_id=2, eos_token="</s>"), "instruction"))
    assert (found.count, found.total, dict(found.reasons), found.refused) == (20, 20, {"tokenizer": 20}, True)
    line = refusal(found, config, "rows.jsonl")
    assert "\n" not in line
    assert line.startswith("rows.jsonl: all of the 20 training rows would train on no token (the tokenizer encodes "
                           "20 of them to no tokens)")
    assert "check the tokenizer files of model.base_model (models/qwen-like)" in line


def test_empty_responses_blame_the_template_and_a_few_are_counted_not_refused() -> None:
    config = RunConfig()
    vocab = Vocab(lambda text: list(text.encode()), eos_id=0)
    rows = [{**r, "output": "" if i < 12 else r["output"]} for i, r in enumerate(ROWS)]
    found = untrained(rows, RowEncoder(config, vocab, "instruction"))
    assert (found.count, dict(found.reasons), found.refused) == (12, {"template": 12}, True)
    assert "12 leave no response after the template (prompt.response_field 'output' is empty or not in the " \
           "template)" in refusal(found, config, "rows.jsonl")
    few = untrained(rows[9:], RowEncoder(config, vocab, "instruction"))
    assert (few.count, few.total, few.rows, few.refused) == (3, 11, [0, 1, 2], False)


def test_a_run_on_a_deaf_tokenizer_is_refused_before_its_first_step(deaf_model: Path, tmp_path: Path) -> None:
    from studio.core.runs import create_run
    from studio.engine.session import Session
    from studio.engine.train import Trainer, TrainingError

    config = RunConfig()
    config.model.base_model, config.quantization.bits = str(deaf_model), None
    config.data.path, config.output_dir = str(_data(tmp_path, ROWS)), str(tmp_path / "runs")
    config.trainer.max_steps, config.trainer.micro_batch_size, config.trainer.gradient_checkpointing = 3, 4, False
    events: list[ev.Event] = []
    with pytest.raises(TrainingError):
        Trainer(Session(config, create_run(config), events.append)).train()
    failed = [e for e in events if isinstance(e, ev.WorkerFailed)]
    assert len(failed) == 1 and failed[0].fatal and failed[0].kind == "data"
    assert "all of the 18 training rows would train on no token (the tokenizer encodes 18 of them to no tokens)" \
        in failed[0].message
    assert "\n" not in failed[0].message
    assert not [e for e in events if isinstance(e, (ev.StepLogged, ev.TrainingFinished))]


def test_config_check_refuses_the_deaf_tokenizer_and_counts_a_few_empty_rows(
        deaf_model: Path, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  base_model: {deaf_model}\ndata:\n  path: {_data(tmp_path, ROWS)}\n")
    assert studio_main(["config", "check", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "would train on no token (the tokenizer encodes 18 of them to no tokens)" in err
    rows = [{**r, "output": ""} if i in (3, 7) else r for i, r in enumerate(ROWS)]
    config.write_text(f"model:\n  base_model: {tiny_model}\ndata:\n  path: {_data(tmp_path, rows)}\n"
                      "  val_fraction: 0\n")
    assert studio_main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "2 of 20 training rows train on no token (2 by the template; the first is training row 3)" in out
