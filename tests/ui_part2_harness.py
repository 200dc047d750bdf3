"""A small App with the attributes the training and chat panes expect (docs/CONTRACTS.md).

It holds ``config`` and ``run``, records every command sent, and, when ``live`` is set, starts the
real worker and follows its events (through studio.worker.client) like Studio does. Snapshot tests feed
it recorded events instead, so their plots are deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from textual.app import App, ComposeResult
from textual.widget import Widget
from textual.widgets import Footer

from studio.core import events as ev
from studio.core.config import RunConfig
from studio.core.runs import RunDir


class PaneHarness(App):
    """Mounts one pane; ``feed(events)`` hands it events the way the app does (batched)."""

    CSS = "Screen { layout: vertical; }"

    def __init__(self, make_pane: Callable[[], Widget], config: RunConfig, run: RunDir | None = None,
                 live: bool = False) -> None:
        super().__init__()
        self.make_pane = make_pane
        self.config = config
        self.current_run = run
        self.live = live
        self.sent: list[ev.Command] = []
        self.opened: list[tuple[RunDir, bool]] = []
        self.client = None
        self._pending: list[ev.Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def compose(self) -> ComposeResult:
        yield self.make_pane()
        yield Footer()

    def panes(self) -> list[Widget]:
        """Mounted widgets that take events (the panes)."""
        return [w for w in self.query("*") if hasattr(w, "handle_events")]

    def feed(self, events: list[ev.Event]) -> None:
        """Deliver a batch of events to every pane that takes them."""
        for pane in self.panes():
            pane.handle_events(events)

    def send_command(self, command: ev.Command) -> None:
        """Record the command; forward it to the worker when live."""
        self.sent.append(command)
        if self.client is not None:
            self.client.send(command)

    def open_run(self, run: RunDir, start_worker: bool = False) -> None:
        """Switch to ``run``: reset panes, and when live connect (starting the worker if asked)."""
        self.current_run = run
        self.opened.append((run, start_worker))
        for pane in self.panes():
            if hasattr(pane, "reset_run"):
                pane.reset_run(run)
        if self.live:
            self._connect(run, start_worker)

    def _connect(self, run: RunDir, start_worker: bool) -> None:
        from studio.worker.client import WorkerClient
        from studio.worker.client import start_worker as launch

        self._close_client()
        if start_worker and run.worker_pid() is None:
            launch(run)
        self.client = WorkerClient(run)
        self.client.connect(timeout=60)
        self._stop = threading.Event()
        threading.Thread(target=self._follow, args=(self.client, self._stop), daemon=True).start()
        self.set_interval(0.1, self._deliver)

    def _follow(self, client, stop: threading.Event) -> None:
        for event in client.events():
            if stop.is_set():
                return
            with self._lock:
                self._pending.append(event)

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self.feed(batch)

    def _close_client(self) -> None:
        self._stop.set()
        if self.client is not None:
            self.client.close()
            self.client = None

    async def on_unmount(self) -> None:
        self._close_client()
