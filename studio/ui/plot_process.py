"""Plot frames built in a helper process, so a keypress never waits behind plotext.

plotext is pure Python: one frame of a loss curve is 20-100 ms of CPU. Built in a thread of the UI
process it holds the GIL for most of that time, and a key pressed meanwhile waits (the events
benchmark saw p95 keypress-to-paint triple while plots were building). Here a figure is described as
data (:class:`Figure`), sent to one long-lived helper process, drawn there by plotext and parsed
into a Rich ``Text``, which comes back as its plain text and styled spans (a few kB, about a
millisecond to load).

The helper starts on first use: a fresh ``python -c`` that imports only plotext and Rich, talking
pickles over its stdin and stdout. If it cannot start or keeps dying, :func:`submit` raises
:class:`HelperDied` and the caller draws in a thread instead.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.style import Style
from rich.text import Span, Text

MAX_POINTS = 600
"""Most points per curve handed to plotext; more are thinned evenly (the last point always kept)."""
DOTS_PER_CELL = 2
"""Braille markers draw 2 dots across a terminal cell: more points than that per column cannot show."""

HELPER_NICENESS = 10
"""How much lower the helper's CPU priority is than the app's (``os.nice``)."""

Curve = tuple[Sequence[float], Sequence[float], str, str, str]
"""(xs, ys, label, colour, marker) of one line or point series."""

POINTS = "dot"
"""The marker of a series drawn as separate points, not joined by a line: an evaluation every few
steps is a measurement at those steps, and a line between them would claim values in between."""


def thin(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most ``limit`` evenly spaced points of a curve, keeping the first and the last."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    stride = n / (limit - 1)
    picks = sorted({min(n - 1, round(i * stride)) for i in range(limit - 1)} | {n - 1})
    return [xs[i] for i in picks], [ys[i] for i in picks]


@dataclass(frozen=True)
class Figure:
    """What a plot shows, as plain data (it crosses to the helper process)."""

    curves: tuple[Curve, ...] = ()
    title: str = ""
    xlabel: str = "step"

    def paint(self, plt: Any, width: int) -> None:
        """Draw on the plotext figure ``plt`` that is ``width`` columns wide."""
        # plotext's build time grows with the points, and a curve cannot show more than the braille
        # dots across the plot's columns: thin to those.
        limit = max(32, min(MAX_POINTS, DOTS_PER_CELL * width))
        for xs, ys, label, color, marker in self.curves:
            xs, ys = thin(xs, ys, limit)
            draw = plt.scatter if marker == POINTS else plt.plot
            draw(xs, ys, label=label or None, color=color, marker=marker)
        plt.title(self.title)
        plt.xlabel(self.xlabel)


def render_figure(plt: Any, figure: Figure, width: int, height: int, theme: str) -> Text:
    """``figure`` drawn by plotext figure object ``plt`` at ``width`` x ``height`` in ``theme``."""
    plt.clear_figure()
    figure.paint(plt, width)
    plt.plotsize(width, height)
    plt._set_size(width, height)  # see textual-plotext issue 5: the size needs both calls
    plt.theme(theme)
    return Text.from_ansi(plt.build())


def _build(figure: Figure, width: int, height: int, theme_name: str, theme: Any) -> tuple[Text, float]:
    """In the helper process: the frame, and the CPU seconds it took."""
    global _FIGURE
    from plotext._dict import themes
    from plotext._figure import _figure_class

    started = time.process_time()
    if theme is not None:
        themes[theme_name] = theme
    if _FIGURE is None:
        _FIGURE = _figure_class()
    text = render_figure(_FIGURE, figure, width, height, theme_name)
    return text, time.process_time() - started


_FIGURE: Any = None
"""The helper process's plotext figure, made on its first build."""


