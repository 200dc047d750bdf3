"""One runner: every job that loads the model goes through a worker holding the device lock.

These drive real worker processes with the torch-free FakeTrainer (tests/helpers/worker_fakes.py), and the
real StudioApp through Textual's pilot, so they take seconds.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TESTS
from helpers.cli import start_studio

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, create_run, iter_events, list_runs
from studio.worker.client import DeviceBusy, WorkerStartError, claim_device, start_worker
from studio.worker.launch import GpuLock


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """FakeTrainer workers with a private device lock; any left running at the end are killed.
    Yields the runs folder."""
    monkeypatch.setenv("STUDIO_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.worker_fakes:FakeTrainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("STUDIO_WORKER_LINGER", "60")  # a stopped run's worker stays up, as for chat
    monkeypatch.setenv("FAKE_STEP_S", "0.03")
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "settings"))
    runs = tmp_path / "runs"
    yield runs
    for run in list_runs(runs):
        if (pid := run.worker_pid()) is not None:
            os.kill(pid, signal.SIGKILL)


def fake_config(runs: Path, steps: int = 5000) -> RunConfig:
    config = RunConfig(output_dir=str(runs))
    config.model.base_model = "fake-model"
    config.trainer.max_steps = steps
    return config


def test_the_lock_names_the_cpu_on_a_machine_without_cuda(fake_env: Path, monkeypatch) -> None:
    """TUI bug 5: no GPU, yet the refusal said "GPU 0 is busy"."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # no device visible: a CPU-only machine
    first = create_run(fake_config(fake_env), fake_env)
    second = create_run(fake_config(fake_env), fake_env)
    start_worker(first, train=True)
    with pytest.raises(WorkerStartError) as refused:
        start_worker(second)
    message = str(refused.value)
    assert message.startswith(f"this machine's CPU is busy: run {first.id}") and "GPU" not in message
    assert f"studio stop {first.id}" in message


def test_claiming_the_device_shuts_an_idle_worker_down_but_not_a_busy_one(fake_env: Path) -> None:
    idle = create_run(fake_config(fake_env, steps=3), fake_env)
    start_worker(idle, train=True)
    deadline = time.monotonic() + 30
    while not any(isinstance(e, ev.TrainingFinished) for e in iter_events(idle.events_path)):
        assert time.monotonic() < deadline, "the short run did not finish"
        time.sleep(0.05)
    claim_device()  # the finished run's worker only idles: it is asked to leave
    assert not GpuLock().busy() and idle.worker_pid() is None

    busy = create_run(fake_config(fake_env), fake_env)
    start_worker(busy, train=True)
    with pytest.raises(DeviceBusy, match=f"is busy: run {busy.id}"):
        claim_device()
    assert busy.worker_pid() is not None


@pytest.mark.anyio
async def test_start_after_stop_in_one_session_trains_the_new_run(fake_env: Path) -> None:
    """TUI bug 1: stop a run (its worker stays up for chat), press Start: the new run used to stay
    "loading" behind a "GPU 0 is busy" toast, and Stop then trained it for a step."""
    from studio.ui.app import StudioApp
    from studio.ui.panes.training import TrainingPane

    app = StudioApp(fake_config(fake_env), settings=False)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await _show_training(app, pilot)
        await pilot.press("s")
        await _wait(pilot, lambda: pane.state.step >= 3, "the first run's steps")
        first = app.current_run
        assert first is not None
        await pilot.press("x")
        await pilot.press("y")
        await _wait(pilot, lambda: pane.state.status == "stopped", "the stop")
        assert first.worker_pid() is not None  # kept up for chat

        await pilot.press("s")
        await _wait(pilot, lambda: app.current_run != first and pane.state.step >= 3, "the second run's steps")
        second = app.current_run
        assert isinstance(second, RunDir) and second.worker_pid() is not None
        assert first.worker_pid() is None  # the idle worker gave the device up
        assert isinstance(app.query_one(TrainingPane), TrainingPane)


