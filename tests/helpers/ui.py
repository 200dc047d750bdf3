"""Shared set-up for the UI tests: a tokenizer trained here, small datasets, and waiting for the app.

The tokenizer is trained with ``tokenizers`` on the bundled sample data (deterministic, ~1 s), so
token counts in tests and snapshots do not depend on any model being downloaded.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.paths import cache_dir, sample_data_dir

SAMPLE = sample_data_dir() / "code_alpaca_sample.jsonl"


def make_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with an EOS) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "tokenizer.json").exists():
        return folder
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in lines]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as JSONL."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lint_rows_dataset(path: Path, n: int = 250) -> Path:
    """``n`` alpaca rows with known problems: row 7's output is empty; rows 3 and 11 share a prompt with
    different answers; row 20 is far longer than 64 tokens."""
    rows = [{"instruction": f"Reverse the word number {i}.", "input": f"word{i}", "output": f"{i}drow",
             "split": 0 if i % 10 else 1} for i in range(n)]
    rows[7]["output"] = ""
    rows[11]["instruction"], rows[11]["input"] = rows[3]["instruction"], rows[3]["input"]
    rows[20]["output"] = " ".join(f"token{k}" for k in range(120))
    return write_rows(path, rows)


def workdir(tmp_path: Path, monkeypatch) -> Path:
    """A working directory holding a copy of the sample data and the tokenizer folder ``tok``, so
    that every path the app shows is short and the same on every machine (snapshots)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "settings"))
    shutil.copy(SAMPLE, tmp_path / SAMPLE.name)
    cached = cache_dir() / "ui-test-tokenizer"
    make_tokenizer(cached)
    shutil.copytree(cached, tmp_path / "tok")
    return tmp_path


def make_config(data: str | None = SAMPLE.name, model: str = "tok", max_len: int = 512) -> RunConfig:
    """The sample config shape, pointed at relative data and the local tokenizer folder."""
    config = RunConfig()
    config.model.base_model = model
    config.data.path = data
    config.data.max_seq_length = max_len
    return config


async def idle_workers(pilot, timeout: float = 60.0) -> None:
    """Wait until no thread worker (data load, search, stats, tokenizer) is pending or running."""
    from textual.worker import WorkerState

    deadline = time.monotonic() + timeout
    while any(w.state in (WorkerState.PENDING, WorkerState.RUNNING) for w in pilot.app.workers):
        assert time.monotonic() < deadline, f"workers still busy: {list(pilot.app.workers)}"
        await pilot.pause(0.05)


async def panes_mounted(pilot, timeout: float = 60.0) -> None:
    """Wait until every hidden pane has been mounted (they follow the first frame by ~0.6 s, later
    on a loaded machine)."""
    from studio.ui.pane_slot import PaneSlot

    deadline = time.monotonic() + timeout
    while any(not slot._mounted.is_set() for slot in pilot.app.query(PaneSlot)):
        assert time.monotonic() < deadline, "the hidden panes never mounted"
        await pilot.pause(0.05)


async def settle(pilot, rounds: int = 3, panes: bool = True) -> None:
    """Wait until the panes are mounted (unless ``panes`` is False), thread workers are done and
    debounce timers (render, filter, lint) have fired."""
    if panes:
        await panes_mounted(pilot)
    for _ in range(rounds):
        await idle_workers(pilot)
        await pilot.pause(0.35)
    await idle_workers(pilot)
    await pilot.pause()


def no_blink(app) -> None:
    """Cursor blink off: a snapshot must not depend on the moment it is taken."""
    for widget in app.query("Input, TextArea"):
        widget.cursor_blink = False


class PlayedWorker:
    """The test plays the worker of a real :class:`~studio.ui.app.StudioApp`.

    Commands the app would send to its worker are recorded in :attr:`sent` (no worker process is
    started), the runs it opens in :attr:`opened` as (run, start_worker); :meth:`feed` hands events to
    the app where its event follower puts what it reads from the run's log, so they reach the panes
    the way a real worker's do (batched, as messages).
    """

    def __init__(self, app) -> None:
        self.app = app
        self.sent: list = []
        self.opened: list = []
        open_run = app.open_run

        def record_open(run, start_worker: bool = False) -> None:
            self.opened.append((run, start_worker))
            open_run(run, start_worker=start_worker)

        # Instance attributes shadow the methods: the panes reach these through the app.
        app.open_run = record_open
        app.link.deliver = self._deliver

    def _deliver(self, start: bool) -> None:
        while not self.app.link.outbox.empty():
            self.sent.append(self.app.link.outbox.get_nowait())

    def feed(self, events) -> None:
        """Events of the current run, as if the worker had just written them."""
        assert self.app.current_run is not None, "events belong to a run: open one first"
        self.app.link.events.extend(events)


def fixed_run(root: Path, name: str, config: RunConfig):
    """A run with a fixed id (create_run stamps the time, which would change every snapshot)."""
    from studio.core.runs import RunDir

    run = RunDir(root / name)
    run.checkpoints_dir.mkdir(parents=True)
    config.save(run.config_path)
    return run


async def events_drawn(pilot, timeout: float = 30.0) -> None:
    """Wait until every event handed to the app has been posted to the mounted panes and handled,
    then for the panes' own throttled repaints (4 a second at most)."""
    app = pilot.app
    deadline = time.monotonic() + timeout

    def busy() -> bool:
        mounted = [p for p in app.panes if p.is_mounted]
        link = app.link
        return bool(link.events) or any(link.delivered.get(p, 0) < len(link.history) for p in mounted) \
            or any(not p._message_queue.empty() for p in mounted)

    while busy():
        assert time.monotonic() < deadline, "the events never reached the panes"
        await pilot.pause(0.05)
    await pilot.pause(0.3)