def serve() -> None:
    """The helper process: read (id, figure, width, height, theme name, theme) requests pickled on
    stdin, answer (id, frame, CPU seconds) or (id, None, error text) pickled on stdout, until EOF."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may reach the pipe
    try:
        # A frame is background work: on a busy machine the UI's event loop (a keypress) and the
        # training worker come first, and a frame waits a little longer.
        os.nice(HELPER_NICENESS)
    except (AttributeError, OSError):
        pass
    while True:
        try:
            request_id, *args = pickle.load(source)
        except (EOFError, OSError):
            return
        try:
            text, seconds = _build(*args)
            # Styles cross as strings: a pickled rich Style keeps the hash this process computed
            # (string hashes differ between processes), so it would not equal the same style there.
            spans = [(span.start, span.end, str(span.style)) for span in text.spans]
            answer: tuple[int, Any, Any] = (request_id, (text.plain, spans), seconds)
        except Exception as exc:  # a bad figure fails its own request, not the helper
            answer = (request_id, None, f"{type(exc).__name__}: {exc}")
        pickle.dump(answer, sink, protocol=pickle.HIGHEST_PROTOCOL)
        sink.flush()


class HelperDied(RuntimeError):
    """The helper process is gone (or could not start)."""


class _Helper:
    """One helper process, a thread writing its requests and a thread reading its answers."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the studio package
        code = f"import sys; sys.path.insert(0, {root!r}); from studio.ui.plot_process import serve; serve()"
        # stderr goes nowhere: the helper shares the terminal the app is drawing on.
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.pending: dict[int, Future[tuple[Text, float]]] = {}
        self.requests: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.alive = True
        self._ids = itertools.count()
        self._lock = threading.Lock()
        threading.Thread(target=self._write, name="plot-helper-writer", daemon=True).start()
        threading.Thread(target=self._read, name="plot-helper-reader", daemon=True).start()

    def submit(self, *args: Any) -> Future[tuple[Text, float]]:
        future: Future[tuple[Text, float]] = Future()
        with self._lock:
            if not self.alive:
                raise HelperDied("the plot helper process has exited")
            request_id = next(self._ids)
            self.pending[request_id] = future
        self.requests.put((request_id, *args))
        return future

    def _write(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        while (request := self.requests.get()) is not None:
            try:
                pickle.dump(request, stdin, protocol=pickle.HIGHEST_PROTOCOL)
                stdin.flush()
            except (OSError, ValueError):
                break
        try:
            stdin.close()
        except OSError:
            pass

    def _read(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        while True:
            try:
                request_id, result, detail = pickle.load(stdout)
            except Exception:
                break  # EOF: the helper exited
            with self._lock:
                future = self.pending.pop(request_id, None)
            if future is None or future.cancelled():
                continue
            if result is None:
                future.set_exception(RuntimeError(f"plot helper: {detail}"))
                continue
            plain, spans = result
            text = Text(plain, spans=[Span(start, end, Style.parse(style)) for start, end, style in spans])
            future.set_result((text, detail))
        with self._lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(HelperDied("the plot helper process exited"))

    def stop(self) -> None:
        self.requests.put(None)  # the helper sees EOF and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_helper: _Helper | None = None
_helper_lock = threading.Lock()
_starts = 0
MAX_STARTS = 3
"""A helper that keeps dying is not restarted past this: frames are then built in-process."""


def submit(figure: Figure, width: int, height: int, theme_name: str, theme: Any) -> Future[tuple[Text, float]]:
    """Build a frame in the helper process; the future holds (frame, CPU seconds). Raises
    :class:`HelperDied` if no helper can run (the caller builds in-process then)."""
    global _helper, _starts
    with _helper_lock:
        if _helper is None or not _helper.alive:
            if _starts >= MAX_STARTS:
                raise HelperDied("the plot helper process keeps exiting")
            _starts += 1
            try:
                _helper = _Helper()
            except OSError as exc:
                _starts = MAX_STARTS
                raise HelperDied(f"cannot start the plot helper: {exc}") from exc
        helper = _helper
    return helper.submit(figure, width, height, theme_name, theme)


def shutdown() -> None:
    """Stop the helper process (the app is quitting); a build under way is abandoned."""
    global _helper
    with _helper_lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.stop()


atexit.register(shutdown)


if __name__ == "__main__":
    serve()