@pytest.mark.anyio
async def test_reopening_studio_after_quitting_a_stopped_run_starts_the_next_one(fake_env: Path) -> None:
    """TUI bug 1, second half: quit Studio after stopping a run, reopen it within the linger time
    (the stopped run's worker still holds the device), press Start."""
    from studio.ui.app import StudioApp

    app = StudioApp(fake_config(fake_env), settings=False)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await _show_training(app, pilot)
        await pilot.press("s")
        await _wait(pilot, lambda: pane.state.step >= 3, "the first run's steps")
        first = app.current_run
        await pilot.press("x")
        await pilot.press("y")
        await _wait(pilot, lambda: pane.state.status == "stopped", "the stop")
    assert first is not None and first.worker_pid() is not None and GpuLock().busy()

    app = StudioApp(fake_config(fake_env), settings=False)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await _show_training(app, pilot)
        await pilot.press("s")
        await _wait(pilot, lambda: app.current_run not in (None, first) and pane.state.step >= 3,
                    "the new run's steps")
        assert pane.state.status == "training" and first.worker_pid() is None


@pytest.mark.anyio
async def test_start_while_another_run_trains_says_so_and_the_pane_stays_usable(fake_env: Path) -> None:
    from studio.ui.app import StudioApp

    holder = create_run(fake_config(fake_env), fake_env)
    start_worker(holder, train=True)
    app = StudioApp(fake_config(fake_env), settings=False)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = await _show_training(app, pilot)
        await pilot.press("s")
        await _wait(pilot, lambda: pane.state.status == "failed", "the refusal")
        assert pane.state.failure is not None and f"busy: run {holder.id}" in pane.state.failure.message
        assert pane.check_action("start_training", ()) is True  # Start is offered again
        refused = app.current_run
        await pilot.press("x")  # nothing queued for the refused run may reach a worker later
        await pilot.pause(1.0)
        assert refused is not None and refused.worker_pid() is None
        assert not any(isinstance(e, ev.StepLogged) for e in iter_events(refused.events_path))


async def _show_training(app, pilot):
    from studio.ui.panes.training import TrainingPane

    await pilot.press("4")

    def ready() -> bool:
        found = app.query(TrainingPane)
        return bool(found) and found.first().is_mounted and app.focused is not None \
            and found.first() in app.focused.ancestors_with_self

    await _wait(pilot, ready, "the training pane")
    return app.query_one(TrainingPane)


async def _wait(pilot, condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.1)


