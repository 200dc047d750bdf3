"""A GPU benchmark's sections in child processes, so that a CUDA fault costs the section it happens
in and no other.

A CUDA fault such as an illegal memory access is sticky: every later CUDA call of the process fails
with it, and tensors freed afterwards (at the next garbage collection, at exit) throw from their
destructor, which aborts the process (``terminate called after throwing an instance of
'c10::AcceleratorError'``, rc 134). In one process, one bad kernel therefore ends every section
after it. Here (:func:`run_sections`) a child process runs the sections in order and logs each one
as it starts and ends (:class:`SectionLog`); one that ends in a CUDA error makes the child stop, and
one whose process dies, hangs past its time or ends without a result becomes an error record that
says how the process ended and what it printed last. The sections after it run in a fresh child.
A CUDA error surfaces at the first call that waits for the GPU, which may be far from the kernel at
fault: a section in ``launch_blocking`` runs alone in a child with ``CUDA_LAUNCH_BLOCKING=1``, where
every launch waits for its kernel, so that the traceback names the operation that faulted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

TAIL_CHARS = 4000
"""How much of a failed section's stderr its error record keeps (the end, where the error is)."""
POLL_S = 0.5


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA runtime error, after which the process's CUDA context is unusable
    (torch's ``AcceleratorError``, or a ``RuntimeError`` that says ``CUDA error``)."""
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in str(exc)


class SectionLog:
    """In the child: what it has done, in a JSON file the parent reads (``done``: each finished
    section's result; ``running``: the section under way; ``since``: when the last section began
    or ended), rewritten whole at each change."""

    def __init__(self, path: Path):
        self.path = path
        self.state: dict = {"done": {}, "running": None, "since": time.time()}
        self._write()

    def _write(self) -> None:
        part = self.path.with_suffix(".part")
        part.write_text(json.dumps(self.state))
        part.replace(self.path)  # the parent never reads half a file

    def start(self, section: str) -> None:
        self.state.update(running=section, since=time.time())
        self._write()

    def done(self, section: str, result: dict) -> None:
        self.state["done"][section] = result
        self.state.update(running=None, since=time.time())
        self._write()

    def leave(self) -> NoReturn:
        """Leave at once. No interpreter teardown: after a CUDA error, freeing the CUDA tensors
        still alive would abort the process."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _ended(rc: int | None, timeout_s: float) -> str:
    """How a child ended, in words: its exit status, the signal that killed it, or the timeout."""
    if rc is None:
        return f"stalled (no section began or ended for {timeout_s:g} s) and was killed"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    if rc == 128 + signal.SIGABRT:
        return f"aborted (rc {rc}: SIGABRT)"
    return f"exited with rc {rc}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"done": {}, "running": None, "since": None}


def _child(argv: list[str], log: Path, timeout_s: float, launch_blocking: bool,
           watch: Callable[[dict], None]) -> tuple[dict, str, str]:
    """Run one child to its end, handing ``watch`` its log as it moves and killing it when the log
    has not moved for ``timeout_s`` (a section that hangs, or a start that never gets to the first
    section): its last log, how it ended, and its stderr (shown here once it ends)."""
    env = dict(os.environ)
    if launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    err_path = log.with_suffix(".stderr")
    launched = time.time()
    with err_path.open("w") as err:
        proc = subprocess.Popen(argv, env=env, stderr=err)  # stdout: shown as it comes
        rc: int | None = None
        while True:
            try:
                rc = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                state = _read(log)
                watch(state)
                if time.time() - (state["since"] or launched) > timeout_s:
                    proc.kill()
                    proc.wait()
                    break
    stderr = err_path.read_text(errors="replace")
    sys.stderr.write(stderr)
    sys.stderr.flush()
    state = _read(log)
    watch(state)
    return state, _ended(rc, timeout_s), stderr


def run_sections(command: Callable[[list[str], Path], list[str]], sections: list[str], timeout_s: float,
                 launch_blocking: set[str] = frozenset(),
                 report: Callable[[str, dict], None] = lambda section, result: None) -> dict[str, dict]:
    """Each of ``sections``' result, run in order by child processes: ``command(batch, log)`` is
    the argv of a child that runs the sections ``batch`` and keeps ``log`` (:class:`SectionLog`),
    stopping after a section whose result has ``cuda_error``. A section whose child dies or is
    killed during it, or before it began, gets an error record (``error``: how the process ended;
    ``stderr_tail``: the end of what it printed), and the sections after it go to a fresh child.
    Those in ``launch_blocking`` run alone, with ``CUDA_LAUNCH_BLOCKING=1``. A child whose log has
    not moved for ``timeout_s`` is killed. ``report(section, result)`` gets each result as soon as
    it is known (the caller writes its file: a caller killed later keeps what was done)."""
    results: dict[str, dict] = {}

    def settle(section: str, result: dict) -> None:
        results[section] = result
        report(section, result)

    pending = list(sections)
    with tempfile.TemporaryDirectory(prefix="sections-") as folder:
        for child in range(len(sections)):  # each child settles one section at least
            if not pending:
                break
            blocking = pending[0] in launch_blocking
            batch = pending[:1] if blocking else pending[:next(
                (i for i, s in enumerate(pending) if s in launch_blocking), len(pending))]
            log = Path(folder) / f"child{child}.json"

            def watch(state: dict, batch: list[str] = batch) -> None:
                for section in batch:
                    if section in state["done"] and section not in results:
                        settle(section, state["done"][section])

            state, how, stderr = _child(command(batch, log), log, timeout_s, blocking, watch)
            done = [s for s in batch if s in state["done"]]
            rest = batch[len(done):]
            if rest and not (done and state["done"][done[-1]].get("cuda_error")):  # it died in rest[0]
                settle(rest[0], {"error": f"the section's process {how} before it ended the section",
                                 "stderr_tail": stderr[-TAIL_CHARS:], "launch_blocking": blocking})
                done.append(rest[0])
            pending = pending[len(done):]
    return results
