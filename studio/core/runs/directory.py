"""The run directory, the single source of truth for a run.

    runs/<run-id>/
      config.yaml          the exact config (studio train runs/<run-id>/config.yaml re-runs it)
      events.jsonl         append-only event log, one JSON event a line
      checkpoints/step-N/  resumable checkpoints, each with its adapter in adapter/ (model/ for a
                           full fine-tune)
      adapter/             the final PEFT adapter (RunDir.adapter() says which adapter is the run's)
      model/               a full fine-tune's (lora: null) final weights and tokenizer, in place of adapter/
      worker.sock, worker.key, worker.pid, worker.log

Plain Python: the UI lists and reads runs through this module.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from studio.core import events as ev
from studio.core.config import RunConfig, load_config
from studio.core.runs.storage import DIR_MODE, FILE_MODE, DiskFull, is_disk_full

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a folder a PEFT adapter (``PeftModel.from_pretrained`` reads it first)."""

MODEL_CONFIG = "config.json"
"""The file that makes a folder a full model (a full fine-tune's ``model/``: save_pretrained's weights)."""

ADAPTER_STEP_FILE = "studio_step.json"
"""Written beside the final adapter: ``{"step": N}``, the optimizer step its weights are from."""

ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin", "studio_config.yaml",
                 "README.md")
"""What an exported adapter folder holds: the PEFT files, and the run config that trained it (so
its prompt template travels with it)."""


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def ref(self) -> str:
        """The run as a command printed for a person to type here names it: its id when ``./runs``
        (every command's default ``--runs-dir``) holds it, else its path, quoted for the shell."""
        if (Path("runs") / self.id).resolve() == self.path.resolve():
            return self.id
        return shlex.quote(str(self.path.resolve()))

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter_dir(self) -> Path:
        return self.path / "adapter"

    @property
    def model_dir(self) -> Path:
        """A full fine-tune's final weights (``lora: null``): the ``adapter/`` of such a run."""
        return self.path / "model"

    @property
    def socket_path(self) -> Path:
        return self.path / "worker.sock"

    @property
    def key_path(self) -> Path:
        return self.path / "worker.key"

    def socket_address(self) -> str:
        """The address to bind or connect the worker socket: ``socket_path``, or when that is longer
        than a Unix socket address allows, the same file reached through a short private symlink."""
        full = str(self.socket_path.absolute())
        if len(full.encode()) < 100:
            return full
        import hashlib
        import tempfile

        short_dir = Path(tempfile.gettempdir()) / f"studio-{os.getuid()}"
        short_dir.mkdir(mode=0o700, exist_ok=True)
        if short_dir.stat().st_uid != os.getuid():
            raise PermissionError(f"{short_dir}: owned by another user; remove it or set TMPDIR")
        target = self.path.resolve()
        link = short_dir / hashlib.sha1(str(target).encode()).hexdigest()[:16]
        if not link.is_symlink() or Path(os.readlink(link)) != target:
            tmp = link.with_name(f"{link.name}.{os.getpid()}")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(target)
            tmp.replace(link)
        return str(link / self.socket_path.name)

    @property
    def pid_path(self) -> Path:
        return self.path / "worker.pid"

    @property
    def log_path(self) -> Path:
        return self.path / "worker.log"

    def config(self) -> RunConfig:
        """The run's saved config."""
        return load_config(self.config_path)

    def events(self) -> list[ev.Event]:
        """Every event logged so far (a torn last line from a crash is skipped)."""
        return list(iter_events(self.events_path))

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (temp folders of an interrupted save are ignored)."""
        if not self.checkpoints_dir.exists():
            return []
        found = []
        for child in self.checkpoints_dir.iterdir():
            match = re.fullmatch(r"step-(\d+)", child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
        return [p for _, p in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    def adapter(self) -> Path | None:
        """The one answer to "which adapter is this run's": the folder to chat, evaluate, export
        and merge with; None when the run has saved none yet. For a full fine-tune (``lora: null``)
        it is the folder of the whole model's weights (``model/``; :func:`is_full_model` tells them
        apart), chosen by the same rules.

        The final ``adapter/`` when it is there, else the newest checkpoint's ``adapter/``. One
        exception: a run resumed after its final adapter was saved can checkpoint past it (then be
        stopped by a kill, which writes no new ``adapter/``); the newer checkpoint's adapter wins
        then. ``adapter/`` records its step in ``studio_step.json``; one without that file (saved by
        hand, or by an older Studio) counts as final.
        """
        latest = self.latest_checkpoint()
        newest = _weights_in(latest) if latest is not None else None
        final = _weights_in(self.path)
        if final is None:
            return newest
        if newest is None:
            return final
        final_step = _adapter_step(final)
        checkpoint_step = int(newest.parent.name.removeprefix("step-"))
        return newest if final_step is not None and checkpoint_step > final_step else final

    def worker_pid(self) -> int | None:
        """The pid of a live worker for this run, or None."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid


