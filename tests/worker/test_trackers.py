"""``report_to``: metrics also go to TensorBoard (read back with TensorBoard's own reader), W&B (offline)
and MLflow (a local store), without ever blocking the caller; a missing package names the extra."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.worker import make_run, wait_for
from helpers.worker_fakes import fake_loss

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir, create_run
from studio.worker import trackers
from studio.worker.client import WorkerClient, start_worker
from studio.worker.trackers import TrackerHub, check_report_to, metrics_of

LOSSES = [2.5, 2.0, 1.6, 1.3, 1.1]


def _run(tmp_path: Path, report_to: list[str]) -> RunDir:
    config = RunConfig(output_dir=str(tmp_path / "runs"))
    config.report_to = report_to
    return create_run(config)


def _feed(hub: TrackerHub) -> None:
    for step, loss in enumerate(LOSSES, start=1):
        hub.offer(ev.StepLogged(step=step, total_steps=len(LOSSES), loss=loss, learning_rate=1e-3))
    hub.offer(ev.EvalLogged(step=5, loss=1.4, perplexity=4.0, token_accuracy=0.5))
    hub.offer(ev.GenerationStarted(request_id="x"))  # not a metric: ignored


def test_config_report_to_round_trips_through_yaml(tmp_path: Path) -> None:
    from studio.core.config import load_config

    run = _run(tmp_path, ["tensorboard", "mlflow"])
    assert load_config(run.config_path).report_to == ["tensorboard", "mlflow"]


def test_tensorboard_gets_the_metrics_and_reads_them_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tmp_path, ["tensorboard"])
    warnings: list[str] = []
    hub = TrackerHub(run, run.config(), warnings.append)
    _feed(hub)
    hub.close()
    assert warnings == []
    reader = EventAccumulator(str(run.path / "tensorboard"))
    reader.Reload()
    loss = reader.Scalars("train/loss")
    assert [s.step for s in loss] == [1, 2, 3, 4, 5]
    assert [round(s.value, 4) for s in loss] == LOSSES
    assert [(s.step, round(s.value, 4)) for s in reader.Scalars("eval/loss")] == [(5, 1.4)]


def test_tensorboard_gets_the_warnings_as_text_at_their_step(tmp_path: Path) -> None:
    """A warning goes to TensorBoard as a warning (text under ``warnings``), not as a failure or a metric."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tmp_path, ["tensorboard"])
    hub = TrackerHub(run, run.config(), lambda _m: None)
    hub.offer(ev.StepLogged(step=1, loss=2.0))
    hub.offer(ev.StepLogged(step=2, loss=1.9))
    hub.offer(ev.WarningRaised(kind="oom", message="evaluating at step 2 in batches of 4 rows: retrying in batches of 2"))
    hub.close()
    reader = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"tensors": 0})
    reader.Reload()
    (logged,) = reader.Tensors("warnings")
    assert logged.step == 2
    assert logged.tensor_proto.string_val == [b"warning (oom): evaluating at step 2 in batches of 4 rows: "
                                              b"retrying in batches of 2"]


class _SlowTracker:
    """A tracker stuck on a slow network: 50 ms a call."""

    logged: list[int] = []

    def __init__(self, run: RunDir, config: RunConfig):
        pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        time.sleep(0.05)
        self.logged.append(step)

    def close(self) -> None:
        pass


def test_a_slow_tracker_never_blocks_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(trackers._MAKERS, "tensorboard", _SlowTracker)
    run = _run(tmp_path, ["tensorboard"])
    hub = TrackerHub(run, run.config(), lambda _m: None)
    started = time.perf_counter()
    for step in range(40):
        hub.offer(ev.StepLogged(step=step, loss=1.0))
    offered = time.perf_counter() - started
    assert offered < 0.5, f"offering 40 events took {offered:.2f} s; the tracker took 2 s"
    hub.close()
    assert _SlowTracker.logged == list(range(40))


def test_missing_package_or_unknown_name_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(trackers.TRACKERS, "wandb", "no_such_package_for_studio")
    problems = check_report_to(["wandb", "comet"])
    assert problems[0].startswith("report_to: wandb needs the no_such_package_for_studio package; "
                                  "pip install 'qlora-studio[trackers]'")
    assert "'comet' is not a tracker" in problems[1] and "tensorboard, wandb, mlflow" in problems[1]
    run = _run(tmp_path, ["wandb"])
    warnings: list[str] = []
    hub = TrackerHub(run, run.config(), warnings.append)
    hub.offer(ev.StepLogged(step=1, loss=1.0))
    hub.close()
    assert len(warnings) == 1 and "qlora-studio[trackers]" in warnings[0] and hub.names == []


