"""``studio embed``: embeddings from the fine-tuned model separate the two kinds of rows of a toy task
that the base model was never taught, better than the base model's embeddings do."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers.cli import run_studio

torch = pytest.importorskip("torch")

from helpers.engine import engine_on_cpu  # noqa: E402

from studio.core import events as ev  # noqa: E402
from studio.core.runs import RunDir, create_run  # noqa: E402
from studio.engine.embed import embed_run, pool  # noqa: E402

pytestmark = pytest.mark.usefixtures("on_cpu")  # thresholds calibrated in fp32 (conftest.on_cpu)

QUESTION = "Does the word contain the letter a?"


def _rows(n: int, seed: int) -> list[dict]:
    """Dashed words, half with an "a" somewhere in them (answer yes) and half without (no)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        has_a = len(rows) % 2 == 0
        letters = "abcdefghijklmnopqrstuvwxyz" if has_a else "bcdefghijklmnopqrstuvwxyz"
        word = [rng.choice(letters) for _ in range(rng.randint(3, 5))]
        if has_a and "a" not in word:
            word[rng.randrange(len(word))] = "a"
        rows.append({"instruction": QUESTION, "input": "-".join(word), "output": "yes" if has_a else "no"})
    return rows


def _separation(vectors: torch.Tensor, labels: list[bool]) -> float:
    """Distance between the two class means over the mean distance of rows to their own class mean."""
    mask = torch.tensor(labels)
    yes, no = vectors[mask], vectors[~mask]
    spread = torch.cat([(yes - yes.mean(0)).norm(dim=1), (no - no.mean(0)).norm(dim=1)]).mean()
    return float((yes.mean(0) - no.mean(0)).norm() / spread)


@pytest.fixture(scope="module")
def tuned_run(make_tiny_config, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, Path, list[bool]]:
    from studio.engine.session import Session

    folder = tmp_path_factory.mktemp("embed")
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(600, seed=1)))
    held_out = folder / "held_out.jsonl"
    rows = _rows(60, seed=2)
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = make_tiny_config(folder / "runs")
    config.data.path = str(train)
    config.data.val_fraction = 0.0
    # The model has to learn the answers for its embeddings to part the two kinds. With the tiny config's
    # 100 steps at lr 6e-3 it often had not (train loss ~0.35: ln 2 over the answer and EOS tokens, yes
    # or no a coin flip), and the tuned separation was wherever the seed and the machine's rounding left
    # an untaught LoRA: 1.38 / 0.54 / 0.24 with seeds 42 / 0 / 1 here, 0.31 on the GPU box, against the
    # base's 0.50; lr 6e-3 stalled that way even after 600 steps in one seed of four, lr 1.5e-2 always.
    # lr 2e-3 for 300 steps learned them (loss 0.003) in all 7 runs tried.
    config.trainer.learning_rate = 2e-3
    config.trainer.max_steps = 300
    config.trainer.eval_interval = 0
    run = create_run(config)
    with engine_on_cpu():
        Session(config, run, lambda _e: None).train()
    return run, held_out, [r["output"] == "yes" for r in rows]


def test_pool_mean_ignores_padding_and_last_takes_the_last_real_token() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert pool(hidden, mask, "mean").tolist() == [[1.0, 2.0], [8.0, 9.0]]
    assert pool(hidden, mask, "last").tolist() == [[2.0, 3.0], [10.0, 11.0]]


def test_tuned_embeddings_separate_the_two_kinds_of_rows_better(tuned_run, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    run, held_out, labels = tuned_run
    separation = {}
    for base in (True, False):
        out = tmp_path / f"{'base' if base else 'tuned'}.parquet"
        events: list[ev.Event] = []
        result = embed_run(run, ev.Embed(data=str(held_out), out=str(out), pool="last", base=base,
                                         batch_size=16), events.append)
        assert result.ok, result.message
        assert [e.stage for e in events if isinstance(e, ev.ExportProgress)].count("embedding rows 16/60") == 1
        table = pq.read_table(out)
        assert table.num_rows == len(labels)
        assert table.column("input").to_pylist()[0] == json.loads(held_out.read_text().splitlines()[0])["input"]
        vectors = torch.tensor(table.column("embedding").to_pylist())
        assert vectors.shape == (len(labels), 128)
        separation[base] = _separation(vectors, labels)
    print(f"class separation (between-mean distance / within spread): base {separation[True]:.3f}, "
          f"tuned {separation[False]:.3f}")
    # Measured (last-token pooling, the state the answer comes from): base 0.50; tuned 8.7 / 10.5 / 14.7
    # with seeds 42 / 0 / 1, and 8.7-15.3 (seeds 42, 1, 2, 3) from a base whose weights were nudged by 1e-4
    # of their size, as another machine's pre-training rounding would leave them.
    assert separation[False] > 10 * separation[True]


def test_rows_without_the_template_fields_or_a_wrong_layer_are_clear_messages(tuned_run, tmp_path: Path) -> None:
    run, held_out, _ = tuned_run
    data = tmp_path / "other.jsonl"
    data.write_text(json.dumps({"question": "hi"}) + "\n")
    result = embed_run(run, ev.Embed(data=str(data), out=str(tmp_path / "o.parquet")), lambda _e: None)
    assert not result.ok and "needs instruction" in result.message and "'text' column" in result.message
    result = embed_run(run, ev.Embed(data=str(held_out), out=str(tmp_path / "o.parquet"), layer=9), lambda _e: None)
    assert not result.ok and "--layer 9: this model has layers 0..2" in result.message
    assert not (tmp_path / "o.parquet").exists()


def test_studio_embed_runs_through_the_worker(tuned_run, tmp_path: Path, studio_env: dict) -> None:

    import pyarrow.parquet as pq

    run, held_out, labels = tuned_run
    env = {**studio_env, "STUDIO_LOCK_DIR": str(tmp_path / "locks"), "STUDIO_WORKER_LINGER": "3"}
    out = tmp_path / "emb.parquet"
    done = run_studio("embed", str(run.path), "--data", str(held_out), "--out", str(out), "--layer", "1", "--base", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "60 rows x 128 dims from layer 1 (mean pooling, base model)" in done.stderr
    assert pq.read_table(out).num_rows == len(labels)
    wrong = run_studio("embed", str(run.path), "--data", str(held_out), "--out", str(tmp_path / "emb.csv"), env=env, timeout=60)
    assert wrong.returncode == 1 and wrong.stderr.strip().endswith("the output is a Parquet file; name it *.parquet")
