"""``report_to: [tensorboard, wandb, mlflow]``: a run's metrics, also sent to experiment trackers.

Both trainers of a run use it: the background worker and the foreground ``studio train``.

Training never waits for a tracker: :meth:`TrackerHub.offer` puts the event on a bounded queue and
returns; one thread turns events into metrics and hands them to each tracker (a network hiccup in
W&B or MLflow stalls that thread only). When the queue is full, new metrics are dropped and counted,
and the count is reported when the hub closes.

- tensorboard: scalar summaries written by TensorBoard's own event-file writer into
  ``runs/<id>/tensorboard`` (``tensorboard --logdir runs``);
- wandb: ``wandb.init`` with the run id as name, files under the run directory (``WANDB_MODE=offline``
  works as usual);
- mlflow: ``MlflowClient`` against ``MLFLOW_TRACKING_URI``, else a file store in ``runs/<id>/mlruns``.

The run's warnings (WarningRaised) go along as warnings: TensorBoard's text under ``warnings`` at the
step they came at, W&B's run summary and MLflow's run tag ``studio.warnings`` (every warning so far).

A tracker whose package is missing is skipped with a message naming the extra to install.
Plain Python: the tracker packages are imported in the tracker thread only, never at import.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.memory.gpus import GB
from studio.core.runs import RunDir, report

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""report_to name -> the Python package it needs."""

INSTALL_HINT = "pip install 'qlora-studio[trackers]'"
_QUEUE = 10000
_TAG_CHARS = 5000  # MLflow refuses longer tag values (5000 is the smallest limit of its stores)


def metrics_of(event: ev.Event) -> tuple[int, dict[str, float]] | None:
    """(step, metrics) a tracker records for ``event``, or None for events that are not metrics."""
    if isinstance(event, ev.StepLogged):
        return event.step, {"train/loss": event.loss, "train/learning_rate": event.learning_rate,
                            "train/grad_norm": event.grad_norm, "train/tokens_per_s": event.tokens_per_s,
                            "train/epoch": event.epoch}
    if isinstance(event, ev.EvalLogged):
        # A preference run's perplexity and accuracy are its chosen answers', not its loss's.
        prefix = "eval/" if event.method == "sft" else "eval/chosen_"
        return event.step, {"eval/loss": event.loss, f"{prefix}perplexity": event.perplexity,
                            f"{prefix}token_accuracy": event.token_accuracy}
    if isinstance(event, ev.MemorySampled):
        # Decimal GB, as every other number Studio shows (the gauge, the estimate, the console).
        found = {"memory/allocated_gb": event.allocated / GB, "memory/peak_allocated_gb": event.peak_allocated / GB}
        found.update({f"memory/{name}_gb": n / GB for name, n in event.categories.items()})
        return event.step, found
    return None


class TensorBoardTracker:
    """Scalars through TensorBoard's event-file writer (no torch needed)."""

    def __init__(self, run: RunDir, config: RunConfig):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = tensorboard_dir(run)
        self._writer = EventFileWriter(str(self.logdir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(v)) for tag, v in metrics.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def warn(self, step: int, text: str) -> None:
        """``text`` under the tag ``warnings`` of TensorBoard's Text tab, at ``step``."""
        from tensorboard.compat.proto import types_pb2
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto

        value = Summary.Value(tag="warnings", metadata=SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(plugin_name="text")),
            tensor=TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()]))
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=[value])))

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run named after the Studio run, with its config."""

    def __init__(self, run: RunDir, config: RunConfig):
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "studio"), name=run.id, id=_safe_id(run.id),
                               dir=str(run.path), config=config.to_dict(), resume="allow", reinit="create_new")
        self._warnings: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def warn(self, step: int, text: str) -> None:
        """Every warning so far in the run summary's ``studio/warnings`` (the run's overview page)."""
        self._warnings.append(f"step {step}: {text}")
        self._run.summary["studio/warnings"] = "\n".join(self._warnings)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run in the ``studio`` experiment, through the client API (no global active run)."""

    def __init__(self, run: RunDir, config: RunConfig):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # A store of plain files beside the run; MLflow 3 keeps that backend only on request
            # (its default wants a database, which mlflow-skinny does not install).
            uri = (run.path / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "studio")
        found = self._client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self._client.create_experiment(name)
        self.run_id = self._client.create_run(experiment, run_name=run.id).info.run_id
        for key, value in _flat(config.to_dict()).items():
            self._client.log_param(self.run_id, key, value[:500])
        self._warnings: list[str] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k.replace("/", "_"), float(v), now, step)
                                                     for k, v in metrics.items()])

    def warn(self, step: int, text: str) -> None:
        """Every warning so far in the run's tag ``studio.warnings`` (the newest kept when too long)."""
        self._warnings.append(f"step {step}: {text}")
        self._client.set_tag(self.run_id, "studio.warnings", "\n".join(self._warnings)[-_TAG_CHARS:])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


