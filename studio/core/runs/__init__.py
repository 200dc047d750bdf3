"""Runs: the run directory, the single source of truth for a run, and what is read from it.

- ``directory``: :class:`RunDir` (its paths; ``RunDir.adapter()`` is the one answer to "which adapter
  is the run's"), creating, listing, finding and summarizing runs, reading ``events.jsonl``;
- ``storage``: private modes (0700 / 0600), fsync before a rename, a full disk as one line;
- ``report``: events as text, one wording and one unit (decimal GB) for the CLI and the TUI;
- ``scoring``: exact match and similarity for held-out comparisons;
- ``cells``: one table cell from any value (control characters stripped), for every printed table.

Callers import the run directory's public names from here. Plain Python (no torch).
"""

from studio.core.runs.directory import (
    ADAPTER_STEP_FILE,
    RunDir,
    RunSummary,
    copy_adapter,
    create_run,
    drop_torn_tail,
    find_run,
    is_full_model,
    iter_events,
    list_runs,
    parse_event_line,
    summarize,
)

__all__ = [
    "ADAPTER_STEP_FILE", "RunDir", "RunSummary", "copy_adapter", "create_run", "drop_torn_tail", "find_run",
    "is_full_model", "iter_events", "list_runs", "parse_event_line", "summarize",
]
