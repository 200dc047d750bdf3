"""Generate sample_data/grpo/copy_words.jsonl: prompts for GRPO, checked by a program.

    python sample_data/make_grpo_data.py        # rewrites the files in sample_data/grpo/

Each row asks the model to repeat a five-letter word written with dashes (``s-t-o-n-e``); the
``word`` column holds the right answer, which the rewards read: ``exact_match`` on it and
``rewards.py:letters_right`` (the fraction of letters in their place). Nothing in a row is an
answer to learn from: GRPO samples completions and the rewards judge them. Columns: instruction,
input, word, split (0 train, 1 validation, 2 test). Seeded: the same file on every run.

``copy_words_chat.jsonl`` holds the same prompts in TRL's conversational shape (a ``prompt`` column
of messages whose last turn is the user's, beside ``word``), for ``prompt.template: chat``.

The files live in a subfolder: the tiny test model's tokenizer is trained on ``sample_data/*.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 2025
FOLDER = Path(__file__).resolve().parent / "grpo"
INSTRUCTION = "Repeat the letters of the word."
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def copy_rows(n: int, seed: int = SEED, letters: int = 5, val_fraction: float = 0.05,
              test_fraction: float = 0.05) -> list[dict]:
    """``n`` distinct rows (instruction / input / word / split), each word ``letters`` long."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        word = "".join(rng.choice(_LETTERS) for _ in range(letters))
        if word not in seen:
            seen.add(word)
            words.append(word)
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    rows = []
    for i, word in enumerate(words):
        dashed = "-".join(word)
        split = 2 if i < n_test else 1 if i < n_test + n_val else 0
        rows.append({"instruction": INSTRUCTION, "input": dashed, "word": dashed, "split": split})
    return rows


def as_chat(row: dict) -> dict:
    """The same prompt in TRL's conversational shape: a user turn, the answer column beside it."""
    return {"prompt": [{"role": "user", "content": f"{row['instruction']}\n{row['input']}"}],
            "word": row["word"], "split": row["split"]}


def main() -> None:
    """Write both files."""
    FOLDER.mkdir(exist_ok=True)
    rows = copy_rows(800)
    with open(FOLDER / "copy_words.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    with open(FOLDER / "copy_words_chat.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(as_chat(row)) + "\n" for row in rows[:40])
    print(f"wrote {len(rows)} rows to {FOLDER / 'copy_words.jsonl'} and 40 to {FOLDER / 'copy_words_chat.jsonl'}")


if __name__ == "__main__":
    main()
