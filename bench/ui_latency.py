"""How fast Studio's TUI paints: time to first frame, and keypress to painted frame on 100k rows.

    python bench/ui_latency.py            # writes bench/ui_latency.json

A 100k-row alpaca JSONL is generated in a temp dir and `studio --data FILE` runs on a pseudo-terminal
of 100x30, exactly as in a person's terminal: keys are written to it and "paint" is the moment the
app's repaint reaches the terminal.

- first_paint_s: from launching ``python -m studio.cli`` (a fresh process, so imports count) to the
  first frame on the terminal (median of 5 launches).
- first_paint_cpu_s: the CPU time the process used by then (what the wall time would be on an idle
  core; the committed numbers come from a 2-core VM shared with other jobs, see load_average).
- dataset_pane_paint_s: launch to the dataset pane's own widgets on screen (the first frame is the
  app's chrome; the panes are imported and mounted right after it).
- keypress_to_paint_ms: p95 over key presses a person makes while browsing: next/previous page of
  100 rows (the table is refilled from an Arrow slice), cursor down (the row view and the template
  preview follow), and typing a character in the filter box.
Targets from the issue: first paint under 0.5 s, keypress to paint under 50 ms.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import pty
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = 100_000

def make_rows(path: Path, n: int = ROWS) -> Path:
    """``n`` alpaca rows of varied length."""
    with open(path, "w") as handle:
        for i in range(n):
            words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(5 + i % 40))
            handle.write(json.dumps({"instruction": f"Task {i}: reverse these words.", "input": words,
                                     "output": " ".join(reversed(words.split())), "split": i % 10 // 9})
                         + "\n")
    return path


class Terminal:
    """``studio --data DATA`` on a pseudo-terminal of 100x30, as over SSH: we read what it paints."""

    def __init__(self, data: Path, size: tuple[int, int] = (100, 30)) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        env = dict(os.environ, PYTHONPATH=str(ROOT), STUDIO_CONFIG_DIR=tempfile.mkdtemp(),
                   TERM="xterm-256color", COLUMNS=str(size[0]), LINES=str(size[1]))
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "studio.cli", "--data", str(data)],
                                     stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tempfile.gettempdir(),
                                     start_new_session=True)
        os.close(slave)
        self.fd = master
        self.screen = b""

    def read(self, timeout: float) -> bytes:
        """Whatever the app writes within ``timeout`` seconds of waiting for the first byte."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return b""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except OSError:
            return b""
        self.screen = (self.screen + chunk)[-(1 << 22):]
        return chunk

    def wait_for(self, text: str, timeout: float) -> float:
        """Seconds since launch when ``text`` first appears on screen."""
        deadline = time.perf_counter() + timeout
        needle = text.encode()
        while needle not in self.screen:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{text!r} never painted; last output: {self.screen[-400:]!r}")
            self.read(0.05)
        return time.perf_counter() - self.started

    def quiet(self, seconds: float) -> None:
        """Read until nothing is written for ``seconds``."""
        while self.read(seconds):
            pass

    def press(self, key: bytes) -> float:
        """Milliseconds from writing ``key`` to the first byte of the repaint."""
        start = time.perf_counter()
        os.write(self.fd, key)
        if not self.read(2.0):
            return float("nan")
        return (time.perf_counter() - start) * 1000

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        os.close(self.fd)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc): unlike wall time, not inflated by
    other processes competing for the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_paint(data: Path, runs: int = 9) -> tuple[list[float], list[float], list[float]]:
    """Wall seconds from launch to the first frame (the tab bar painted), the CPU seconds the
    process had used by then, and wall seconds to the dataset pane's own widgets painted (its
    filter box), over fresh processes."""
    times, cpu, pane = [], [], []
    for _ in range(runs):
        term = Terminal(data)
        try:
            times.append(term.wait_for("Template", 60))
            cpu.append(cpu_seconds(term.proc.pid))
            pane.append(term.wait_for("filter (col:text)", 60))
        finally:
            term.close()
    return times, cpu, pane


KEYS = {"next_page": b"]", "cursor_down": b"\x1b[B", "prev_page": b"["}


def keypresses(data: Path, repeats: int = 20) -> dict[str, list[float]]:
    """Milliseconds from each key press to the repaint, by kind of key, once 100k rows are loaded."""
    results: dict[str, list[float]] = {name: [] for name in (*KEYS, "filter_char")}
    term = Terminal(data)
    try:
        term.wait_for("of 100,000", 180)
        term.quiet(3.0)  # statistics and lint done, the toast gone
        for _ in range(repeats):
            for name, key in KEYS.items():
                results[name].append(term.press(key))
                term.quiet(0.3)
        term.press(b"/")
        term.quiet(0.5)
        for char in b"w12 reverse":
            results["filter_char"].append(term.press(bytes([char])))
            term.quiet(0.5)  # the search runs 0.25 s after the last key, in a thread
    finally:
        term.close()
    return results


def p95(values: list[float]) -> float:
    ordered = sorted(v for v in values if v == v)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = make_rows(Path(tmp) / "rows_100k.jsonl")
        keys = keypresses(data)  # the first open also fills the datasets cache, as any re-open finds it
        paints, paint_cpu, pane_paints = first_paint(data)
    every = [v for values in keys.values() for v in values]
    result = {
        "first_paint_s": round(statistics.median(paints), 3),
        "first_paint_runs_s": [round(t, 3) for t in paints],
        "first_paint_cpu_s": round(statistics.median(paint_cpu), 3),
        "dataset_pane_paint_s": round(statistics.median(pane_paints), 3),
        "keypress_to_paint_ms": round(p95(every), 1),
        "keypress_to_paint_ms_by_key_p95": {k: round(p95(v), 1) for k, v in keys.items()},
        "keypress_to_paint_ms_median": round(statistics.median(every), 1),
        "rows": ROWS,
        "terminal": "100x30 pseudo-terminal, TERM=xterm-256color",
        "command": "python bench/ui_latency.py",
        "machine": f"{platform.node()} · {platform.processor() or platform.machine()} · "
                   f"{os.cpu_count()} cores · Python {platform.python_version()}",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    out = ROOT / "bench" / "ui_latency.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
