"""Data-parallel training on the CPU: two gloo processes started by torchrun train the tiny model
through the real launcher and worker (``studio train --gpus 2``), and lose what one process with
the same effective batch loses; a run checkpointed on one process resumes on two; bad requests are
refused in one line.

``STUDIO_DISTRIBUTED_CPU=1`` lets ``--gpus 2`` mean two CPU processes on a machine without GPUs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.cli import run_studio
from helpers.engine import engine_on_cpu

from studio.core import events as ev
from studio.core.config import RunConfig, parse_config
from studio.core.memory.multigpu import GpuCountError, plan_devices
from studio.core.runs import iter_events, list_runs

pytestmark = pytest.mark.usefixtures("on_cpu")  # thresholds calibrated in fp32 (conftest.on_cpu)

STEPS = 30


def _config(make_tiny_config, out: Path, micro: int, effective: int) -> Path:
    config: RunConfig = make_tiny_config(out / "runs")
    t = config.trainer
    t.max_steps, t.micro_batch_size, t.effective_batch_size = STEPS, micro, effective
    t.eval_interval, t.checkpoint_interval, t.eval_max_rows = 0, 0, 8
    t.scheduler, t.warmup_fraction = "constant", 0.0
    path = out / f"mb{micro}-eb{effective}.yaml"
    config.save(path)
    return path


def _losses(run_path: Path) -> dict[int, float]:
    return {e.step: e.loss for e in iter_events(run_path / "events.jsonl") if isinstance(e, ev.StepLogged)}


def _only_run(root: Path) -> Path:
    runs = list_runs(root)
    assert len(runs) == 1, runs
    return runs[0].path


@pytest.fixture(scope="module")
def env(studio_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    environment = dict(studio_env)
    environment["STUDIO_LOCK_DIR"] = str(tmp_path_factory.mktemp("locks"))
    environment["STUDIO_DISTRIBUTED_CPU"] = "1"
    environment["OMP_NUM_THREADS"] = "1"
    environment["CUDA_VISIBLE_DEVICES"] = ""
    return environment


@pytest.fixture(scope="module")
def one_process(make_tiny_config, tmp_path_factory) -> dict[int, float]:
    """The reference, trained in this process: micro-batch 4 x accumulation 2 = effective batch 8."""
    return _train_here(make_tiny_config, tmp_path_factory.mktemp("one"), STEPS)[1]


def _train_here(make_tiny_config, out: Path, steps: int) -> tuple[Path, dict[int, float]]:
    """One process trains ``steps`` steps in this test process; its run folder and losses by step."""
    from studio.core.runs import create_run
    from studio.engine.session import Session

    config = parse_config(_config(make_tiny_config, out, 4, 8).read_text())
    config.trainer.max_steps = steps
    run = create_run(config, out / "runs")
    events: list[ev.Event] = []
    with engine_on_cpu():  # as the gloo processes it is compared with (CUDA_VISIBLE_DEVICES="")
        Session(config, run, events.append).train()
    assert any(isinstance(e, ev.TrainingFinished) for e in events)
    return run.path, {e.step: e.loss for e in events if isinstance(e, ev.StepLogged)}


@pytest.mark.slow
def test_two_processes_lose_what_one_does_with_the_same_effective_batch(
        make_tiny_config, env, tmp_path, one_process) -> None:
    # Two processes of micro-batch 4 x accumulation 1: the same 8 rows a step, split 4 + 4.
    config = _config(make_tiny_config, tmp_path, 4, 4)
    done = run_studio("train", str(config), "--gpus", "2", cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "micro-batch 4 x 1 accumulation x 2 GPUs = effective batch 8" in done.stdout
    run = _only_run(tmp_path / "runs")
    started = next(e for e in iter_events(run / "events.jsonl") if isinstance(e, ev.RunStarted))
    assert (started.gpus, started.effective_batch_size, started.gradient_accumulation_steps) == (2, 8, 1)
    two, one = _losses(run), one_process
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert abs(two[step] - one[step]) <= 0.01 * abs(one[step]), (step, two[step], one[step])
    assert one[STEPS] < 0.75 * one[1]  # it learned: the comparison is not of two flat lines
    # Both cards were sampled; rank 0 alone wrote the adapter and the checkpoint (with rank 1's RNG).
    ranks = {e.rank for e in iter_events(run / "events.jsonl") if isinstance(e, ev.MemorySampled)}
    assert ranks == {0, 1}
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    assert (run / "checkpoints" / f"step-{STEPS}" / "rng-rank-1.pt").exists()


@pytest.mark.slow
def test_a_run_checkpointed_on_one_process_resumes_on_two_with_the_same_losses(
        make_tiny_config, env, tmp_path, one_process) -> None:
    run, first = _train_here(make_tiny_config, tmp_path, 12)
    resumed = run_studio("train", "--resume", str(run), "--max-steps", str(STEPS), "--gpus", "2", cwd=tmp_path, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    # The effective batch stays 8: accumulation 2 on one process becomes 1 on each of two.
    assert "resuming on 2 processes a run checkpointed on 1: the effective batch stays 8" in resumed.stdout
    # A constant learning rate: the schedule does not depend on max_steps, so the uninterrupted
    # one-process run is the reference for the steps after the checkpoint.
    two, one = {**first, **_losses(run)}, one_process
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(two[step] - one[step]) <= 0.01 * abs(one[step]), (step, two[step], one[step])


@pytest.mark.slow
def test_a_run_checkpointed_on_two_processes_resumes_on_two_with_the_exact_losses(
        make_tiny_config, env, tmp_path) -> None:
    """Exact resume on N GPUs: a two-process run stopped at its step-3 checkpoint and resumed on two
    processes loses, at every step after the checkpoint, what an uninterrupted two-process run loses
    (to 1e-6 relative: both fp32 on the CPU), so the weights, optimizer, data position and each rank's
    RNG all come back."""
    runs = {}
    for name, steps in (("whole", 6), ("part", 3)):
        (tmp_path / name).mkdir()
        config = parse_config(_config(make_tiny_config, tmp_path / name, 4, 4).read_text())
        config.trainer.checkpoint_interval = 3  # the same saves in both, at step 3
        config.save(tmp_path / name / "config.yaml")
        done = run_studio("train", str(tmp_path / name / "config.yaml"), "--max-steps", str(steps), "--gpus", "2", cwd=tmp_path, env=env, timeout=240)
        assert done.returncode == 0, done.stderr + done.stdout
        runs[name] = _only_run(tmp_path / name / "runs")
    part = runs["part"]
    assert (part / "checkpoints" / "step-3" / "rng-rank-1.pt").exists()
    resumed = run_studio("train", "--resume", str(part), "--max-steps", "6", "--gpus", "2", cwd=tmp_path, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    started = [e for e in iter_events(part / "events.jsonl") if isinstance(e, ev.RunStarted)]
    assert [(s.gpus, s.resumed_from_step) for s in started][-1] == (2, 3)
    whole, after = _losses(runs["whole"]), _losses(part)
    assert sorted(whole) == list(range(1, 7)) and [s for s in sorted(after) if s > 3] == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(after[step] - whole[step]) <= 1e-6 * abs(whole[step]), (step, after[step], whole[step])


def test_more_gpus_than_present_is_one_line_and_makes_no_run(make_tiny_config, env, tmp_path) -> None:
    config = _config(make_tiny_config, tmp_path, 4, 4)
    no_cpu = {k: v for k, v in env.items() if k != "STUDIO_DISTRIBUTED_CPU"}
    done = run_studio("train", str(config), "--gpus", "4", cwd=tmp_path, env=no_cpu, timeout=240)
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: 4 GPUs asked for, but this machine shows 0 GPUs "
                                   "(CUDA_VISIBLE_DEVICES=); use --gpus 1 (or remove distributed.gpus)")
    assert not (tmp_path / "runs").exists() or not list_runs(tmp_path / "runs")


def test_a_busy_device_refuses_the_start_naming_its_holder(make_tiny_config, env, tmp_path,
                                                          monkeypatch) -> None:
    from studio.core.runs import create_run
    from studio.worker.launch import GpuLock

    monkeypatch.setenv("STUDIO_LOCK_DIR", env["STUDIO_LOCK_DIR"])
    holder = create_run(RunConfig(), tmp_path / "other")
    lock = GpuLock("cpu")
    lock.acquire(holder)
    try:
        done = run_studio("train", str(_config(make_tiny_config, tmp_path, 4, 4)), "--gpus", "2", cwd=tmp_path, env=env, timeout=240)
    finally:
        lock.release()
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this machine's CPU is busy: run " + holder.id), lines


def test_processes_that_cannot_start_are_one_line_not_a_traceback(make_tiny_config, env, tmp_path) -> None:
    broken = dict(env, PET_MAX_RESTARTS="not-a-number")  # torchrun refuses its own arguments and starts no rank
    done = run_studio("train", str(_config(make_tiny_config, tmp_path, 4, 4)), "--gpus", "2", cwd=tmp_path, env=broken, timeout=240)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: the training processes of run ") and "did not start" in lines[0], lines


def test_gpu_plans_name_the_cards_and_refuse_too_many(monkeypatch) -> None:
    config = RunConfig()
    config.distributed.gpus = "all"
    assert plan_devices(config, visible=["2", "3"]) == ["2", "3"]
    config.distributed.gpus = 2
    assert plan_devices(config, visible=["0", "1", "2"]) == ["0", "1"]
    config.distributed.gpus = 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(GpuCountError, match="3 GPUs asked for, but this machine shows 2 GPUs; use --gpus 2"):
        plan_devices(config, visible=["0", "1"])


def test_shards_of_a_step_do_not_overlap_and_cover_it() -> None:
    from studio.engine.distributed import Group

    units = [[i] for i in range(11)]
    shares = [Group(rank=r, world=3).shard(units) for r in range(3)]
    flat = [u[0] for share in shares for u in share]
    assert sorted(flat) == list(range(11)) and len(flat) == len(set(flat))
    assert [len(s) for s in shares] == [4, 4, 3]


def test_no_nccl_on_a_gpu_machine_is_one_line_saying_what_to_do(monkeypatch) -> None:
    import torch
    import torch.distributed as dist

    from studio.engine import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("STUDIO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(distributed.DistributedError) as caught:
        distributed._join()
    assert "no NCCL" in str(caught.value) and "--gpus 1" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_config_reads_gpus_and_ludwig_backend_strategy_gets_a_note() -> None:
    assert parse_config("distributed: {gpus: all}").distributed.gpus == "all"
    assert parse_config("distributed: {gpus: 2}").distributed.gpus == 2
    with pytest.raises(Exception, match="'distributed.gpus' is 0"):
        parse_config("distributed: {gpus: 0}")
    ludwig = ("model_type: llm\nbase_model: x\ninput_features: [{name: instruction, type: text}]\n"
              "output_features: [{name: output, type: text}]\n"
              "backend: {type: ray, trainer: {strategy: deepspeed, num_workers: 4}}\n")
    with pytest.warns(Warning) as notes:
        parse_config(ludwig, "x.yaml")
    text = [str(n.message) for n in notes]
    assert any("'backend' section is ignored" in t and "--gpus N" in t for t in text), text
    assert any("strategy: deepspeed" in t and "distributed: {gpus: 4}" in t for t in text), text


def test_each_card_gets_a_gauge_line_and_the_batch_line_counts_the_gpus() -> None:
    from studio.core.runs.report import batch_text
    from studio.ui.panes.vram import CARD_SQUARES, cards_text

    gb = 10**9
    cards = {r: ev.MemorySampled(step=7, device="NVIDIA H200", rank=r, reserved=(20 + 10 * r) * gb,
                                 capacity=80 * gb, categories={"weights": 4 * gb}) for r in (1, 0)}
    lines = cards_text(cards).plain.splitlines()
    assert lines[1].startswith("GPU 0  ") and lines[2].startswith("GPU 1  "), lines
    assert lines[1].count("■") == CARD_SQUARES // 4 and lines[2].count("■") == round(CARD_SQUARES * 30 / 80)
    assert "20.00 GB / 80.0 GB at step 7" in lines[1] and "30.00 GB / 80.0 GB" in lines[2]
    assert cards_text({0: cards[0]}).plain == ""  # one card: the big gauge says it all
    started = ev.RunStarted(micro_batch_size=4, gradient_accumulation_steps=2, gpus=2, effective_batch_size=16)
    assert batch_text(started) == "micro-batch 4 x 2 accumulation x 2 GPUs = effective batch 16"
    assert batch_text(ev.RunStarted(micro_batch_size=4, gradient_accumulation_steps=2)) == \
        "micro-batch 4 x 2 accumulation = effective batch 8"


@pytest.mark.slow
def test_pause_resume_stop_and_start_again_reach_both_processes(make_tiny_config, env, tmp_path,
                                                                 monkeypatch) -> None:
    """The TUI's way: start the run's worker (the launcher, torchrun, two ranks), then commands."""
    from studio.core.runs import create_run
    from studio.worker.client import connect_or_start

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = parse_config(_config(make_tiny_config, tmp_path, 4, 4).read_text())
    config.trainer.max_steps, config.distributed.gpus = 400, 2
    run = create_run(config, tmp_path / "runs")
    client = connect_or_start(run, timeout=30)
    client.send(ev.StartTraining())
    seen: list[ev.Event] = []
    paused_at = -10
    try:
        for event in client.events(poll_s=0.2):
            seen.append(event)
            if isinstance(event, ev.StepLogged) and event.step == 3:
                client.send(ev.Pause())
            elif isinstance(event, ev.TrainingPaused):
                paused_at = event.step
                time.sleep(1.5)  # the other rank waits through "still paused" meanwhile
                client.send(ev.Resume())
            elif isinstance(event, ev.StepLogged) and event.step == paused_at + 2:
                client.send(ev.Stop())
            elif isinstance(event, ev.TrainingFinished) and len(_of(seen, ev.TrainingFinished)) == 1:
                client.send(ev.StartTraining(resume=True))  # the same processes train again
            elif isinstance(event, ev.RunStarted) and event.resumed_from_step:
                client.send(ev.Stop())
            elif isinstance(event, ev.TrainingFinished):
                client.send(ev.Shutdown())
            elif isinstance(event, ev.WorkerStopped) and event.seq >= 0:
                break
    finally:
        client.close()
    finished, starts = _of(seen, ev.TrainingFinished), _of(seen, ev.RunStarted)
    assert [s.gpus for s in starts] == [2, 2] and starts[1].resumed_from_step == finished[0].step
    assert finished[0].stopped and finished[1].stopped and finished[0].step >= paused_at + 2
    steps = [e.step for e in _of(seen, ev.StepLogged)]
    # Nothing lost or repeated over the pause, and the resume went on from the stop.
    assert steps == list(range(1, finished[1].step + 1)) and finished[1].step > finished[0].step
    assert not [e for e in _of(seen, ev.WorkerFailed) if e.fatal]


def _of(events: list[ev.Event], kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]