def _weights_in(folder: Path) -> Path | None:
    """``folder``'s ``adapter/`` (a PEFT adapter) or ``model/`` (a full fine-tune's weights), or None."""
    if (folder / "adapter" / ADAPTER_CONFIG).exists():
        return folder / "adapter"
    if (folder / "model" / MODEL_CONFIG).exists():
        return folder / "model"
    return None


def is_full_model(folder: Path) -> bool:
    """True for a full fine-tune's saved weights (a ``model/`` folder), False for a PEFT adapter."""
    return not (folder / ADAPTER_CONFIG).exists() and (folder / MODEL_CONFIG).exists()


def _adapter_step(folder: Path) -> int | None:
    """The step recorded beside a final adapter, or None when it has no (readable) record."""
    try:
        return int(json.loads((folder / ADAPTER_STEP_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def copy_adapter(run: RunDir, dest: str | Path) -> Path:
    """Copy the run's adapter (:meth:`RunDir.adapter`) to the new folder ``dest`` as a plain PEFT
    adapter folder that ``PeftModel.from_pretrained(base, dest)`` loads: the adapter files only,
    not a checkpoint's optimizer and RNG states. Written beside ``dest`` and renamed when complete.
    Raises FileNotFoundError (no adapter yet) or FileExistsError (``dest`` exists)."""
    import shutil

    dest = Path(dest)
    source = run.adapter()
    if source is None:
        raise FileNotFoundError(f"run {run.id} has no saved adapter yet (looked in {run.adapter_dir} and "
                                f"{run.checkpoints_dir}); train, or stop the run, first")
    if is_full_model(source):
        raise FileNotFoundError(f"run {run.id} is a full fine-tune (lora: null): it has no adapter, its "
                                f"weights are in {source}; export it as merged or gguf")
    if dest.exists():
        raise FileExistsError(f"{dest} already exists; choose a new folder")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in ADAPTER_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        if not (tmp / "studio_config.yaml").exists() and run.config_path.exists():
            # A checkpoint's adapter has no config beside it; the run's is the one that trained it.
            shutil.copy2(run.config_path, tmp / "studio_config.yaml")
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def parse_event_line(line: str) -> ev.Event | None:
    """The event on one line of events.jsonl, or None. A line that an interrupted write cut off
    and a later writer continued (``{"type":"StepLo{"type":"StepLogged",...}``, left by Studio
    versions that appended onto a torn line) gives the event that starts last on it."""
    for text in (line, line[line.rfind('{"type":'):] if line.rfind('{"type":') > 0 else None):
        if text is None:
            continue
        try:
            message = ev.from_json(text)
        except (ValueError, TypeError):
            continue
        return message if isinstance(message, ev.Event) else None
    return None


def iter_events(path: Path) -> Iterator[ev.Event]:
    """Events from an events.jsonl file, in order; unparseable lines are skipped, and a last line
    with no newline (being written, or cut off by a crash or a full disk) is not read."""
    try:
        handle = open(path, encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    with handle:
        for line in handle:
            if not line.endswith("\n"):
                break  # a line still being written, or cut off
            event = parse_event_line(line)
            if event is not None:
                yield event


def drop_torn_tail(path: Path) -> None:
    """Cut a last line with no newline (a write cut off by a kill or a full disk) from ``path``, so
    the next line written starts on a line of its own. Truncating needs no free space."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - (1 << 16))
            while True:
                handle.seek(start)
                tail = handle.read(size - start)
                cut = tail.rfind(b"\n")
                if cut >= 0 or start == 0:
                    break
                start = max(0, start - (1 << 16))
    except FileNotFoundError:
        return
    keep = start + cut + 1 if cut >= 0 else 0
    if keep < size:
        os.truncate(path, keep)


def _slug(text: str) -> str:
    tail = text.rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", tail).strip("-")[:40] or "run"


def create_run(config: RunConfig, root: str | Path | None = None) -> RunDir:
    """Make a new run directory under ``root`` (default: the config's output_dir) and save the config.

    Built as a hidden temp folder and renamed into place when complete, so a failure half way (a
    full disk) leaves nothing that looks like a run; private to its owner (0700, the config 0600).
    Raises :class:`~studio.core.runs.storage.DiskFull` when the disk is full, other OSErrors as they are.
    """
    import shutil

    root = Path(root if root is not None else config.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{_slug(config.name or config.model.base_model)}"
    tmp = root / f".creating-{base}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=DIR_MODE)
        os.chmod(tmp, DIR_MODE)  # mkdir's mode is filtered by the umask; this is not
        (tmp / "checkpoints").mkdir(mode=DIR_MODE)
        config.save(tmp / "config.yaml")
        os.chmod(tmp / "config.yaml", FILE_MODE)
        run_id, n = base, 1
        while True:
            try:
                # rename(2) onto an existing empty folder would succeed: make the name first.
                (root / run_id).mkdir(mode=DIR_MODE)
            except FileExistsError:
                n += 1
                run_id = f"{base}-{n}"
                continue
            try:
                os.rename(tmp, root / run_id)
            except OSError:
                (root / run_id).rmdir()
                raise
            break
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc, root):
            raise DiskFull(root) from exc
        raise
    return RunDir(root / run_id)


@dataclass(frozen=True)
class RunSummary:
    """One line of `studio runs`."""

    run: RunDir
    model: str
    status: str
    step: int
    total_steps: int
    best_eval_loss: float | None
    started: float
    last_loss: float | None
    last_eval_loss: float | None = None
    """The latest evaluation's loss (``best_eval_loss`` is the lowest)."""
    tokens_per_s: float | None = None
    """Training throughput at the latest logged step."""
    memory: ev.MemorySampled | None = None
    """The latest memory sample (of the first GPU when there are several)."""
    failure: str | None = None
    """What the failure that ended the run says (status ``failed``)."""


def summarize(run: RunDir) -> RunSummary:
    """Status and headline numbers of a run, read from its event log."""
    status, step, total, best, last_loss = "created", 0, 0, None, None
    last_eval, rate, memory, failure = None, None, None, None
    model = ""
    try:
        model = run.config().model.base_model
    except Exception:  # a damaged config still lists, so the user can see and remove the run
        model = "?"
    for event in iter_events(run.events_path):
        if isinstance(event, ev.RunStarted):
            status, total = "training", event.total_steps
        elif isinstance(event, ev.StepLogged):
            step, total, last_loss = event.step, event.total_steps, event.loss
            rate = event.tokens_per_s or rate
            if status not in ("paused",):
                status = "training"
        elif isinstance(event, ev.EvalLogged):
            best = event.loss if best is None else min(best, event.loss)
            last_eval = event.loss
        elif isinstance(event, ev.MemorySampled) and not event.rank:
            memory = event
        elif isinstance(event, ev.TrainingPaused):
            status = "paused"
        elif isinstance(event, ev.TrainingResumed):
            status = "training"
        elif isinstance(event, ev.TrainingFinished):
            status = "stopped" if event.stopped else "finished"
            step = event.step
        elif isinstance(event, ev.WorkerFailed) and event.fatal:
            status, failure = "failed", event.message
    if status in ("training", "paused") and run.worker_pid() is None:
        status = "interrupted"
    started = run.path.stat().st_mtime if run.path.exists() else 0.0
    if run.config_path.exists():
        started = run.config_path.stat().st_mtime
    return RunSummary(run, model, status, step, total, best, started, last_loss, last_eval, rate, memory,
                      failure if status == "failed" else None)


def list_runs(root: str | Path = "runs") -> list[RunDir]:
    """Run directories under ``root``, newest first."""
    root = Path(root)
    if not root.exists():
        return []
    # A name starting with "." is a run still being made (create_run's temp folder).
    runs = [RunDir(p) for p in root.iterdir() if not p.name.startswith(".") and (p / "config.yaml").exists()]
    return sorted(runs, key=lambda r: r.id, reverse=True)


def find_run(ref: str | None, root: str | Path = "runs") -> RunDir:
    """A run by path, id, or id prefix; the newest run when ``ref`` is None."""
    if ref and Path(ref).is_dir() and (Path(ref) / "config.yaml").exists():
        return RunDir(Path(ref))
    runs = list_runs(root)
    if not runs:
        raise FileNotFoundError(f"{root}: no runs yet; start one with 'studio train CONFIG'")
    if ref is None:
        return runs[0]
    matches = [r for r in runs if r.id == ref] or [r for r in runs if r.id.startswith(ref)]
    if len(matches) != 1:
        known = ", ".join(r.id for r in runs[:5])
        what = "no run" if not matches else "several runs"
        raise FileNotFoundError(f"{root}: {what} matching '{ref}'; recent runs: {known}")
    return matches[0]

