"""Chat datasets end to end on the tiny model: read in both shapes, trained with loss on assistant
turns only, evaluated before training (step 0), and compared held-out on the last assistant turn."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studio.core import events as ev
from studio.core.data import DataError, load_splits
from studio.core.prompt import IGNORE_INDEX
from studio.core.runs import create_run
from studio.engine.evaluate import HeldOutScoring
from studio.engine.session import Session

# A ChatML-like template over the tiny tokenizer's own special tokens.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token + 'assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_chat_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template in its tokenizer config."""
    folder = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TINY_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _conversations(reverse_rows: list[dict], shape: str) -> list[dict]:
    """Reverse-word rows as two-exchange conversations (a system turn first in the OpenAI shape)."""
    out = []
    for a, b in zip(reverse_rows[::2], reverse_rows[1::2], strict=False):
        turns = [("user", f"Reverse: {a['input']}"), ("assistant", a["output"]),
                 ("user", f"Reverse: {b['input']}"), ("assistant", b["output"])]
        if shape == "openai":
            messages = [{"role": "system", "content": "Reverse words."}]
            messages += [{"role": role, "content": text} for role, text in turns]
            out.append({"messages": messages, "split": b["split"]})
        else:
            names = {"user": "human", "assistant": "gpt"}
            out.append({"conversations": [{"from": names[r], "value": t} for r, t in turns], "split": b["split"]})
    return out


@pytest.mark.parametrize("shape", ["openai", "sharegpt"])
def test_chat_rows_are_read_in_both_shapes(tiny_config, reverse_rows, tmp_path: Path, shape: str) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _conversations(reverse_rows[:200], shape)))
    tiny_config.data.path = str(path)
    tiny_config.prompt.template = "alpaca"
    with pytest.raises(DataError, match="prompt.template: chat"):
        load_splits(tiny_config)
    tiny_config.prompt.template = "chat"
    splits = load_splits(tiny_config)
    first = splits.train[0]["messages"]
    assert [m["role"] for m in first][-4:] == ["user", "assistant", "user", "assistant"]
    assert first[-1]["content"] and "-" in first[-1]["content"]


def test_chat_training_learns_the_assistant_turns(tiny_chat_model, tiny_config, reverse_rows, tmp_path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _conversations(reverse_rows[:1200], "openai")))
    config = tiny_config
    config.model.base_model = str(tiny_chat_model)
    config.data.path = str(path)
    config.data.max_seq_length = 96
    config.prompt.template = "chat"
    config.trainer.max_steps = 40
    config.trainer.eval_interval = 20
    config.trainer.checkpoint_interval = 0
    run = create_run(config)
    events: list[ev.Event] = []
    session = Session(config, run, events.append)
    session.load()
    tok = session.tokenizer
    example = session.data.train[0]
    learned = tok.decode([i for i, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX])
    assert "Reverse" not in learned and "system" not in learned, "no loss on user or system turns"
    assert learned.count(tok.eos_token) == 2, "both assistant turns, each with its end of turn"

    session.train()
    evals = [e for e in events if isinstance(e, ev.EvalLogged)]
    steps = [e for e in events if isinstance(e, ev.StepLogged)]
    assert evals[0].step == 0 and events.index(evals[0]) < events.index(steps[0]), "base eval before step 1"
    assert evals[0].rows > 0 and 0.0 <= evals[0].token_accuracy <= 1.0
    assert evals[-1].step == 40 and evals[-1].loss < evals[0].loss * 0.8
    finished = next(e for e in events if isinstance(e, ev.TrainingFinished))
    assert finished.best_eval_loss == pytest.approx(min(e.loss for e in evals[1:])), "the base is no 'best'"

    # Held-out: the target is the last assistant turn, the prompt every turn before it.
    request = ev.ScoreHeldOut(request_id="r", rows=3, adapter=True, max_new_tokens=8)
    answered: list[dict] = []

    def generate(fields: dict, adapter: bool, max_new: int | None) -> str:
        answered.append(fields)
        return session.generate(fields, adapter=adapter, max_new_tokens=max_new).text

    scored: list[ev.Event] = []
    scoring = HeldOutScoring(run, request, generate, scored.append, render=session.render_prompt)
    while not scoring.next_row():
        pass
    rows = [e for e in scored if isinstance(e, ev.HeldOutRowScored)]
    assert len(rows) == 3
    held_out = load_splits(config).test[0]["messages"]
    assert rows[0].target == held_out[-1]["content"]
    prior = json.loads(answered[0]["messages"])
    assert prior == held_out[:-1] and prior[-1]["role"] == "user"
    assert rows[0].prompt.endswith("assistant\n") and held_out[-2]["content"] in rows[0].prompt
