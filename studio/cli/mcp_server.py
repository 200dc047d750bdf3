"""``studio mcp``: Studio's run commands as an MCP server over stdio, for an AI agent.

A front end like the CLI: each tool calls the function its ``studio`` command calls
(studio/cli/runs.py, studio/cli/evaluate.py, studio/cli/export.py,
studio/cli/estimate.py), so a job that loads a model goes to the run's worker, started
detached when none runs, and this process never imports torch. Starting, pausing, resuming and
stopping a run are tools the client calls explicitly; reading a resource only reads the run
directory, and nothing starts from a read. A mistake comes back as a tool error whose text is the
line the CLI prints after ``error:``.

Needs the ``mcp`` package (``pip install 'qlora-studio[mcp]'``). docs/mcp.md lists the tools.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import anyio.from_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

from studio.cli import runs as cli_runs
from studio.cli import studio_version
from studio.cli.estimate import EstimateFailed, estimate_config
from studio.cli.evaluate import EvalFailed, evaluate_run
from studio.cli.export import ExportFailed, export_through_worker
from studio.core import events as ev
from studio.core import runs as run_dirs
from studio.core.config import ConfigError, ConfigNote, load_config, parse_config
from studio.core.runs import RunDir, RunSummary, find_run, parse_event_line, summarize
from studio.core.runs.report import describe, format_duration, memory_text
from studio.core.runs.storage import DiskFull
from studio.worker.client import WorkerClient, WorkerUnavailable

EVENT_LINES = 100
"""How many of a run's latest events its events resource shows."""

_P = ParamSpec("_P")
_R = TypeVar("_R")

RunRef = Annotated[str, Field(description="The run: its id (or a prefix only it has), or its folder.")]


# ------------------------------------------------------------------------------------ results


class RunInfo(BaseModel):
    """One run, as ``studio runs`` lists it."""

    id: str
    path: str = Field(description="The run's folder (config.yaml, events.jsonl, checkpoints, adapter).")
    model: str = Field(description="The base model.")
    status: str = Field(description="created, training, paused, finished, stopped, failed, or interrupted "
                                    "(training with no worker left: resume it).")
    step: int = Field(description="The latest optimizer step logged.")
    total_steps: int
    last_loss: float | None = Field(description="Training loss at the latest logged step.")
    best_eval_loss: float | None = Field(description="The lowest evaluation loss so far.")
    age: str = Field(description="Since the run was made, as '3m05s'.")


class RunList(BaseModel):
    """The runs under the server's runs folder, newest first."""

    runs_dir: str
    runs: list[RunInfo]


class Memory(BaseModel):
    """The run's latest memory sample, in bytes."""

    device: str
    allocated: int
    reserved: int
    peak_allocated: int
    capacity: int = Field(description="The card's size (0 where the device has none, as a CPU).")
    text: str = Field(description="As the CLI words it: '3.00 GB in use, peak 4.00 GB of 80.00 GB'.")


class WorkerInfo(BaseModel):
    """The run's live worker: the process that owns the device and the model."""

    pid: int
    state: str | None = Field(description="idle, loading, training, paused, finished, stopped, failed, "
                                          "exporting or scoring; null when it did not answer in time.")


class RunStatus(RunInfo):
    """A run's status and latest metrics, from its event log (and its worker, when one runs)."""

    eval_loss: float | None = Field(description="The latest evaluation loss.")
    tokens_per_s: float | None = Field(description="Training throughput at the latest logged step.")
    memory: Memory | None
    worker: WorkerInfo | None = Field(description="Null when no worker runs for the run.")
    adapter: str | None = Field(description="The adapter the run would chat, evaluate and export with.")
    latest_checkpoint: str | None
    failure: str | None = Field(description="What the failure that ended the run says (status failed).")


class EstimateResult(BaseModel):
    """What ``studio estimate`` says about a config."""

    model: str
    gpu: str = Field(description="The card estimated for.")
    fits: bool | None
    text: str = Field(description="The table ``studio estimate`` prints.")
    estimate: dict[str, Any] = Field(description="What ``studio estimate --json`` prints (bytes): categories, "
                                                 "total, capacity, fits, max_micro_batch, path, plan, phases, "
                                                 "auto_plan.")
    notes: list[str] = Field(description="Notes on the config (another tool's key names read as Studio's, ...).")


class CommandResult(BaseModel):
    """What a run command did."""

    run_id: str
    path: str
    message: str = Field(description="The line the matching ``studio`` command prints.")
    step: int | None = None
    adapter: str | None = Field(default=None, description="The adapter a stop saved.")
    worker_pid: int | None = Field(default=None, description="The worker a start started.")
    notes: list[str] = Field(default_factory=list, description="Notes on the config, when one was read.")


class Scores(BaseModel):
    """Exact match and similarity (0 to 1) over the held-out rows."""

    exact_match: float
    similarity: float