_MAKERS: dict[str, Callable[[RunDir, RunConfig], Any]] = {
    "tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
}


def _safe_id(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:64]


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def check_report_to(names: list[str]) -> list[str]:
    """Messages for names that are not trackers or whose package is missing (empty when all is well)."""
    import importlib.util

    problems = []
    for name in names:
        if name not in TRACKERS:
            problems.append(f"report_to: '{name}' is not a tracker Studio knows; use any of {', '.join(TRACKERS)}")
        elif importlib.util.find_spec(TRACKERS[name]) is None:
            problems.append(f"report_to: {name} needs the {TRACKERS[name]} package; {INSTALL_HINT} "
                            f"(or pip install {TRACKERS[name]}); training goes on without it")
    return problems


class TrackerHub:
    """The trackers of one run behind one queue and one thread; :meth:`offer` never blocks."""

    def __init__(self, run: RunDir, config: RunConfig, warn: Callable[[str], None]):
        self.run, self.config, self.warn = run, config, warn
        problems = check_report_to(list(config.report_to))
        for problem in problems:
            warn(problem)
        self.names = [n for n in dict.fromkeys(config.report_to) if n in TRACKERS and not any(
            f"report_to: {n} " in p for p in problems)]
        self.dropped = 0
        self._queue: queue.Queue[ev.Event | None] = queue.Queue(maxsize=_QUEUE)
        self._thread: threading.Thread | None = None
        if self.names:
            self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
            self._thread.start()

    def offer(self, event: ev.Event) -> None:
        """Queue ``event`` for the trackers if it carries metrics or is a warning; drops it (counted)
        when full."""
        if self._thread is None or (metrics_of(event) is None and not isinstance(event, ev.WarningRaised)):
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, close every tracker (waits at most ``timeout`` seconds)."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._thread = None
        if self.dropped:
            self.warn(f"report_to: {self.dropped} metric events were not sent (the trackers fell behind)")

    def _work(self) -> None:
        trackers: dict[str, Any] = {}
        for name in self.names:
            try:
                trackers[name] = _MAKERS[name](self.run, self.config)
            except Exception as exc:  # a tracker that cannot start must not stop training
                self.warn(f"report_to: {name} could not start ({_first_line(exc)}); training goes on without it")
        step, mute = 0, set()
        while (event := self._queue.get()) is not None:
            if isinstance(event, ev.WarningRaised):
                for name, tracker in trackers.items():
                    if name in mute:
                        continue
                    try:
                        tracker.warn(step, report.warning_line(event))
                    except Exception as exc:  # its metrics still go; said once (the saying is a warning too)
                        mute.add(name)
                        self.warn(f"report_to: {name} cannot record warnings ({_first_line(exc)})")
                continue
            step, metrics = metrics_of(event) or (step, {})
            for name, tracker in list(trackers.items()):
                try:
                    tracker.log(step, metrics)
                except Exception as exc:  # one failing tracker is dropped; the others go on
                    self.warn(f"report_to: {name} stopped logging ({_first_line(exc)})")
                    trackers.pop(name)
        for tracker in trackers.values():
            try:
                tracker.close()
            except Exception:  # closing is best effort; the metrics were already handed over
                pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def tensorboard_dir(run: RunDir) -> Path:
    """Where the tensorboard tracker writes for ``run``."""
    return run.path / "tensorboard"


def start_trackers(run: RunDir, emit: Callable[[ev.Event], object]) -> TrackerHub | None:
    """The run's trackers (None when its config asks for none); problems become WarningRaised events."""
    try:
        config = run.config()
    except (OSError, ValueError):
        return None  # the worker reports an unreadable config itself when it loads
    if not config.report_to:
        return None
    return TrackerHub(run, config, lambda message: emit(ev.WarningRaised(kind="config", message=message)))