def test_foreground_train_is_the_worker_pause_chat_and_ctrl_c_reach_it(fake_env: Path, tmp_path: Path) -> None:
    """`studio train CONFIG` holds the device lock and serves its socket while the console prints."""

    from studio.cli import main as studio
    from studio.worker.client import WorkerClient

    config = fake_config(fake_env)
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    config.data.path = str(tmp_path / "rows.jsonl")
    config.save(tmp_path / "fg.yaml")
    proc = start_studio("train", str(tmp_path / "fg.yaml"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (runs := list_runs(fake_env)) or not any(
                isinstance(e, ev.StepLogged) for e in iter_events(runs[0].events_path)):
            assert time.monotonic() < deadline and proc.poll() is None, "the foreground run did not train"
            time.sleep(0.05)
        run = runs[0]
        assert run.worker_pid() == proc.pid
        assert GpuLock().holder().get("pid") == proc.pid  # the foreground run holds the device
        assert studio(["pause", run.id, "--runs-dir", str(fake_env)]) == 0
        client = WorkerClient(run)
        assert client.connect(5.0).state == "paused"
        client.send(ev.Generate(request_id="fg", prompt="olleh"))
        deadline = time.monotonic() + 30
        answer = None
        while answer is None:
            assert time.monotonic() < deadline, "no answer from the foreground worker"
            answer = next((e for e in client.poll(0.2) if isinstance(e, ev.GenerationFinished)), None)
        assert answer.text.endswith("hello")
        client.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "continue with: studio train --resume" in out and "Traceback" not in out
    finished = [e for e in iter_events(run.events_path) if isinstance(e, ev.TrainingFinished)]
    assert len(finished) == 1 and finished[0].stopped
    assert run.worker_pid() is None and not GpuLock().busy()


def _reverse_rows(path: Path) -> Path:
    """Rows whose answer is the input reversed: 6 train, 2 validation, 3 test."""
    import json

    words = ["alpha", "bravo", "delta", "gamma", "omega", "sigma", "kappa", "theta", "lambda", "iota", "rho"]
    splits = [0] * 6 + [1] * 2 + [2] * 3
    path.write_text("".join(json.dumps({"instruction": "Reverse the word.", "input": w, "output": w[::-1],
                                        "split": s}) + "\n" for w, s in zip(words, splits, strict=True)))
    return path


def test_eval_is_served_by_a_worker_it_starts_and_shuts_down(fake_env: Path, tmp_path: Path, capsys) -> None:
    import json

    from studio.cli import main as studio

    config = fake_config(fake_env, steps=3)
    config.data.path = str(_reverse_rows(tmp_path / "rows.jsonl"))
    run = create_run(config, fake_env)
    (run.adapter_dir).mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    assert studio(["eval", run.id, "--runs-dir", str(fake_env), "--json", "--rows", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "test" and report["rows"] == 3  # the test split wins over validation
    assert [r["target"] for r in report["results"]] == ["adbmal", "atoi", "ohr"]
    assert report["fine_tuned"]["exact_match"] == 1.0 and report["base"]["exact_match"] == 0.0
    assert json.loads((run.path / "eval.json").read_text())["fine_tuned"] == report["fine_tuned"]
    assert (run.path / "eval.csv").read_text().startswith("instruction,input,target,base_answer")
    scored = [e for e in iter_events(run.events_path) if isinstance(e, ev.HeldOutRowScored)]
    assert [e.index for e in scored] == [0, 1, 2] and all(e.total == 3 for e in scored)
    assert run.worker_pid() is None and not GpuLock().busy()  # the worker it started is gone


def test_eval_uses_the_running_worker_and_training_goes_on(fake_env: Path, tmp_path: Path, capsys) -> None:
    from studio.cli import main as studio

    config = fake_config(fake_env)
    config.data.path = str(_reverse_rows(tmp_path / "rows.jsonl"))
    run = create_run(config, fake_env)
    pid = start_worker(run, train=True)
    deadline = time.monotonic() + 30
    while run.latest_checkpoint() is None:  # the fake checkpoints every 5 steps
        assert time.monotonic() < deadline, "no checkpoint yet"
        time.sleep(0.05)
    assert studio(["eval", run.id, "--runs-dir", str(fake_env), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "exact match: base 0.0% -> fine-tuned 100.0%" in out and "eval.json" in out
    assert run.worker_pid() == pid  # left running, still training
    steps = [e.step for e in iter_events(run.events_path) if isinstance(e, ev.StepLogged)]
    time.sleep(0.5)
    assert max(e.step for e in iter_events(run.events_path) if isinstance(e, ev.StepLogged)) > max(steps)


def test_eval_table_prints_no_control_characters_from_the_data_or_the_answers(fake_env: Path, tmp_path: Path,
                                                                             capsys) -> None:
    import json

    from studio.cli import main as studio

    words = ["\x1b[2J\x1b]0;owned\x07ab", "c\rd\x9bq", "e\x07f\tg\nh"]  # clear screen, retitle, bell, C1 CSI
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"instruction": "Reverse the word.", "input": w, "output": w[::-1], "split": s})
                            + "\n" for w, s in zip(["abc", *words], [0, 2, 2, 2], strict=True)))
    config = fake_config(fake_env, steps=3)
    config.data.path = str(rows)
    run = create_run(config, fake_env)
    run.adapter_dir.mkdir()
    (run.adapter_dir / "adapter_config.json").write_text("{}")
    assert studio(["eval", run.id, "--runs-dir", str(fake_env), "--rows", "3"]) == 0
    out = capsys.readouterr().out
    table = out[: out.index("exact match:")]
    assert "[2J]0;ownedab" in table and "cdq" in table  # the rows are there (the fake's base echoes them)...
    control = [c for c in out if c != "\n" and (ord(c) < 32 or 127 <= ord(c) < 160)]
    assert control == [], control  # ...without a character the terminal would act on


def test_attach_prints_held_out_progress_in_one_short_line() -> None:
    from studio.cli.runs import describe

    row = describe(ev.HeldOutRowScored(index=1, total=3, split="test", target="cba", base="abc", tuned="cba",
                                       fields={"instruction": "x" * 500}))
    assert row == "held-out 2/3 (test): target 'cba'  base 'abc'  fine-tuned 'cba'"
    done = describe(ev.HeldOutFinished(rows=3, split="test", base_exact_match=0.0, base_similarity=0.3,
                                       tuned_exact_match=1.0, tuned_similarity=1.0, path="/r/eval.json"))
    assert "base exact 0.0%" in done and "fine-tuned exact 100.0%" in done and done.endswith("/r/eval.json")
    assert describe(ev.HeldOutFinished(ok=False, message="no held-out rows")) == \
        "held-out scoring failed: no held-out rows"