class EvalSummary(BaseModel):
    """Base vs fine-tuned answers on held-out rows, as ``studio eval`` reports them."""

    run_id: str
    split: str = Field(description="The split scored: test, else validation.")
    rows: int
    base: Scores
    fine_tuned: Scores | None
    preference: dict[str, Any] | None = Field(description="Preference runs: how often each model prefers the "
                                                          "chosen answer.")
    seconds: float
    path: str = Field(description="eval.json (every row); eval.csv is beside it.")
    examples: list[dict[str, Any]] = Field(description="The first rows: target, base and fine-tuned answers.")


class ExportResult(BaseModel):
    """What ``studio export`` wrote."""

    run_id: str
    format: str
    path: str = Field(description="The folder written.")
    files: list[str] = Field(description="The files in it.")
    message: str
    seconds: float


# ------------------------------------------------------------------------------------ helpers

# The mistakes a person can fix: each says, in one line, what to do.
_USER_ERRORS = (ConfigError, FileNotFoundError, DiskFull, EstimateFailed)


def _one_line_errors(*more: type[Exception]) -> Callable[[Callable[_P, _R]], Callable[_P, _R | CallToolResult]]:
    """A tool whose mistakes (and ``more``) come back as a tool error with the CLI's line."""

    def wrap(tool: Callable[_P, _R]) -> Callable[_P, _R | CallToolResult]:
        @functools.wraps(tool)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R | CallToolResult:
            try:
                return tool(*args, **kwargs)
            except (*_USER_ERRORS, *more) as exc:
                return CallToolResult(content=[TextContent(type="text", text=str(exc))], is_error=True)

        return call

    return wrap


# Tools run in threads, and the warnings filters are the process's: one recorder at a time.
_NOTES_LOCK = threading.Lock()


def _with_notes(read: Callable[[], _R]) -> tuple[_R, list[str]]:
    """``read()``'s result and the config notes it issued (the CLI prints them as ``note:`` lines)."""
    with _NOTES_LOCK, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNote)
        value = read()
    return value, [str(w.message) for w in caught if issubclass(w.category, ConfigNote)]


def _is_inline_yaml(config: str) -> bool:
    """A config given as YAML text rather than a file's path: several lines, or a key on a line that
    names no file."""
    if "\n" in config:
        return True
    try:
        return ":" in config and not Path(config).is_file()
    except (OSError, ValueError):  # too long for a path, or a NUL in it
        return True


def _run_list(root: str) -> RunList:
    now = time.time()
    runs = [RunInfo(**_run_info(summarize(run), now)) for run in run_dirs.list_runs(root)]
    return RunList(runs_dir=str(Path(root).resolve()), runs=runs)


def _run_info(summary: RunSummary, now: float) -> dict[str, Any]:
    return {"id": summary.run.id, "path": str(summary.run.path.resolve()), "model": summary.model,
            "status": summary.status, "step": summary.step, "total_steps": summary.total_steps,
            "last_loss": summary.last_loss, "best_eval_loss": summary.best_eval_loss,
            "age": format_duration(now - summary.started)}


def _worker_info(run: RunDir) -> WorkerInfo | None:
    """The run's live worker and what it is doing (asked over its socket, as ``studio pause`` does)."""
    pid = run.worker_pid()
    if pid is None:
        return None
    client = WorkerClient(run)
    try:
        return WorkerInfo(pid=pid, state=str(client.connect(2.0).state))
    except WorkerUnavailable:
        return WorkerInfo(pid=pid, state=None)  # still starting, or going away
    finally:
        client.close()


def event_tail(run: RunDir, count: int = EVENT_LINES) -> list[str]:
    """The run's latest ``count`` events as ``studio attach`` prints them (``HH:MM:SS  line``), read
    from the end of events.jsonl so that a long run's log is not parsed whole."""
    try:
        with open(run.events_path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - (1 << 20))
            handle.seek(start)
            raw = handle.read()
    except FileNotFoundError:
        return []
    lines = raw.decode("utf-8", errors="replace").split("\n")
    if start > 0:
        lines = lines[1:]  # the first line is cut by where the read started
    lines = lines[:-1]  # after the last newline: empty, or a line still being written
    out: list[str] = []
    for line in reversed(lines):
        event = parse_event_line(line)
        text = describe(event) if event is not None else None
        if text is not None:
            out.append(f"{time.strftime('%H:%M:%S', time.localtime(event.time))}  {text}")
            if len(out) == count:
                break
    return out[::-1]


def _progress(ctx: Context) -> Callable[[float, float | None, str], None]:
    """Progress notifications to the client from a tool's thread (a no-op unless it asked for them)."""

    def report(done: float, total: float | None, message: str) -> None:
        anyio.from_thread.run(ctx.report_progress, done, total, message)

    return report


