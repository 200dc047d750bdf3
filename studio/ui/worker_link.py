"""The app's link to the current run's worker: commands out, events in.

Commands queue in :attr:`WorkerLink.outbox` and are sent by a thread worker that connects to the
run's worker first (starting it when asked). Events are read from the run's log (history, then live)
by another thread worker into :attr:`WorkerLink.events`, and posted to the panes on a timer
(:data:`EVENT_FLUSH_S`) as :class:`~studio.ui.messages.WorkerEvents` batches and
:class:`~studio.ui.messages.MemorySample` messages: a message per event would flood the panes'
queues. The threads are Textual workers run through the app, so ``app.workers`` lists them.

Which run is followed is the app's fact (``app.current_run``); the link reads it there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from textual.worker import get_current_worker

from studio.ui.messages import MemorySample, WorkerEvents

if TYPE_CHECKING:  # imported where used: not needed for the first frame
    from textual.widget import Widget

    from studio.core import events as ev
    from studio.core.runs import RunDir
    from studio.ui.app import StudioApp

EVENT_FLUSH_S = 0.2
"""Events are posted to the panes at most this often (5 batches a second), however fast they arrive."""


class WorkerLink:
    """The connection between one :class:`~studio.ui.app.StudioApp` and its current run's worker."""

    def __init__(self, app: StudioApp) -> None:
        """``app`` owns the link: it says which run is current and runs the link's threads."""
        self._app = app
        self.events: deque[ev.Event] = deque()
        """Events read from the run's log and not yet handed to the panes (filled by a thread)."""
        # Every event of the current run, and how many of them each pane has been given: a pane
        # mounted late (hidden panes mount after the first frame) catches up on the next flush.
        self.history: list[ev.Event] = []
        self.delivered: dict[Widget, int] = {}
        self.outbox: queue.Queue[ev.Command] = queue.Queue()
        """Commands waiting for the worker's connection."""
        self._send_lock = threading.Lock()
        self._client: Any = None
        self._follower: Any = None

    def start(self) -> None:
        """Begin posting events to the panes (called once the app is mounted)."""
        self._app.set_interval(EVENT_FLUSH_S, self.flush)

    def leave(self, previous: RunDir | None, run: RunDir | None, discard: bool = False) -> None:
        """Stop following ``previous`` before ``run`` is followed: its follower closes, queued events
        are forgotten, and its worker is shut down if it only served previews (``discard``: and its
        folder removed, see :meth:`retire`)."""
        if previous is not None and previous != run:
            self.retire(previous, discard)
        if self._follower is not None:
            self._follower.close()
        self._client = None
        self.events.clear()
        self.history.clear()
        self.delivered.clear()

    def follow(self, run: RunDir | None, start_worker: bool) -> None:
        """Read ``run``'s events from the start of its log (the app's current run by now); connect to
        its worker, starting it when ``start_worker``. No run: the old follower is cancelled."""
        if run is None:
            self._app.workers.cancel_group(self._app, "events")
            return
        self._app.run_worker(partial(self._follow_events, run), name="_follow_events", group="events",
                             exclusive=True, thread=True, exit_on_error=False, description="following events")
        if start_worker:
            self.deliver(start=True)

    def queue(self, command: ev.Command) -> None:
        """Hold ``command`` until :meth:`deliver` sends it."""
        self.outbox.put(command)

    def deliver(self, start: bool) -> None:
        """Send the queued commands from a thread, connecting first (starting the worker when
        ``start``)."""
        self._app.run_worker(partial(self._deliver, start), name="_deliver", group="commands",
                             thread=True, exit_on_error=False, description="talking to the worker")

    def _deliver(self, start: bool) -> None:
        """Connect to the run's worker (starting it when asked) and send every queued command."""
        from studio.core import events as ev
        from studio.worker.client import WorkerClient, WorkerStartError, connect_or_start

        while True:
            if not self._send_lock.acquire(blocking=False):
                return  # the thread holding the lock sends what is queued
            try:
                run = self._app.current_run
                if run is None:
                    return
                if self._client is None or self._client.run != run or not self._client.connected:
                    if start:
                        client = connect_or_start(run, timeout=30)
                    else:
                        client = WorkerClient(run)
                        client.connect(timeout=30)
                    self._client = client
                while not self.outbox.empty():
                    self._client.send(self.outbox.get_nowait())
            except Exception as exc:  # shown to the person; the UI stays up whatever the worker does
                self._client = None
                # Commands meant for a worker that never came must not reach a later one (a Stop
                # would otherwise start it and train the queued StartTraining for a step).
                while not self.outbox.empty():
                    self.outbox.get_nowait()
                if isinstance(exc, WorkerStartError):
                    # Panes fold this like any failure: the training pane leaves "loading".
                    self.events.append(ev.WorkerFailed(kind="config", fatal=True, message=str(exc)))
                self._app.call_from_thread(self._app.notify, f"Could not reach the worker: {exc}",
                                           title="Worker", severity="error", timeout=10)
                return
            finally:
                self._send_lock.release()
            if self.outbox.empty():
                return

    def retire(self, run: RunDir, discard: bool = False) -> None:
        """In a thread: shut ``run``'s worker down if the run never trained (it only answered previews
        or chat), so that the GPU is free; with ``discard``, also remove the run's folder once no
        worker is left in it, unless it holds something (training, held-out results). The thread is
        not a daemon when it discards: quitting Studio waits the moment it takes."""
        threading.Thread(target=partial(_retire, run, discard), name="studio-retire-worker",
                         daemon=not discard).start()

    def _follow_events(self, run: RunDir) -> None:
        """Read the run's events (history, then live) into :attr:`events`, which :meth:`flush`
        drains on a timer."""
        from studio.worker.client import WorkerClient

        worker = get_current_worker()
        client = WorkerClient(run)
        self._follower = client
        try:
            for event in client.events(poll_s=0.25):
                if worker.is_cancelled or self._app.current_run != run:
                    break
                self.events.append(event)
        finally:
            client.close()

    def flush(self) -> None:
        """Post every mounted pane the events it has not seen yet (all of them, for a pane that
        mounted after the run's history was read): one :class:`WorkerEvents` batch, and the newest
        memory sample of each card as a :class:`MemorySample` that a later one of that card replaces
        while it waits."""
        from studio.core import events as ev

        while self.events:
            self.history.append(self.events.popleft())
        run = self._app.current_run
        if run is None:
            return
        split: dict[int, tuple[list[ev.Event], list[ev.MemorySampled]]] = {}
        for pane in self._app.panes:
            seen = self.delivered.get(pane, 0)
            if not pane.is_mounted or seen >= len(self.history):
                continue
            self.delivered[pane] = len(self.history)
            if seen not in split:  # panes mounted together share one split of their events
                fresh = self.history[seen:]
                newest = {e.rank: e for e in fresh if isinstance(e, ev.MemorySampled)}  # one a card
                split[seen] = ([e for e in fresh if not isinstance(e, ev.MemorySampled)],
                               [newest[rank] for rank in sorted(newest)])
            batch, samples = split[seen]
            if batch:
                pane.post_message(WorkerEvents(run, batch))
            for sample in samples:
                pane.post_message(MemorySample(run, sample))

    def close(self) -> None:
        """Close the follower and the client: the follower's events() loop ends, so its thread (and
        the app) can exit."""
        for client in (self._follower, self._client):
            if client is not None:
                client.close()


RETIRE_WAIT_S = 10.0
"""How long a discarded run's worker is given to exit after Shutdown before its folder is left alone."""


def _retire(run: RunDir, discard: bool) -> None:
    """Shut down ``run``'s worker if the run never trained; with ``discard``, remove its folder once
    the worker is gone (see :meth:`WorkerLink.retire`)."""
    import shutil

    from studio.core import events as ev
    from studio.core.runs import iter_events
    from studio.worker.client import WorkerClient

    def holds_results() -> bool:
        return (run.path / "eval.json").exists() or any(
            isinstance(e, ev.RunStarted) for e in iter_events(run.events_path))

    if holds_results():
        return
    if run.worker_pid() is not None:
        try:
            # A connection of its own: the link's client may be closing meanwhile (Studio quitting).
            sender = WorkerClient(run)
            sender.connect(timeout=5)
            sender.send(ev.Shutdown())
            sender.close()
        except Exception:  # best effort: a worker that is already gone needs no shutdown
            pass
    if not discard:
        return
    deadline = time.monotonic() + RETIRE_WAIT_S
    while run.worker_pid() is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if run.worker_pid() is None and not holds_results():
        shutil.rmtree(run.path, ignore_errors=True)

