"""Jobs the worker serves outside training that write files from the model: ``studio export`` (an
ExportRun command) and ``studio embed`` (Embed). Each reports ExportProgress events and ends with one
ExportFinished; the engine does the work, imported only when a job arrives."""

from __future__ import annotations

from collections.abc import Callable

from studio.core import events as ev
from studio.core.runs import RunDir

JOBS = (ev.ExportRun, ev.Embed)
"""The command types :func:`serve_job` handles."""


def serve_job(run: RunDir, command: ev.Command, emit: Callable[[ev.Event], object]) -> ev.ExportFinished:
    """Run one export or embedding job for ``run``; the outcome is emitted and returned, never raised."""
    if isinstance(command, ev.ExportRun):
        from studio.engine.exporting import export_run

        return export_run(run, command.path, command.format, command.quant, command.dtype, emit)
    if isinstance(command, ev.Embed):
        from studio.engine.embed import embed_run

        return embed_run(run, command, emit)
    raise TypeError(f"{type(command).__name__} is not a job the worker serves here")