# ------------------------------------------------------------------------------------ the server

_READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)


def build_server(runs_dir: str | Path = "runs") -> MCPServer:
    """The MCP server over the runs under ``runs_dir``: its tools and read-only resources."""
    root = str(runs_dir)
    server = MCPServer(
        "studio", version=studio_version(), log_level="WARNING",
        instructions=(f"Studio fine-tunes language models (QLoRA, LoRA, full, DPO/ORPO) from a YAML config. Runs "
                      f"are listed from {Path(root).resolve()}. start_run trains in a background worker that outlives "
                      "this server; follow it with run_status or the run's events resource. estimate predicts "
                      "GPU memory without loading a model. Resources only read run folders."))

    def command_result(outcome: cli_runs.Outcome, notes: list[str] | None = None) -> CommandResult:
        return CommandResult(run_id=outcome.run.id, path=str(outcome.run.path.resolve()), message=outcome.message,
                             step=outcome.step, adapter=outcome.adapter, worker_pid=outcome.worker_pid,
                             notes=notes or [])

    @server.tool(annotations=_READ_ONLY)
    @_one_line_errors()
    def list_runs() -> RunList:
        """List the runs, newest first: id, model, status, step, losses and age (what `studio runs` shows)."""
        return _run_list(root)

    @server.tool(annotations=_READ_ONLY)
    @_one_line_errors()
    def run_status(run: Annotated[str | None, Field(description="The run: its id (or a prefix only it has), or "
                                                                "its folder; default: the newest run.")] = None
                   ) -> RunStatus:
        """A run's status and latest metrics: step, training loss, evaluation loss, tokens/s, memory, its
        worker's state, and its adapter. Starts nothing."""
        found = find_run(run, root)
        summary = summarize(found)
        memory = None
        if summary.memory is not None:
            m = summary.memory
            memory = Memory(device=m.device, allocated=m.allocated, reserved=m.reserved,
                            peak_allocated=m.peak_allocated, capacity=m.capacity, text=memory_text(m))
        checkpoint, adapter = found.latest_checkpoint(), found.adapter()
        return RunStatus(**_run_info(summary, time.time()), eval_loss=summary.last_eval_loss,
                         tokens_per_s=summary.tokens_per_s, memory=memory, worker=_worker_info(found),
                         adapter=str(adapter.resolve()) if adapter else None,
                         latest_checkpoint=str(checkpoint.resolve()) if checkpoint else None, failure=summary.failure)

    @server.tool(annotations=_READ_ONLY)
    @_one_line_errors()
    def estimate(config: Annotated[str, Field(description="A config YAML file's path, or the YAML text itself.")],
                 gpu_gb: Annotated[float | None, Field(ge=0.5, description="The card's size in GB; default: the "
                                                       "card detected here, else 24.")] = None,
                 model: Annotated[str | None, Field(description="Base model hub id or folder, in place of the "
                                                    "config's model.base_model.")] = None) -> EstimateResult:
        """Predict the GPU memory a config needs, by category and phase, and the automatic plan
        (micro-batch, checkpointing) for the card: what `studio estimate` says. Loads no model."""
        inline = _is_inline_yaml(config)
        source = "the config given inline" if inline else config
        base_dir = Path.cwd() if inline else Path(config).parent
        report, notes = _with_notes(lambda: estimate_config(
            parse_config(config, source) if inline else load_config(config), source, base_dir, model, gpu_gb))
        data = report.to_json_dict()
        return EstimateResult(model=report.model, gpu=report.gpu_name, fits=data["fits"], text=report.text(),
                              estimate=data, notes=notes)

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    @_one_line_errors(cli_runs.RunCommandFailed)
    def start_run(config: Annotated[str, Field(description="The config YAML file's path.")],
                  data: Annotated[str | None, Field(description="Dataset path or hub id, in place of the config's "
                                                    "data.path.")] = None,
                  model: Annotated[str | None, Field(description="Base model hub id or folder, in place of the "
                                                     "config's model.base_model.")] = None,
                  max_steps: Annotated[int | None, Field(ge=1, description="Stop after this many optimizer "
                                                         "steps.")] = None) -> CommandResult:
        """Start training a new run from a config in a background worker (`studio train CONFIG --detach`).
        Returns the run id at once; the run goes on after this server exits. Refused, in one line, when
        another run's worker is busy on the device."""
        outcome, notes = _with_notes(lambda: cli_runs.start_detached(
            config, root if root != "runs" else None, data=data, model=model, max_steps=max_steps))
        return command_result(outcome, notes)

    @server.tool(annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False))
    @_one_line_errors(cli_runs.RunCommandFailed)
    def pause_run(run: RunRef) -> CommandResult:
        """Pause a training run after its current step (`studio pause`); its model stays loaded."""
        return command_result(cli_runs.pause_run(find_run(run, root)))

    @server.tool(annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=False, open_world_hint=False))
    @_one_line_errors(cli_runs.RunCommandFailed)
    def resume_run(run: RunRef) -> CommandResult:
        """Continue a paused run, or restart a stopped or interrupted one from its latest checkpoint in a
        new background worker (`studio resume`)."""
        return command_result(cli_runs.resume_run(find_run(run, root)))

    @server.tool(annotations=ToolAnnotations(
        read_only_hint=False, destructive_hint=True, open_world_hint=False))
    @_one_line_errors(cli_runs.RunCommandFailed)
    def stop_run(run: RunRef) -> CommandResult:
        """Stop a run (`studio stop`): a training run saves a checkpoint and its adapter first (resume it
        later with resume_run); then its worker exits and the device is free. Returns once it has."""
        return command_result(cli_runs.stop_run(find_run(run, root)))

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    @_one_line_errors(EvalFailed)
    def eval_run(run: RunRef,
                 rows: Annotated[int, Field(ge=1, description="How many held-out rows to answer.")] = 50,
                 ctx: Context | None = None) -> EvalSummary:
        """Answer held-out rows with the base model and the fine-tuned one and score both (`studio eval`),
        through the run's worker (started for this when none runs). Saves eval.json and eval.csv in the
        run folder. Slow on a big model: one row at a time, with progress."""
        found = find_run(run, root)
        report = _progress(ctx) if ctx is not None else None

        def on_row(event: ev.HeldOutRowScored) -> None:
            if report is not None:
                report(event.index + 1, event.total, f"held-out row {event.index + 1}/{event.total}")

        data, path = evaluate_run(found, rows, on_row)
        return EvalSummary(run_id=found.id, split=data["split"], rows=data["rows"], base=Scores(**data["base"]),
                           fine_tuned=Scores(**data["fine_tuned"]) if data["fine_tuned"] else None,
                           preference=data.get("preference"), seconds=data.get("seconds", 0.0), path=str(path),
                           examples=[{k: r[k] for k in ("target", "base", "tuned")} for r in data["results"][:5]])

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False))
    @_one_line_errors(ExportFailed)
    def export_run(run: RunRef,
                   format: Annotated[Literal["adapter", "merged", "gguf"], Field(
                       description="adapter (PEFT folder + model card), merged (safetensors) or gguf (+ LoRA "
                                   "GGUF and an Ollama Modelfile).")] = "adapter",
                   quant: Annotated[str, Field(description="GGUF storage: f16, q8_0, f32, bf16, q5_1, q5_0, "
                                               "q4_1, q4_0, or mxfp4 (a mixture of experts: experts in MXFP4, "
                                               "the rest q8_0).")] = "f16",
                   dtype: Annotated[Literal["bfloat16", "float16", "float32"], Field(
                       description="The merged weights' dtype.")] = "bfloat16",
                   out: Annotated[str | None, Field(description="Folder to write; default: "
                                                    "<run>/export/<format>.")] = None,
                   ctx: Context | None = None) -> ExportResult:
        """Write a run's model out through its worker (`studio export`): the adapter, merged weights or
        GGUF. Returns the folder and its files."""
        found = find_run(run, root)
        report = _progress(ctx) if ctx is not None else None

        def on_progress(stage: str, fraction: float) -> None:
            if report is not None:
                report(fraction, 1.0, stage)

        folder, finished = export_through_worker(found, format, quant, dtype, out, on_progress)
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        return ExportResult(run_id=found.id, format=format, path=str(folder), files=files, message=finished.message,
                            seconds=finished.seconds)

    @server.resource("studio://runs", name="runs", mime_type="application/json",
                     description="The runs, newest first, as list_runs returns them. Reading it starts nothing.")
    def runs_resource() -> str:
        return _run_list(root).model_dump_json(indent=1)

    @server.resource("studio://runs/{run_id}/config", name="run config", mime_type="application/yaml",
                     description="A run's config.yaml: the exact config it trains with.")
    def config_resource(run_id: str) -> str:
        try:
            return find_run(run_id, root).config_path.read_text()
        except OSError as exc:
            raise ResourceError(str(exc)) from None

    @server.resource("studio://runs/{run_id}/events", name="run events", mime_type="text/plain",
                     description=f"A run's latest {EVENT_LINES} events, one line each as `studio attach` "
                                 "prints them.")
    def events_resource(run_id: str) -> str:
        try:
            return "\n".join(event_tail(find_run(run_id, root))) + "\n"
        except FileNotFoundError as exc:
            raise ResourceError(str(exc)) from None

    return server


def main(args: argparse.Namespace) -> int:
    """``studio mcp [--runs-dir DIR]``: serve the tools on stdin/stdout until the client closes them."""
    build_server(getattr(args, "runs_dir", None) or "runs").run("stdio")
    return 0
