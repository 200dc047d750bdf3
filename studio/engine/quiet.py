"""The libraries' own output, kept off the person's screen: it goes to the run's ``worker.log``.

What a person watches (``studio train`` in a terminal, ``studio attach``, the TUI) is Studio's
events: its own progress (ModelLoading) and its own warnings (WarningRaised). The libraries print
theirs besides: transformers' ``Loading weights`` bar, bitsandbytes' note that an optional CPU
kernel package is missing, FutureWarnings about arguments a library will rename. None of that is
something the person can act on, and what matters of it Studio says in its own words. So this
process's library logging, the libraries' Python warnings and the weight-loading bar go to
``worker.log`` (where a detached worker's output goes anyway), beside the tracebacks, for whoever
reports a bug. Studio's own Python warnings still reach the terminal.

The hub's download bars stay: a first download of a large model is a long wait they measure.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TextIO

LIBRARIES = ("transformers", "bitsandbytes", "peft", "accelerate", "torch", "huggingface_hub", "py.warnings")
"""The loggers routed to the log file (``py.warnings``: the libraries' Python warnings)."""

_PACKAGE = str(Path(__file__).resolve().parents[1])
_handler: logging.Handler | None = None
_shown_before = warnings.showwarning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """Python's ``warnings.showwarning`` while routed: Studio's own warnings (raised in its code, not
    a library's deprecation pointing at Studio's call) reach the terminal as before, the rest the log."""
    own = filename.startswith(_PACKAGE) and not issubclass(
        category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))
    if own:
        _shown_before(message, category, filename, lineno, file, line)
    else:
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        logging.getLogger("py.warnings").warning("%s", text)


class _RunLog(logging.FileHandler):
    """The run's ``worker.log``, appended to; a write that fails is dropped without a word (its folder
    may be gone: a deleted run, a test's temporary run), since saying so would be the noise itself."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:  # opening the file (FileHandler opens it outside its own error handling)
            pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass


def send_library_output_to(log_path: Path) -> None:
    """Route the libraries' logging and Python's warnings to ``log_path`` from now on, and turn off
    transformers' own progress bars; call before the model loads (bitsandbytes speaks at import).
    A later call moves them to another run's log (one process may serve several runs in turn)."""
    global _handler, _shown_before
    import huggingface_hub.utils as hub
    import transformers.utils.logging as hf_logging

    handler = _RunLog(log_path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
    hf_logging.disable_default_handler()  # its handler writes to the terminal
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        if _handler is not None:
            logger.removeHandler(_handler)
        logger.addHandler(handler)
        logger.propagate = False
    if _handler is not None:
        _handler.close()
    _handler = handler
    if warnings.showwarning is not _show_warning:
        _shown_before = warnings.showwarning
        warnings.showwarning = _show_warning
    downloads_shown = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # Studio's "loading the weights" stage stands for it
    if downloads_shown:
        hub.enable_progress_bars()  # transformers turned the hub's off with its own
