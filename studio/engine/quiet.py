"""The libraries' own output, kept off the person's screen: it goes to the run's ``worker.log``.

What a person watches (``studio train`` in a terminal, ``studio attach``, the TUI) is Studio's
events: its own progress (ModelLoading) and its own warnings (WarningRaised). The libraries print
theirs besides: transformers' ``Loading weights`` bar, bitsandbytes' note that an optional CPU
kernel package is missing, FutureWarnings about arguments a library will rename. None of that is
something the person can act on, and what matters of it Studio says in its own words. So this
process's library logging, Python warnings and the weight-loading bar go to ``worker.log`` (where a
detached worker's output goes anyway), beside the tracebacks, for whoever reports a bug.

The hub's download bars stay: a first download of a large model is a long wait they measure.
"""

from __future__ import annotations

import logging
from pathlib import Path

LIBRARIES = ("transformers", "bitsandbytes", "peft", "accelerate", "torch", "huggingface_hub", "py.warnings")
"""The loggers routed to the log file (``py.warnings``: Python's warnings, once captured)."""

_handler: logging.Handler | None = None


def send_library_output_to(log_path: Path) -> None:
    """Route the libraries' logging and Python's warnings to ``log_path`` from now on, and turn off
    transformers' own progress bars; call before the model loads (bitsandbytes speaks at import).
    A later call moves them to another run's log (one process may serve several runs in turn)."""
    global _handler
    import huggingface_hub.utils as hub
    import transformers.utils.logging as hf_logging

    handler = logging.FileHandler(log_path, encoding="utf-8", delay=True)
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
    logging.captureWarnings(True)
    downloads_shown = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # Studio's "loading the weights" stage stands for it
    if downloads_shown:
        hub.enable_progress_bars()  # transformers turned the hub's off with its own
