"""The one way a test runs the `studio` command in a fresh process: ``python -m studio.cli ARGS``.

In-process runs call :func:`studio.cli.main` itself (``main(["train", ...])``); a test needs a fresh
process where the command must own its process (signals, exit codes, a worker it becomes, stdout
of its own), and runs it through these.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

Arg = str | Path


def studio_command(*args: Arg) -> list[str]:
    """The argv of `studio ARGS` for this interpreter and checkout."""
    return [sys.executable, "-m", "studio.cli", *map(str, args)]


def run_studio(*args: Arg, cwd: Path | str | None = None, env: Mapping[str, str] | None = None,
               timeout: float | None = None, merge_stderr: bool = False) -> subprocess.CompletedProcess[str]:
    """`studio ARGS` to the end, its output captured as text (stderr into stdout with ``merge_stderr``)."""
    return subprocess.run(studio_command(*args), cwd=cwd, env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)


def start_studio(*args: Arg, cwd: Path | str | None = None, env: Mapping[str, str] | None = None,
                 quiet: bool = False) -> subprocess.Popen[str]:
    """`studio ARGS` started and left running: its stdout and stderr as one text pipe, or thrown
    away when ``quiet``."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(studio_command(*args), cwd=cwd, env=env, text=True, stdout=out,
                            stderr=subprocess.DEVNULL if quiet else subprocess.STDOUT)
