"""What every export needs to agree on: the run's adapter, the dtypes a merge may be saved in, and
the error a person reads when an export cannot be done.

The exports themselves (adapter, merged, GGUF) are :mod:`studio.engine.exporting`, which the worker
runs for an ``ExportRun`` command; :mod:`studio.engine.embed` finds the adapter here too.
"""

from __future__ import annotations

from pathlib import Path

from studio.core.runs import RunDir

DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes a merged model may be saved in (the base is loaded unquantized in it)."""


class ExportError(RuntimeError):
    """The export cannot be done; the message says why and what to do."""


def find_adapter(run: RunDir) -> Path:
    """The run's adapter (:meth:`RunDir.adapter`); ExportError if it has none yet."""
    folder = run.adapter()
    if folder is not None:
        return folder
    raise ExportError(f"run {run.id} has no saved adapter yet (looked in {run.adapter_dir} and the "
                      "checkpoints); train or stop the run first")
