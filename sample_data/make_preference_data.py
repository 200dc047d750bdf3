"""Generate sample_data/preference/case_pairs.jsonl: preference pairs that ask for a letter case.

    python sample_data/make_preference_data.py        # rewrites the files in sample_data/preference/

Each row asks for a word written with dashes (``s-t-o-n-e``) either "in capitals" or "in small
letters"; the answer in the case asked for is ``chosen``, the same word in the other case is
``rejected``. Half the rows ask for each, so a model that ignores the instruction prefers the chosen
answer of about half the pairs, and only one that learned the preference gets near all of them:
the held-out preference accuracy shows what a DPO or ORPO run taught. Columns: instruction, input,
chosen, rejected, split (0 train, 1 validation, 2 test). Seeded: the same file on every run.

``case_pairs_chat.jsonl`` holds a few of the same pairs in the chat shape (a conversation, then
chosen and rejected final turns), to show that layout.

The files live in a subfolder: the tiny test model's tokenizer is trained on ``sample_data/*.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 2024
FOLDER = Path(__file__).resolve().parent / "preference"
CAPITALS = "Write the word in capitals."
SMALL = "Write the word in small letters."
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def case_pairs(n: int, seed: int = SEED, val_fraction: float = 0.1, test_fraction: float = 0.1) -> list[dict]:
    """``n`` distinct pairs (instruction / input / chosen / rejected / split), alternating the case asked."""
    rng = random.Random(seed)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 6)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    rows = []
    for i, word in enumerate(words):
        small, capitals = "-".join(word), "-".join(word.upper())
        ask_capitals = i % 2 == 0
        split = 2 if i < n_test else 1 if i < n_test + n_val else 0
        rows.append({"instruction": CAPITALS if ask_capitals else SMALL, "input": small,
                     "chosen": capitals if ask_capitals else small,
                     "rejected": small if ask_capitals else capitals, "split": split})
    return rows


def as_chat(row: dict) -> dict:
    """The same pair in the chat shape: a conversation, then the two final assistant turns."""
    return {"prompt": [{"role": "user", "content": f"{row['instruction']}\n{row['input']}"}],
            "chosen": [{"role": "assistant", "content": row["chosen"]}],
            "rejected": [{"role": "assistant", "content": row["rejected"]}], "split": row["split"]}


def main() -> None:
    """Write both files."""
    FOLDER.mkdir(exist_ok=True)
    rows = case_pairs(600)
    with open(FOLDER / "case_pairs.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    with open(FOLDER / "case_pairs_chat.jsonl", "w", encoding="utf-8") as out:
        out.writelines(json.dumps(as_chat(row)) + "\n" for row in rows[:40])
    print(f"wrote {len(rows)} pairs to {FOLDER / 'case_pairs.jsonl'} and 40 to {FOLDER / 'case_pairs_chat.jsonl'}")


if __name__ == "__main__":
    main()
