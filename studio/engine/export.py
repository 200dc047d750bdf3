"""Export a run's adapter merged into its base model, as a plain model folder (bf16 by default).

The base is loaded unquantized in the export dtype (merging into 4-bit weights would round the
update away), the adapter is attached with peft, merged with ``merge_and_unload()``, and the result
saved with its tokenizer. The folder loads with ``AutoModelForCausalLM.from_pretrained`` alone.
The worker calls :func:`export_merged` for the ``ExportMerged`` command; progress goes out as
``ExportProgress`` events and the outcome as one ``ExportFinished``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import RunDir

DTYPES = ("bfloat16", "float16", "float32")


class ExportError(RuntimeError):
    """The export cannot be done; the message says why and what to do."""


def find_adapter(run: RunDir) -> Path:
    """The run's adapter (:meth:`RunDir.adapter`); ExportError if it has none yet."""
    folder = run.adapter()
    if folder is not None:
        return folder
    raise ExportError(f"run {run.id} has no saved adapter yet (looked in {run.adapter_dir} and the "
                      "checkpoints); train or stop the run first")


def _base_model_ref(run: RunDir) -> str:
    """Where to load the run's base model from: the engine's resolver when it has one."""
    config = run.config()
    try:
        from studio.engine import model as engine_model
    except ImportError:
        return config.model.base_model
    resolve = getattr(engine_model, "resolve_model_path", None)
    return str(resolve(config.model.base_model)) if resolve else config.model.base_model


def export_merged(run: RunDir, path: str | Path, dtype: str = "bfloat16",
                  emit: Callable[[ev.Event], object] | None = None) -> ev.ExportFinished:
    """Merge ``run``'s adapter into its base and save the model and tokenizer to ``path``.

    Never raises: the outcome is the returned (and emitted) ExportFinished, with a message a person
    can act on when it failed. The folder is written beside ``path`` first and renamed when
    complete, so a failed export leaves nothing half-written at ``path``.
    """
    send = emit or (lambda _event: None)
    dest = Path(path)
    started = time.monotonic()

    def progress(stage: str, fraction: float) -> None:
        send(ev.ExportProgress(path=str(dest), stage=stage, fraction=fraction))

    tmp = dest.with_name(dest.name + ".partial")
    try:
        if dtype not in DTYPES:
            raise ExportError(f"export dtype '{dtype}' is not one of {', '.join(DTYPES)}")
        if dest.exists():
            raise ExportError(f"{dest} already exists; choose a new folder")
        adapter = find_adapter(run)
        config = run.config()
        progress("loading the base model", 0.05)
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base_ref = _base_model_ref(run)
        model = AutoModelForCausalLM.from_pretrained(
            base_ref, dtype=getattr(torch, dtype), revision=config.model.revision,
            trust_remote_code=config.model.trust_remote_code)
        progress("attaching the adapter", 0.45)
        model = PeftModel.from_pretrained(model, str(adapter))
        progress("merging the adapter into the weights", 0.6)
        model = model.merge_and_unload()
        progress("saving", 0.75)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        if (adapter / "tokenizer_config.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(adapter)
        else:
            tokenizer = AutoTokenizer.from_pretrained(base_ref, revision=config.model.revision)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dest)
        progress("done", 1.0)
        finished = ev.ExportFinished(path=str(dest), ok=True, seconds=time.monotonic() - started)
    except ExportError as exc:
        finished = ev.ExportFinished(path=str(dest), ok=False, message=str(exc))
    except Exception as exc:  # every failure becomes a message; the worker stays up
        shutil.rmtree(tmp, ignore_errors=True)
        finished = ev.ExportFinished(path=str(dest), ok=False, message=(
            f"merging run {run.id} failed: {type(exc).__name__}: {exc}; see {run.log_path}"))
    send(finished)
    return finished
