"""What 2026 users bring, with no template of their own: TRL's preference shapes (standard and
conversational) and raw text for continued pretraining, read by `studio config check` and trained by
the engine on the tiny model (CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studio.cli import main as studio_main
from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.data import load_splits
from studio.core.data.encoding import RowEncoder, Vocab
from studio.core.data.pairs import split_shared_start
from studio.core.prompt.tokens import load_tokenizer_info

pytestmark = pytest.mark.usefixtures("on_cpu")

# Letter-case pairs in TRL's standard shape: the prompt asks, the chosen answer obeys.
WORDS = ["stone", "river", "cloud", "apple", "tiger", "maple", "frost", "candle", "ember", "orbit"]
STANDARD = [{"prompt": f"Write {w} in capitals: ", "chosen": w.upper(), "rejected": w} for w in WORDS * 4]
CONVERSATIONAL = [{"prompt": [{"role": "user", "content": f"Write {w} in capitals."}],
                   "chosen": [{"role": "assistant", "content": w.upper()}],
                   "rejected": [{"role": "assistant", "content": w}]} for w in WORDS * 4]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(model: Path, data: Path, out: Path, method: str = "sft") -> RunConfig:
    """No prompt section: the template is the default preset."""
    config = RunConfig()
    config.model.base_model = str(model)
    config.quantization.bits = None
    config.data.path, config.data.max_seq_length = str(data), 64
    config.output_dir = str(out)
    t = config.trainer
    t.method, t.beta = method, 0.1
    t.max_steps, t.micro_batch_size, t.effective_batch_size, t.learning_rate = 4, 4, 4, 5e-3
    t.eval_interval, t.checkpoint_interval, t.gradient_checkpointing = 0, 0, False
    return config


@pytest.fixture(scope="module")
def chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a ChatML chat template in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat-model") / "tiny-chat"
    shutil.copytree(tiny_model, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHATML
    config_path.write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------------------------ reading the data


def test_trl_standard_pairs_with_no_template_render_as_prompt_then_answer(tmp_path: Path) -> None:
    config = RunConfig()
    config.data.path, config.trainer.method = str(_write(tmp_path / "pairs.jsonl", STANDARD)), "dpo"
    splits = load_splits(config)
    assert splits.shape.label == "preference pairs (TRL standard)"
    adapted = splits.shape.adapt(config)
    assert (adapted.prompt.template, adapted.prompt.response_field, adapted.prompt.rejected_field) == (
        "{prompt}{chosen}", "chosen", "rejected")
    vocab = Vocab(lambda text: list(text.encode()), eos_id=0, eos_token="</s>")
    chosen, rejected = RowEncoder(adapted, vocab, splits.shape.kind).render(splits.train[0])
    row = splits.train[0]
    assert (chosen.text, chosen.response) == (row["prompt"] + row["chosen"], row["chosen"])
    assert (rejected.text, rejected.response) == (row["prompt"] + row["rejected"], row["rejected"])


def test_trl_standard_pairs_with_template_chat_put_the_prompt_in_the_user_turn(tmp_path: Path) -> None:
    config = RunConfig()
    config.data.path, config.trainer.method = str(_write(tmp_path / "pairs.jsonl", STANDARD)), "orpo"
    config.prompt.template = "chat"
    splits = load_splits(config)
    adapted = splits.shape.adapt(config)
    vocab = Vocab(lambda text: list(text.encode()), eos_token="<|im_end|>", chat_template=CHATML)
    chosen, _rejected = RowEncoder(adapted, vocab, splits.shape.kind).render(splits.train[0])
    row = STANDARD[0]
    assert chosen.text == (f"<|im_start|>user\n{row['prompt']}<|im_end|>\n"
                           f"<|im_start|>assistant\n{row['chosen']}<|im_end|>\n")
    assert chosen.response == f"{row['chosen']}<|im_end|>\n"


def test_trl_standard_pairs_without_a_prompt_share_their_start_as_the_prompt(tmp_path: Path) -> None:
    assert split_shared_start("The cat sat.", "The car sat.") == ("The", " cat sat.", " car sat.")
    rows = [{"chosen": f"Q: capital of {c}? A: {a}", "rejected": f"Q: capital of {c}? A: Rome"}
            for c, a in (("France", "Paris"), ("Spain", "Madrid"), ("Peru", "Lima"))]
    config = RunConfig()
    config.data.path, config.trainer.method = str(_write(tmp_path / "pairs.jsonl", rows)), "dpo"
    config.data.val_fraction = 0.0
    splits = load_splits(config)
    assert splits.shape.label == "preference pairs (TRL standard, prompt shared by chosen and rejected)"
    assert splits.train[0] == {"prompt": "Q: capital of France? A:", "chosen": " Paris", "rejected": " Rome"}


def test_trl_conversational_pairs_keep_their_messages_and_an_implicit_prompt(tmp_path: Path) -> None:
    config = RunConfig()
    config.data.path, config.trainer.method = str(_write(tmp_path / "chat.jsonl", CONVERSATIONAL)), "dpo"
    splits = load_splits(config)
    assert splits.shape.label == "preference pairs (TRL conversational)"
    assert splits.train[0]["prompt"] == [{"role": "user", "content": "Write stone in capitals."}]
    assert splits.train[0]["chosen"] == [{"role": "assistant", "content": "STONE"}]
    # Whole conversations sharing their start: the shared turns are the prompt.
    whole = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONVERSATIONAL]
    config.data.path = str(_write(tmp_path / "whole.jsonl", whole))
    again = load_splits(config)
    assert again.shape.kind == "chat_pairs" and again.train == splits.train


@pytest.mark.parametrize("form", ["jsonl", "csv", "parquet", "saved", "txt", "folder"])
def test_text_alone_is_raw_text_in_every_form(tmp_path: Path, form: str) -> None:
    import datasets

    docs = [f"Document {i}. " + "Some words follow here. " * (i + 1) for i in range(10)]
    table = datasets.Dataset.from_dict({"text": docs})
    if form == "jsonl":
        path = _write(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    elif form == "csv":
        path = tmp_path / "docs.csv"
        table.to_csv(str(path), index=False)
    elif form == "parquet":
        path = tmp_path / "docs.parquet"
        table.to_parquet(str(path))
    elif form == "saved":
        path = tmp_path / "saved"
        table.save_to_disk(str(path))
    elif form == "txt":
        path = tmp_path / "book.txt"
        path.write_text("\n\n".join(docs))
        docs = ["\n\n".join(docs)]
    else:
        path = tmp_path / "corpus"
        path.mkdir()
        for i, doc in enumerate(docs):
            (path / f"{i:02d}.txt").write_text(doc)
    config = RunConfig()
    config.data.path, config.data.val_fraction = str(path), 0.0
    splits = load_splits(config)
    assert splits.shape.kind == "text"
    assert splits.shape.adapt(config).prompt.template == "text"
    assert sorted(row["text"] for row in splits.train) == sorted(docs)


def test_raw_text_is_cut_into_blocks_and_every_token_trains(tmp_path: Path) -> None:
    config = RunConfig()
    config.prompt.template, config.prompt.response_field, config.data.max_seq_length = "text", "text", 16
    vocab = Vocab(lambda text: list(text.encode()), eos_id=0, bos_id=1)
    document = "abcdefghij" * 4
    blocks = RowEncoder(config, vocab, "text").encode({"text": document})
    ids = [1, *document.encode(), 0]
    assert [len(b.input_ids) for b in blocks] == [16, 16, 10]
    assert [i for b in blocks for i in b.input_ids] == ids, "nothing is dropped"
    assert all(b.labels == b.input_ids and not b.truncated for b in blocks), "every token is trained"


def test_a_text_column_beside_instruction_columns_is_not_mistaken_for_raw_text(tmp_path: Path) -> None:
    rows = [{"instruction": "Say hi", "input": "", "output": "hi", "text": "note"}] * 3
    config = RunConfig()
    config.data.path = str(_write(tmp_path / "rows.jsonl", rows))
    assert load_splits(config).shape.kind == "instruction"


def test_config_check_names_the_shape(tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture) -> None:
    cases = {"pairs.jsonl": (STANDARD, "dpo", "preference pairs (TRL standard)"),
             "chat.jsonl": (CONVERSATIONAL, "orpo", "preference pairs (TRL conversational)"),
             "docs.jsonl": ([{"text": f"doc {i}"} for i in range(10)], "sft", "raw text")}
    for name, (rows, method, label) in cases.items():
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"model:\n  base_model: {tiny_model}\ndata:\n  path: {_write(tmp_path / name, rows)}\n"
                          f"trainer:\n  method: {method}\n")
        code = studio_main(["config", "check", str(config)])
        out, err = capsys.readouterr()
        if name == "chat.jsonl":  # the tiny model has no chat template: said in one line
            assert code == 2 and "conversational preference pairs render through the model's chat template" in err
            continue
        assert code == 0, err
        assert label in out.splitlines()[0]
        assert "every training row trains on at least one token" in out


# ---------------------------------------------------------------------------------- training


def _train(config: RunConfig) -> tuple[object, list[ev.Event]]:
    from studio.core.runs import create_run
    from studio.engine.session import Session

    events: list[ev.Event] = []
    session = Session(config, create_run(config), events.append)
    session.train()
    assert not [e for e in events if isinstance(e, ev.WorkerFailed) and e.fatal]
    return session, events


def test_dpo_trains_trl_standard_pairs_with_no_template(tiny_model: Path, tmp_path: Path) -> None:
    config = _config(tiny_model, _write(tmp_path / "pairs.jsonl", STANDARD), tmp_path / "runs", "dpo")
    session, events = _train(config)
    pair = session.data.train[0]
    tok = session.tokenizer
    text = tok.decode(pair.chosen.input_ids, skip_special_tokens=True)
    assert text.startswith("Write ") and " in capitals: " in text, "prompt, then the chosen answer"
    steps = [e for e in events if isinstance(e, ev.PreferenceLogged) and e.split == "train"]
    assert len(steps) == 4 and steps[0].loss == pytest.approx(0.6931, abs=1e-3), "DPO starts at log 2"


def test_orpo_trains_trl_conversational_pairs_through_the_chat_template(chat_model: Path, tmp_path: Path) -> None:
    config = _config(chat_model, _write(tmp_path / "chat.jsonl", CONVERSATIONAL), tmp_path / "runs", "orpo")
    session, events = _train(config)
    tok = session.tokenizer
    pair = session.data.train[0]
    whole = tok.decode(pair.chosen.input_ids)
    learned = tok.decode([i for i, lab in zip(pair.chosen.input_ids, pair.chosen.labels, strict=True) if lab != -100])
    word = next(w for w in WORDS if f"Write {w} " in whole)
    assert whole == tok.apply_chat_template(
        [{"role": "user", "content": f"Write {word} in capitals."}, {"role": "assistant", "content": word.upper()}],
        tokenize=False)
    assert learned.startswith(word.upper()) and "Write" not in learned, "the loss is on the answer's turn only"
    assert [e.method for e in events if isinstance(e, ev.PreferenceLogged) and e.split == "train"] == ["orpo"] * 4


def test_raw_text_trains_packed_with_every_token_in_the_loss(tiny_model: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"{i:02d}.txt").write_text(f"Story {i}. " + "The river ran past the stone. " * (3 + i))
    config = _config(tiny_model, corpus, tmp_path / "runs")
    assert config.trainer.packing
    session, events = _train(config)
    assert session.data.kind == "text"
    assert all(e.labels == e.input_ids for e in session.data.train), "every token of every block is trained"
    assert max(len(e.input_ids) for e in session.data.train) == 64 < sum(len(e.input_ids) for e in session.data.train)
    batch = session.trainer.stream.collate(session.trainer.stream.units(0)[:4], 0)
    assert batch.attention_mask is None, "packed rows"
    losses = [e.loss for e in events if isinstance(e, ev.StepLogged)]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    info = load_tokenizer_info(str(tiny_model))
    assert info.eos_id in {i for e in session.data.train for i in e.input_ids}, "documents end with EOS"


def test_the_run_records_the_prompt_settings_its_data_trains_with(tmp_path: Path, tiny_model: Path) -> None:
    """`studio train` writes the shape's prompt settings into runs/<id>/config.yaml (exports read the
    template from it); the worker reading that config back finds the same shape."""
    import argparse

    from studio.cli.train import prepare_config
    from studio.core.runs import create_run

    _write(tmp_path / "pairs.jsonl", STANDARD)
    (tmp_path / "run.yaml").write_text(f"model:\n  base_model: {tiny_model}\ndata:\n  path: pairs.jsonl\n"
                                       f"trainer:\n  method: dpo\noutput_dir: {tmp_path / 'runs'}\n")
    config, _ = prepare_config(argparse.Namespace(config=str(tmp_path / "run.yaml")))
    saved = create_run(config).config()
    assert (saved.prompt.template, saved.prompt.response_field) == ("{prompt}{chosen}", "chosen")
    again = load_splits(saved)
    assert again.shape.label == "preference pairs (TRL standard)" and again.shape.adapt(saved) == saved


@pytest.mark.parametrize("template", ["alpaca", "chat"])
def test_a_config_adapted_to_its_pairs_reads_them_the_same_again(tmp_path: Path, template: str) -> None:
    config = RunConfig()
    config.data.path, config.trainer.method = str(_write(tmp_path / "pairs.jsonl", STANDARD)), "dpo"
    config.prompt.template = template
    first = load_splits(config)
    adapted = first.shape.adapt(config)
    again = load_splits(adapted)
    assert again.shape.label == first.shape.label == "preference pairs (TRL standard)"
    assert again.shape.adapt(adapted) == adapted and again.train == first.train
