"""``studio export``, ``studio embed`` and ``studio push``: jobs that load the model, so they go through
the run's worker.

The handler connects to the run's worker (starting one, without training, when none is running),
sends the command, draws the worker's ExportProgress events as a progress bar on stderr, and returns
when the matching ExportFinished arrives.

``studio push RUN --repo user/name [--private] [--merged]`` puts the run's adapter (or merged model) on
the Hub: the folder is made by the run's worker, exactly as ``studio export`` makes it (the adapter
with its model card, or the merged safetensors), then uploaded with ``huggingface_hub``: the repo is
created if missing and the folder goes up as one commit. The token comes from the usual places
(``HF_TOKEN``, or ``hf auth login``'s stored token), and ``HF_ENDPOINT`` points it at another Hub.
Offline, without a token or without access: one line saying what to do. No torch here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import RunDir, find_run

_BAR = 30


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


class ProgressBar:
    """One line on stderr redrawn in place (a terminal), or one line per new stage (a log file)."""

    def __init__(self, label: str):
        self.label = label
        self.tty = sys.stderr.isatty()
        self._stage = ""

    def update(self, stage: str, fraction: float) -> None:
        if self.tty:
            filled = round(fraction * _BAR)
            sys.stderr.write(f"\r\033[K{self.label} [{'█' * filled}{'·' * (_BAR - filled)}] "
                             f"{fraction:4.0%} {stage}")
            sys.stderr.flush()
        elif stage != self._stage:
            print(f"{self.label}: {stage} ({fraction:.0%})", file=sys.stderr, flush=True)
        self._stage = stage

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


Progress = Callable[[str, float], None]
"""Told of each ExportProgress: the stage and the fraction done (0 to 1)."""


def run_job(run: RunDir, command: ev.Command, path: str, label: str,
            timeout: float = 24 * 3600, progress: Progress | None = None) -> ev.ExportFinished | str:
    """Send ``command`` to ``run``'s worker and follow it: the ExportFinished for ``path``, or why not.
    Progress goes to ``progress`` when given, else to a bar on stderr labelled ``label``."""
    from studio.worker.client import WorkerStartError, WorkerUnavailable, connect_or_start

    try:
        client = connect_or_start(run, timeout=30.0)  # the run's worker, or a new one on a free device
    except (WorkerStartError, WorkerUnavailable) as exc:
        return str(exc)
    try:
        client.catch_up()  # past events (an earlier export of the same path) are not this job's
        client.send(command)
        bar = ProgressBar(label) if progress is None else None
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                for event in client.poll(0.5):
                    if isinstance(event, ev.ExportProgress) and event.path == path:
                        (progress or bar.update)(event.stage, event.fraction)
                    elif isinstance(event, ev.ExportFinished) and event.path == path:
                        return event
                    elif isinstance(event, ev.WorkerFailed) and (event.seq < 0 or event.fatal):
                        return event.message
                if not client.connected and run.worker_pid() is None:
                    return f"the worker of run {run.id} exited; see {run.log_path}"
        finally:
            if bar is not None:
                bar.close()
        return f"no answer from the worker of run {run.id} within {timeout:g} s"
    except WorkerUnavailable as exc:
        return str(exc)
    finally:
        client.close()


def default_export_path(run: RunDir, fmt: str, quant: str) -> Path:
    """``runs/<id>/export/<format>`` (GGUF: ``gguf-<quant>``), numbered when it already exists."""
    name = f"gguf-{quant}" if fmt == "gguf" else fmt
    path, n = run.path / "export" / name, 2
    while path.exists():
        path, n = run.path / "export" / f"{name}-{n}", n + 1
    return path


class ExportFailed(Exception):
    """An export that could not be done; the message is the one line a person reads."""


def export_through_worker(run: RunDir, fmt: str = "adapter", quant: str = "f16", dtype: str = "bfloat16",
                          out: str | Path | None = None,
                          progress: Progress | None = None) -> tuple[Path, ev.ExportFinished]:
    """Write ``run``'s model out through its worker (started, without training, when none runs):
    ``fmt`` adapter (PEFT folder + model card), merged (safetensors in ``dtype``) or gguf (in
    ``quant``, + LoRA GGUF and Modelfile), into ``out`` (default: ``runs/<id>/export/<format>``).
    Returns the folder written and the worker's ExportFinished; raises ExportFailed."""
    from studio.engine.gguf_export import QUANTS  # numpy only; checked here so a typo starts no worker

    if fmt == "gguf" and quant not in QUANTS:
        raise ExportFailed(f"--quant {quant} is not one of {', '.join(QUANTS)} (K-quants: run llama.cpp's "
                           "llama-quantize on the f16 file)")
    folder = Path(out).resolve() if out else default_export_path(run, fmt, quant)
    command = ev.ExportRun(path=str(folder), format=fmt, quant=quant, dtype=dtype)
    result = run_job(run, command, str(folder), f"export {fmt}", progress=progress)
    if isinstance(result, str):
        raise ExportFailed(result)
    if not result.ok:
        raise ExportFailed(result.message)
    return folder, result


