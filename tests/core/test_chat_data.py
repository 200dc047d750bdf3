"""Chat datasets in the data layer: detection in both shapes, the bundled sample, and lint."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from studio.core.data import load_table
from studio.core.data.fields import chat_column
from studio.core.data.stats import lint_rows
from studio.core.paths import sample_data_dir
from studio.core.prompt import chat

SHAREGPT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."}]
OPENAI = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_shapes_are_detected_and_read_with_openai_roles(tmp_path: Path) -> None:
    share = load_table(_jsonl(tmp_path / "share.jsonl", [{"id": 1, "conversations": SHAREGPT}]))
    assert chat_column(share) == ("conversations", "sharegpt")
    turns = chat.parse_turns(share[0]["conversations"])
    assert [(t.role, t.content) for t in turns] == [("system", "Be brief."), ("user", "Hi?"),
                                                    ("assistant", "Hello.")]
    # A CSV column holding the conversation as JSON text, under a name of its own (mapped).
    path = tmp_path / "chat.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["dialog_json", "note"])
        writer.writerow([json.dumps(OPENAI), "x"])
    table = load_table(path)
    assert chat_column(table) == ("dialog_json", "openai")
    assert chat_column(table, {"messages": "note"}) is None, "a mapping names the one column to read"
    instruction = load_table(_jsonl(tmp_path / "plain.jsonl", [{"instruction": "a", "output": "b"}]))
    assert chat_column(instruction) is None


def test_the_bundled_chat_sample_is_what_its_generator_makes_and_lints_clean() -> None:
    path = sample_data_dir() / "code_chat_sample.jsonl"
    made = subprocess.run([sys.executable, str(sample_data_dir() / "make_chat_sample.py"), "--out", "/dev/stdout"],
                          capture_output=True, text=True, check=True).stdout
    assert made.splitlines()[:-1] == path.read_text().splitlines(), "regenerate: python sample_data/make_chat_sample.py"
    table = load_table(path)
    assert chat_column(table) == ("messages", "openai")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["split"] for r in rows} == {0, 1, 2}
    assert any(len(r["messages"]) >= 6 for r in rows), "multi-turn conversations"
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert lint_rows(table, tokenize=lambda text: text.split(), max_seq_length=512) == []


def test_lint_names_empty_turns_wrong_order_and_long_conversations(tmp_path: Path) -> None:
    rows = [
        {"messages": OPENAI},                                                               # 0 fine
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "  "}]},  # 1 empty
        {"messages": [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q"}]},  # 2 order
        {"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},
                      {"role": "assistant", "content": "A"}]},                              # 3 late system
        {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "A"}]},  # 4
        {"messages": [{"role": "narrator", "content": "x"}]},                               # 5 unknown role
    ]
    issues = lint_rows(load_table(_jsonl(tmp_path / "c.jsonl", rows)), tokenize=lambda t: t.split(),
                       max_seq_length=100)
    found = {(i.kind, i.row) for i in issues}
    assert ("empty_turn", 1) in found
    assert ("role_order", 2) in found and ("role_order", 3) in found
    assert ("too_long", 4) in found and ("not_a_conversation", 5) in found
    assert not any(i.row == 0 for i in issues)
    late = next(i for i in issues if i.row == 3)
    assert "turn 2 is a system turn" in late.message
    unknown = next(i for i in issues if i.row == 5)
    assert "'narrator'" in unknown.message and "system, user, assistant or tool" in unknown.message


def test_held_out_table_labels_a_conversation_by_its_last_question() -> None:
    from studio.ui.panes.chat import row_label

    asked = [*OPENAI, {"role": "user", "content": "And in French?"}]
    assert row_label({"messages": json.dumps(asked)}, "") == "4 turns · And in French?"
    assert row_label({"instruction": "Reverse it.", "input": "abc"}, "output") == "abc · Reverse it."


def test_the_chat_sample_has_a_config_that_fits_every_conversation(capsys) -> None:
    """sample_data/chat_config.yaml starts with its command, checks clean, and its max length holds
    every conversation rendered with SmolLM2's own chat template (the sample SFT config's 256 cut 24)."""
    from helpers.tokenizers import smol_tokenizer

    from studio.cli import main as studio
    from studio.core.config import load_config

    path = sample_data_dir() / "chat_config.yaml"
    assert path.read_text().splitlines()[0] == "# studio train sample_data/chat_config.yaml"
    config = load_config(path)
    assert config.prompt.template == "chat" and config.model.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer = smol_tokenizer()
    table = load_table(sample_data_dir() / "code_chat_sample.jsonl")

    def too_long(max_len: int) -> list:
        return [issue for issue in lint_rows(table, tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False),
                                             max_seq_length=max_len, chat_template=tokenizer.chat_template)
                if issue.kind == "too_long"]

    assert too_long(config.data.max_seq_length) == []
    assert len(too_long(load_config(sample_data_dir() / "sample_config.yaml").data.max_seq_length)) == 24
    assert studio(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok:" in out and "conversations (OpenAI messages), through the model's chat template" in out and "warning" not in out