def test_memory_samples_become_decimal_gigabytes_as_everywhere_else() -> None:
    step, found = metrics_of(ev.MemorySampled(step=3, allocated=2 * 10**9, categories={"weights": 1 << 30}))
    assert step == 3 and found["memory/allocated_gb"] == 2.0
    assert found["memory/weights_gb"] == pytest.approx(1.073741824)  # a GiB is 1.07 GB


def test_wandb_offline_run_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is in the 'trackers' extra, not installed here")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, ["wandb"])
    warnings: list[str] = []
    hub = TrackerHub(run, run.config(), warnings.append)
    _feed(hub)
    hub.close(timeout=120)
    assert warnings == []
    offline = list((run.path / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and run.id in offline[0].name
    # wandb 0.31 has no Python reader for its record file (its core is in Go), so check the bytes:
    # the history records carry the metric names ('wandb sync' uploads them from here).
    (records,) = offline[0].glob("*.wandb")
    deadline = time.monotonic() + 30  # wandb's core process may still be flushing after finish()
    while (data := records.read_bytes()).count(b"train/loss") < len(LOSSES) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert data.count(b"train/loss") >= len(LOSSES) and b"eval/perplexity" in data


def test_mlflow_local_store_gets_the_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow is in the 'trackers' extra, not installed here")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = _run(tmp_path, ["mlflow"])
    warnings: list[str] = []
    hub = TrackerHub(run, run.config(), warnings.append)
    _feed(hub)
    hub.close(timeout=120)
    assert warnings == []
    client = MlflowClient(tracking_uri=(run.path / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("studio")
    (found,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(found.info.run_id, "train_loss")
    assert [(m.step, round(m.value, 4)) for m in history] == list(enumerate(LOSSES, start=1))
    assert found.data.params["lora.r"] == str(run.config().lora.r)


def test_the_worker_sends_its_training_metrics_to_tensorboard(tmp_path: Path, fake_worker_env: list) -> None:  # noqa: F811
    """A real worker process (with the stand-in trainer) training a run whose config says
    report_to: [tensorboard, comet]: TensorBoard gets every step's loss; comet gets a message."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = make_run(tmp_path / "runs", steps=12)
    config = run.config()
    config.report_to = ["tensorboard", "comet"]
    config.save(run.config_path)
    start_worker(run, train=True)
    fake_worker_env.append(run)
    client = WorkerClient(run)
    try:
        client.connect(30)
        seen: list[ev.Event] = []
        wait_for(client, lambda e: isinstance(e, ev.TrainingFinished), seen=seen)
        client.send(ev.Shutdown())
        wait_for(client, lambda e: isinstance(e, ev.WorkerStopped), seen=seen)
    finally:
        client.close()
    assert not any(isinstance(e, ev.WorkerFailed) for e in seen)
    problems = [e.message for e in seen if isinstance(e, ev.WarningRaised)]
    assert len(problems) == 1 and "'comet' is not a tracker" in problems[0]
    reader = EventAccumulator(str(run.path / "tensorboard"))
    reader.Reload()
    logged = [(s.step, round(s.value, 5)) for s in reader.Scalars("train/loss")]
    assert logged == [(e.step, round(e.loss, 5)) for e in seen if isinstance(e, ev.StepLogged)]
    assert logged[-1] == (12, round(fake_loss(12), 5))


def test_loss_chart_falls_back_to_text_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from studio.core.export.model_card import loss_chart, loss_curve

    curve = loss_curve([ev.StepLogged(step=s, loss=loss) for s, loss in enumerate(LOSSES, start=1)] +
                       [ev.EvalLogged(step=5, loss=1.4)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    kind, chart = loss_chart(curve, tmp_path)
    assert kind == "text" and chart.startswith("```text\n") and "install matplotlib" in chart
    assert "training loss" in chart and not (tmp_path / "loss.png").exists()
    assert loss_chart(loss_curve([]), tmp_path)[0] == "none"


def test_foreground_train_also_reports_to_tensorboard(tiny_config, tmp_path: Path) -> None:
    """``studio train CONFIG`` (no worker process) sends its metrics to the trackers too."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from studio.cli import main as studio_main
    from studio.core.runs import list_runs

    tiny_config.report_to = ["tensorboard"]
    tiny_config.trainer.max_steps = 4
    tiny_config.trainer.eval_interval = 2
    tiny_config.save(tmp_path / "tb.yaml")
    assert studio_main(["train", str(tmp_path / "tb.yaml")]) == 0
    (run,) = list_runs(tiny_config.output_dir)
    reader = EventAccumulator(str(run.path / "tensorboard"))
    reader.Reload()
    steps = [e for e in run.events() if isinstance(e, ev.StepLogged)]
    assert [(s.step, round(s.value, 5)) for s in reader.Scalars("train/loss")] == \
        [(e.step, round(e.loss, 5)) for e in steps]
    assert [s.step for s in reader.Scalars("eval/loss")] == [0, 2, 4]  # step 0: the base model
