"""A real full disk (a small tmpfs) at run creation, mid-run in a detached worker, in a foreground
`studio train` and at its resume: one line says where and what to do, nothing half made is left
looking like a run, the log stays whole, the last good checkpoint resumes.

Mounting needs root (or CAP_SYS_ADMIN); where the mount is refused the tests skip and say so.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TESTS
from helpers.cli import run_studio
from helpers.disk_fill import FILL_ENV, fill

from studio.cli import main as studio
from studio.core import events as ev
from studio.core.runs import RunDir, find_run, iter_events, list_runs


def _mount_small_disk(mount: Path, image: Path) -> str | None:
    """Mount a 32 MB filesystem at ``mount``: a tmpfs, else an ext4 image on a loop device; None
    when mounted, else why not."""
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        return None
    why = f"tmpfs: {done.stderr.strip() or 'mount failed'}"
    try:
        with open(image, "wb") as handle:
            handle.truncate(32 << 20)
        # -m 0: no blocks reserved for root, so "full" is full for the tests' root user too.
        made = subprocess.run(["mkfs.ext4", "-q", "-m", "0", "-F", str(image)], capture_output=True, text=True)
        looped = made.returncode == 0 and subprocess.run(
            ["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True).returncode == 0
    except OSError as exc:
        return f"{why}; loop image: {exc}"
    return None if looped else f"{why}; a loop-mounted image failed too"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MB filesystem of its own, unmounted afterwards (lazily, should a process still hold a
    file there)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    why = _mount_small_disk(mount, tmp_path / "disk.img")
    if why is not None:
        pytest.skip(f"cannot mount a small filesystem here ({why}); the disk-full tests need root "
                    "or CAP_SYS_ADMIN")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _assert_log_whole(run: RunDir) -> list[ev.Event]:
    """Every line of events.jsonl is one whole event and the file ends with a newline."""
    data = run.events_path.read_bytes()
    assert data.endswith(b"\n")
    lines = data.decode().splitlines()
    events = list(iter_events(run.events_path))
    assert len(events) == len(lines)
    assert all(line.count('{"type":') == 1 for line in lines)
    return events


def _assert_no_worker_files(run: RunDir) -> None:
    for path in (run.socket_path, run.key_path, run.pid_path):
        assert not path.exists(), path


def _one_disk_full_line(text: str, where: Path, run_id: str | None) -> str:
    lines = [line for line in text.splitlines() if "free space and run" in line]
    assert len(lines) == 1, text
    then = f"`studio train --resume {run_id}`" if run_id else "the command again"
    assert str(where) in lines[0] and f"free space and run {then}" in lines[0], lines[0]
    assert "Traceback" not in text
    return lines[0]


def test_run_creation_on_a_full_disk_leaves_no_run(fake_cli: Path, small_disk: Path,  # noqa: F811
                                                   capsys: pytest.CaptureFixture) -> None:
    runs = small_disk / "runs"
    runs.mkdir()
    fill(small_disk / "filler")
    for detach in ([], ["--detach"]):
        assert studio(["train", str(fake_cli), "--runs-dir", str(runs), *detach]) == 1
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1
        _one_disk_full_line(captured.err, runs, None)
        assert list(runs.iterdir()) == []  # not even the hidden folder it was built in


def test_detached_worker_on_a_full_disk_reports_exits_and_resumes(fake_cli: Path, small_disk: Path,  # noqa: F811
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    filler = small_disk / "filler"
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.disk_fill:DiskFillingFake")
    monkeypatch.setenv(FILL_ENV, f"{filler}:7")
    monkeypatch.setenv("FAKE_CHECKPOINT_EVERY", "5")
    assert studio(["train", str(fake_cli), "--detach", "--max-steps", "400", "--runs-dir",
                   str(small_disk / "runs")]) == 0
    run = find_run(capsys.readouterr().out.strip(), small_disk / "runs")
    deadline = time.monotonic() + 60
    while run.worker_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.worker_pid() is None  # the worker exited on its own

    _assert_no_worker_files(run)
    events = _assert_log_whole(run)
    steps = [e.step for e in events if isinstance(e, ev.StepLogged)]
    assert 7 <= steps[-1] < 400
    assert [p.name for p in run.checkpoints_dir.iterdir()] == ["step-5"]  # no half-written one

    # Every command says the same one line while the disk is full.
    assert studio(["attach", str(run.path)]) == 1
    _one_disk_full_line(capsys.readouterr().out, run.path, run.id)
    for command in ("resume", "pause", "stop"):
        assert studio([command, str(run.path)]) == 1
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1
        _one_disk_full_line(captured.err, run.path, run.id)
    _assert_no_worker_files(run)

    # Space freed: the run resumes from its last good checkpoint and finishes.
    filler.unlink()
    monkeypatch.setenv("STUDIO_WORKER_TRAINER", "helpers.worker_fakes:FakeTrainer")
    monkeypatch.setenv("FAKE_STEP_S", "0.005")
    assert studio(["resume", str(run.path)]) == 0
    assert "from step-5" in capsys.readouterr().out
    assert studio(["attach", str(run.path)]) == 0
    events = _assert_log_whole(run)
    assert [e.resumed_from_step for e in events if isinstance(e, ev.RunStarted)] == [0, 5]
    assert any(isinstance(e, ev.TrainingFinished) and e.step == 400 for e in events)


@pytest.mark.slow
def test_foreground_train_on_a_full_disk_then_resume(tiny_config, small_disk: Path, studio_env: dict,
                                                    ) -> None:
    runs = small_disk / "runs"
    filler = small_disk / "filler"
    tiny_config.output_dir = str(runs)
    tiny_config.trainer.max_steps = 20
    tiny_config.trainer.checkpoint_interval = 10
    tiny_config.trainer.log_interval = 100  # few events after the fill: the checkpoint is what fails
    config = small_disk.parent / "tiny.yaml"
    tiny_config.save(config)
    env = {**studio_env, "STUDIO_WORKER_TRAINER": "helpers.disk_fill:DiskFillingSession", FILL_ENV: f"{filler}:11",
           "PYTHONPATH": os.pathsep.join([str(TESTS), studio_env["PYTHONPATH"]]),
           "STUDIO_LOCK_DIR": str(small_disk.parent / "locks")}
    done = run_studio("train", str(config), env=env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    (run,) = list_runs(runs)
    line = _one_disk_full_line(out, run.path, run.id)
    assert line.startswith("error (disk): ")
    _assert_no_worker_files(run)
    events = _assert_log_whole(run)
    assert not any(isinstance(e, ev.TrainingFinished) for e in events)
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step-10"]
    assert not run.adapter_dir.exists() and not list(run.path.glob(".tmp-*"))

    # Resumed while the disk is still full: the same one line, nothing left behind.
    env["STUDIO_WORKER_TRAINER"] = "studio.engine.session:Session"
    done = run_studio("train", "--resume", str(run.path), env=env, timeout=600)
    assert done.returncode == 1
    # Where it runs out (the key, the first event, the checkpoint) depends on what the exit freed.
    _one_disk_full_line(done.stdout + done.stderr, run.path, run.id)
    _assert_no_worker_files(run)

    # A torn line from an older Studio (or a kill) at the end: the resume starts on a new line.
    filler.unlink()
    with open(run.events_path, "ab") as handle:
        handle.write(b'{"type":"StepLogged","seq":9999,"st')
    env.pop(FILL_ENV)
    done = run_studio("train", "--resume", str(run.path), env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training resumed from step 10" in done.stdout
    events = _assert_log_whole(run)
    assert [e.step for e in events if isinstance(e, ev.TrainingFinished)] == [20]
    assert (run.adapter_dir / "adapter_model.safetensors").exists()


def test_the_event_log_stays_whole_when_an_append_finds_the_disk_full(small_disk: Path) -> None:
    from studio.core.runs.storage import DiskFull
    from studio.worker.eventlog import EventLog

    log = EventLog(small_disk / "events.jsonl", "RUN")
    log.append(ev.StepLogged(step=1))
    fill(small_disk / "filler")
    with pytest.raises(DiskFull) as full:
        for step in range(2, 100_000):  # the file's last page takes a few more first
            log.append(ev.WorkerFailed(message="x" * 500, detail=str(step)))
    log.close()
    assert str(full.value) == (f"disk full at {small_disk / 'events.jsonl'}: free space and run "
                               "`studio train --resume RUN`")
    data = (small_disk / "events.jsonl").read_bytes()
    assert data.endswith(b"\n")
    assert len(list(iter_events(small_disk / "events.jsonl"))) == data.count(b"\n")


def test_an_adapter_save_on_a_full_disk_keeps_the_previous_adapter(small_disk: Path) -> None:
    from studio.core.runs.storage import is_disk_full
    from studio.engine.model import save_adapter

    class Model:
        """Stands in for a PEFT model: save_pretrained writes 4 MB of weights."""

        def __init__(self, marker: bytes):
            self.marker = marker

        def save_pretrained(self, folder: str) -> None:
            (Path(folder) / "adapter_config.json").write_text("{}")
            (Path(folder) / "adapter_model.safetensors").write_bytes(self.marker * (4 << 20))

    adapter = small_disk / "run" / "adapter"
    save_adapter(Model(b"a"), adapter, extra={"studio_step.json": '{"step": 10}'})
    fill(small_disk / "filler")
    with pytest.raises(OSError) as failed:
        save_adapter(Model(b"b"), adapter, extra={"studio_step.json": '{"step": 20}'})
    assert is_disk_full(failed.value)
    assert (adapter / "studio_step.json").read_text() == '{"step": 10}'
    assert (adapter / "adapter_model.safetensors").read_bytes()[:1] == b"a"
    assert sorted(p.name for p in adapter.parent.iterdir()) == ["adapter"]  # no temp folder left


def test_replacing_a_folder_swaps_the_whole_folder_in_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    from studio.core.runs.storage import replace_folder, sync_tree

    final = tmp_path / "step-5"
    for version in ("first", "second"):  # the second lands on a folder already there (saved twice)
        tmp = tmp_path / ".tmp-step-5"
        tmp.mkdir()
        (tmp / "state.json").write_text(version)
        if version == "first":
            (tmp / "only-in-first.pt").write_text("x")
        sync_tree(tmp)
        assert replace_folder(tmp, final) == final
    assert sorted(p.name for p in final.iterdir()) == ["state.json"]  # nothing of the old folder mixed in
    assert (final / "state.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]  # no .tmp- or .old- folder left