def export(args: argparse.Namespace) -> int:
    """``studio export RUN --format adapter|merged|gguf [--quant Q] [--dtype D] [--out DIR]``."""
    run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
    try:
        out, result = export_through_worker(run, args.format, args.quant, args.dtype, args.out)
    except ExportFailed as exc:
        return _fail(str(exc))
    print(out)
    print(f"exported run {run.id} as {args.format} in {result.seconds:.0f} s: {result.message}", file=sys.stderr)
    return 0


def embed(args: argparse.Namespace) -> int:
    """``studio embed RUN --data FILE --out FILE.parquet [--layer N] [--pool mean|last] [--base]``."""
    run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
    data = Path(args.data)
    if not data.exists():
        return _fail(f"{data}: no such file; give the rows to embed (CSV, JSON, JSONL or Parquet)")
    out = Path(args.out).resolve()
    if out.suffix != ".parquet":
        return _fail(f"{out}: the output is a Parquet file; name it *.parquet")
    command = ev.Embed(data=str(data.resolve()), out=str(out), layer=args.layer, pool=args.pool, base=args.base,
                       batch_size=args.batch_size)
    result = run_job(run, command, str(out), "embed")
    if isinstance(result, str):
        return _fail(result)
    if not result.ok:
        return _fail(result.message)
    print(out)
    print(f"{result.message} in {result.seconds:.0f} s", file=sys.stderr)
    return 0


_REPO_HELP = "give --repo as user/name (or org/name)"


class PushError(RuntimeError):
    """The upload cannot go ahead; the message says what to do."""


def check_ready(repo: str) -> str:
    """The token to upload with; PushError when the repo name, the network mode or the token is wrong."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PushError(f"--repo {repo!r}: {_REPO_HELP}")
    try:
        from huggingface_hub import constants, get_token
    except ImportError:
        raise PushError("pushing needs huggingface_hub: pip install huggingface_hub") from None
    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it when this machine is online")
    token = get_token()
    if not token:
        raise PushError("no Hugging Face token found; run 'hf auth login' (or set HF_TOKEN to a token with "
                        "write access from https://huggingface.co/settings/tokens) and push again")
    return token


def upload(folder: Path, repo: str, token: str, private: bool, message: str) -> str:
    """Create ``repo`` if needed and upload ``folder`` as one commit; returns the repo's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model", commit_message=message)
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise PushError(f"the Hub refused the token for {repo} (HTTP {status}); check that it has write "
                            "access ('hf auth login' with a write token) and that you may write to that "
                            "namespace") from None
        raise PushError(f"the Hub answered HTTP {status} for {repo}: {_first_line(exc)}") from None
    except Exception as exc:  # requests / httpx connection errors are not one class tree
        if isinstance(exc, OSError) or any(w in type(exc).__name__.lower() for w in ("connect", "timeout")):
            raise PushError(f"cannot reach the Hub at {api.endpoint} ({_first_line(exc)}); check the network, "
                            "or HF_ENDPOINT if you use a mirror") from None
        raise PushError(f"uploading to {repo} failed: {type(exc).__name__}: {_first_line(exc)}") from None
    return str(url)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def push(args: argparse.Namespace) -> int:
    """``studio push [RUN] --repo user/name [--private] [--merged]``."""
    run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
    try:
        token = check_ready(args.repo)
    except PushError as exc:
        return _fail(str(exc))
    fmt = "merged" if args.merged else "adapter"
    folder = (run.path / "export" / f"push-{fmt}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
    result = run_job(run, ev.ExportRun(path=str(folder), format=fmt), str(folder), f"export {fmt}")
    if isinstance(result, str):
        return _fail(result)
    if not result.ok:
        return _fail(result.message)
    print(f"uploading {folder} to {args.repo}…", file=sys.stderr, flush=True)
    try:
        url = upload(folder, args.repo, token, args.private, f"Upload {fmt} of Studio run {run.id}")
    except PushError as exc:
        return _fail(str(exc))
    print(url)
    return 0
