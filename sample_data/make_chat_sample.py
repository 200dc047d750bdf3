"""Generate sample_data/code_chat_sample.jsonl: the checked Python tasks as multi-turn conversations.

    python sample_data/make_chat_sample.py            # rewrites the JSONL beside this script

Each line is an OpenAI-style chat row, ``{"messages": [{"role", "content"}, ...], "split": 0|1|2}``:
one to three exchanges (the user asks a task, the assistant answers with code), a third of them
opened by a system turn. The tasks and answers are make_sample_data.py's, which runs and checks
every answer; rows only join conversations within their split, so held-out answers stay held out.
Train with ``prompt.template: chat`` (the model's own chat template).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_sample_data import SEED, make_rows  # noqa: E402  (the sibling generator, run as a script)

OUTPUT = Path(__file__).resolve().parent / "code_chat_sample.jsonl"
SYSTEM = "You are a concise Python assistant. Answer with code only."
FOLLOW_UPS = ("Next one: ", "Now this: ", "Another task. ", "")


def _ask(row: dict[str, Any]) -> str:
    text = row["instruction"]
    return text + (f"\n\n{row['input']}" if row.get("input") else "")


def make_conversations(seed: int = SEED) -> list[dict[str, Any]]:
    """Conversations of 1-3 exchanges from the checked rows, grouped within each split (seeded)."""
    rng = random.Random(seed + 7)
    rows = make_rows(seed)
    out: list[dict[str, Any]] = []
    for split in (0, 1, 2):
        pool = [r for r in rows if r["split"] == split]
        rng.shuffle(pool)
        while pool:
            size = min(len(pool), rng.choice((1, 2, 2, 3)))
            exchange, pool = pool[:size], pool[size:]
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
            for number, row in enumerate(exchange):
                lead = rng.choice(FOLLOW_UPS) if number else ""
                messages.append({"role": "user", "content": lead + _ask(row)})
                messages.append({"role": "assistant", "content": row["output"]})
            out.append({"messages": messages, "split": split})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help="where to write the JSONL")
    args = parser.parse_args(argv)
    conversations = make_conversations()
    with open(args.out, "w", encoding="utf-8") as handle:
        for row in conversations:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    turns = sum(len(c["messages"]) for c in conversations)
    print(f"wrote {len(conversations)} conversations ({turns} turns) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
