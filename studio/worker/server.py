"""The worker's command loop: one thread owns the trainer, the others only talk.

Past ~400 lines on purpose: the command handlers all read and change one state machine (state,
trainer, pause/stop flags, the held-out request, the connected clients); split over modules they
would reach into each other's privates.

Threads:
- the control thread (the caller of :meth:`Worker.serve`) owns the trainer: it loads, trains,
  generates and evaluates. While training it serves commands in the trainer's ``between_steps``
  hook, so generation and status answers come between optimizer steps.
- an accept thread, and per client a reader (commands into one queue) and a sender (its own
  outgoing queue, so a slow client never stalls training; one that falls too far behind is
  dropped and catches up from the event log when it reconnects).

Every event goes through :meth:`Worker.emit`: numbered, appended to ``events.jsonl`` (flushed),
then offered to every client. Replies meant for one client (StatusReported, errors about a
command) carry ``seq = -1`` and are not logged.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core import events as ev
from studio.core.config import ConfigError
from studio.core.data.load import DataError
from studio.core.events import FailureKind, WorkerState
from studio.core.runs import RunDir
from studio.core.runs.storage import DiskFull, is_disk_full, make_private
from studio.worker.engine_session import EngineSession, SessionFactory, StepHook
from studio.worker.eventlog import EventLog
from studio.worker.jobs import JOBS, serve_job
from studio.worker.launch import WorkerListener
from studio.worker.peer import Peer
from studio.worker.trackers import TrackerHub, start_trackers

if TYPE_CHECKING:
    from studio.engine.evaluate import HeldOutScoring


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's out-of-memory error. Only the engine raises it, having loaded
    torch to do so: with torch not loaded it cannot be one (and the worker never loads torch itself)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def classify_failure(exc: BaseException, log_path: Path) -> ev.WorkerFailed:
    """A WorkerFailed event for ``exc`` (one the engine did not report itself), its kind by its type,
    and what to do about it."""
    detail = "".join(traceback.format_exception(exc))
    if out_of_memory(exc):
        return ev.WorkerFailed(kind=FailureKind.OOM, detail=detail, message=(
            f"out of GPU memory even at micro-batch 1 ({exc}); lower data.max_seq_length, keep "
            "trainer.gradient_checkpointing on, use quantization.bits: 4, or pick a smaller model"))
    if isinstance(exc, DataError):
        return ev.WorkerFailed(kind=FailureKind.DATA, message=str(exc), detail=detail)
    if isinstance(exc, ConfigError):
        return ev.WorkerFailed(kind=FailureKind.CONFIG, message=str(exc), detail=detail)
    return ev.WorkerFailed(kind=FailureKind.CRASH, detail=detail,
                           message=f"{type(exc).__name__}: {exc} (full traceback in {log_path})")


def default_trainer_factory() -> SessionFactory:
    """The engine's Session class (it loads, trains, generates, evaluates), or the one named by
    $STUDIO_WORKER_TRAINER ("module:attr"), which tests use to drive the worker with a stand-in."""
    import importlib

    spec = os.environ.get("STUDIO_WORKER_TRAINER", "studio.engine.session:Session")
    module, _, attr = spec.partition(":")
    factory: SessionFactory = getattr(importlib.import_module(module), attr)
    return factory


class Worker:
    """Serves one run: the trainer, the event log, and the connected clients."""

    def __init__(self, run: RunDir, trainer_factory: SessionFactory | None = None,
                 linger_s: float = 60.0, foreground: bool = False):
        """``foreground``: the worker of ``studio train`` in a terminal. It exits once its first
        command (the training) is done, and a hang-up of the terminal stops it with a checkpoint
        (a detached worker ignores SIGHUP)."""
        self.run = run
        self.foreground = foreground
        self.stop_requested = False
        """Set (from a signal handler too: a plain flag takes no lock) to stop training after the
        current step with a checkpoint, as the Stop command does."""
        # A run folder made by an older Studio (or copied in) may be readable by anyone: it holds
        # prompts, answers and data excerpts. Said once the log is open (WorkerStarted's note).
        self._tightened = make_private(run.path)
        self.log = EventLog(run.events_path, run.id)
        self.disk_full: DiskFull | None = None
        """Set when an event could not be logged for want of space."""
        self.disk_failure: str | None = None
        """The one line said when a write failed for want of space (the worker then exits)."""
        self.commands: queue.Queue[tuple[Peer | None, ev.Command]] = queue.Queue()
        self.state = WorkerState.IDLE
        self.step = 0
        self.total_steps = 0
        self.model_loaded = False
        self.linger_s = linger_s
        self._trainer_factory = trainer_factory
        self._session: EngineSession | None = None
        self._peers: set[Peer] = set()
        # Orders log writes with client registration; re-entrant because dropping a slow client
        # from inside emit() unregisters it.
        self._lock = threading.RLock()
        self._paused = False
        self._exit_reason: str | None = None
        self._stop_training = False
        self._last_client_left = time.monotonic()
        self._terminate = threading.Event()
        self._evaluations = 0
        self._warnings = 0
        self._scoring: HeldOutScoring | None = None  # the held-out request being answered a row at a time
        self.trackers: TrackerHub | None = None
        """report_to: the experiment trackers that also get the metrics (started by :meth:`serve`)."""
        self._closing = False
        self._disk_reported = False

    # ------------------------------------------------------------------------------ events out

    def emit(self, event: ev.Event) -> ev.Event:
        """Number, log and broadcast ``event``; also the trainer's emit callback."""
        self._track(event)
        with self._lock:
            try:
                event, line = self.log.append(event)
            except DiskFull as exc:
                # Not in the log (it stays whole), but the clients connected now still hear it.
                self.disk_full = self.disk_full or exc
                line = ev.to_json(ev.with_seq(event, -1)).encode()
                for peer in list(self._peers):
                    peer.offer(line)
                raise
            for peer in list(self._peers):
                peer.offer(line)
        if self.trackers is not None:
            self.trackers.offer(event)
        return event

    def _stop_for_disk_full(self, exc: BaseException) -> None:
        """A write failed for want of space: fail the run with the one line that says where and
        what to do (logged if it still fits, sent to the connected clients anyway), then exit."""
        if self._disk_reported:
            return  # a later write failing the same way (the stop's checkpoint) adds nothing
        self._disk_reported = True
        full = exc if isinstance(exc, DiskFull) else self.disk_full or DiskFull(
            getattr(exc, "filename", None) or self.run.path, self.run.id)
        self.state = WorkerState.FAILED
        self._exit_reason = f"disk full at {full.path}"
        self.disk_failure = str(full)
        try:
            self.emit(ev.WorkerFailed(kind="disk", fatal=True, message=str(full)))
        except DiskFull:
            pass  # sent live, unnumbered; the log ends at its last whole event

    def _track(self, event: ev.Event) -> None:
        """Keep the status fields current from the events themselves."""
        if isinstance(event, ev.RunStarted):
            self.step, self.total_steps = event.resumed_from_step, event.total_steps
        elif isinstance(event, ev.StepLogged):
            self.step, self.total_steps = event.step, event.total_steps
        elif isinstance(event, ev.ModelLoaded):
            self.model_loaded = True
        elif isinstance(event, ev.EvalLogged):
            self._evaluations += 1
        elif isinstance(event, (ev.WarningRaised, ev.WorkerFailed)):
            self._warnings += 1
        elif isinstance(event, ev.TrainingFinished):
            self.step = event.step

    def status(self) -> ev.StatusReported:
        """What the worker is doing now ("scoring": answering held-out rows while not training)."""
        state = WorkerState.SCORING if self._scoring is not None and not self.state.in_training else self.state
        return ev.StatusReported(state=state, step=self.step, total_steps=self.total_steps,
                                 run_id=self.run.id, model_loaded=self.model_loaded)

    # ------------------------------------------------------------------------------ clients

    def _accept_loop(self, listener: WorkerListener) -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:
                if self._exit_reason is not None:
                    return
                continue  # a client that hung up before it was accepted
            except Exception:  # nothing a client does may end the accept loop
                continue
            # The key handshake waits on the client: in its own thread, with a time limit, so one
            # client that connects and sends nothing never holds up the others.
            threading.Thread(target=self._admit, args=(listener, conn), name="worker-handshake",
                             daemon=True).start()

    def _admit(self, listener: WorkerListener, conn: Connection) -> None:
        """Authenticate ``conn``, then register and greet it; a wrong key or silence hangs it up."""
        try:
            listener.authenticate(conn)
        except Exception:  # AuthenticationError, EOFError, OSError: not a client of ours
            conn.close()
            return
        peer = Peer(conn, self.commands, self._forget)
        with self._lock:
            if self._closing:  # exiting: no new client now
                conn.close()
                return
            # Registered and greeted under the log lock: every event logged before this point
            # is in the file the client reads after the greeting, every later one is sent live.
            self._peers.add(peer)
            peer.reply(self.status())
            # Started under the lock too: _close() must never find a registered peer whose
            # threads it cannot join yet.
            peer.start()

    def _forget(self, peer: Peer) -> None:
        with self._lock:
            self._peers.discard(peer)
            if not self._peers:
                self._last_client_left = time.monotonic()

    # ------------------------------------------------------------------------------ the loop

    def serve(self, listener: WorkerListener, first: ev.Command | None = None) -> str:
        """Run until Shutdown, SIGTERM, or idle with no client for ``linger_s``; returns why."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            def terminate(*_: Any) -> None:
                self._terminate.set()

            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, terminate)
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, terminate if self.foreground
                                                    else signal.SIG_IGN)
        if first is not None:
            self.state = WorkerState.LOADING  # before any client can ask, so none sees a passing "idle"
            self.commands.put((None, first))
        self.trackers = start_trackers(self.run, self.emit)
        threading.Thread(target=self._accept_loop, args=(listener,), name="worker-accept",
                         daemon=True).start()
        try:
            self._guard_disk(self._started)
            while self._exit_reason is None:
                try:
                    peer, command = self.commands.get_nowait() if self._scoring is not None else \
                        self.commands.get(timeout=0.25)
                except queue.Empty:
                    if self._scoring is not None:
                        self._score_next_row()
                    self._check_idle()
                    continue
                self._guard_disk(self._handle_idle, peer, command)
                if self.foreground and command is first:
                    self._exit_reason = self._exit_reason or f"training {self.state}"
        finally:
            # Also on KeyboardInterrupt in a foreground worker: the socket, key and pid go.
            self._exit_reason = self._exit_reason or "interrupted"
            self._close(listener)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self._exit_reason

    def _started(self) -> None:
        self.emit(ev.WorkerStarted(pid=os.getpid()))
        if self._tightened:
            self.emit(ev.WarningRaised(kind="config", message=(
                f"note: {self.run.path} was readable by other users; made it private (folders 0700, "
                f"files 0600; {self._tightened} modes changed): it holds prompts, answers and data")))

    def _guard_disk(self, action: Callable[..., Any], *args: Any) -> None:
        """Run ``action(*args)``; a full disk ends the worker with its one-line report."""
        try:
            action(*args)
        except OSError as exc:
            if not is_disk_full(exc, self.run.path):
                raise
            self._stop_for_disk_full(exc)

    def _check_idle(self) -> None:
        if self._terminate.is_set():
            self._exit_reason = "terminated (SIGTERM)"
        elif not self._peers and not self.state.in_training and self._scoring is None and \
                time.monotonic() - self._last_client_left > self.linger_s:
            self._exit_reason = f"idle with no client for {self.linger_s:g} s"

    def _close(self, listener: WorkerListener) -> None:
        if self.trackers is not None:
            self.trackers.close()
        try:
            self.emit(ev.WorkerStopped(reason=self._exit_reason or ""))
        except DiskFull:
            pass  # sent live, unnumbered: the clients still learn that the worker is gone
        with self._lock:
            self._closing = True
            peers = list(self._peers)
        for peer in peers:
            peer.finish(timeout=2.0)
        listener.close()
        for path in (Path(self.run.socket_address()), self.run.key_path, self.run.pid_path):
            path.unlink(missing_ok=True)
        self.log.close()

    def _handle_idle(self, peer: Peer | None, command: ev.Command) -> None:
        """A command while not training."""
        if isinstance(command, ev.Shutdown):
            self._exit_reason = "shutdown requested"
        elif isinstance(command, ev.StartTraining):
            self._train(command.resume)
        elif isinstance(command, ev.LoadModel):
            self._ensure_trainer()
        elif isinstance(command, (ev.Pause, ev.Resume, ev.Stop)):
            self._reply(peer, ev.WorkerFailed(kind="config", fatal=False, request=type(command).__name__, message=(
                f"{type(command).__name__.lower()}: run {self.run.id} is not training "
                f"(state: {self.state})")))
        else:
            self._serve_anytime(peer, command)

    def _serve_anytime(self, peer: Peer | None, command: ev.Command) -> None:
        """Commands served the same way idle or between steps: generate, evaluate, status."""
        if isinstance(command, ev.Status):
            self._reply(peer, self.status())
        elif isinstance(command, ev.Generate):
            self._generate(command)
        elif isinstance(command, ev.Evaluate):
            if self._ensure_trainer():
                self._guarded(self._evaluate, "Evaluate")
        elif isinstance(command, ev.ScoreHeldOut):
            self._start_scoring(command)
        elif isinstance(command, JOBS) and not self.state.in_training:
            self._guarded(lambda: self._serve_job(command), type(command).__name__)
        else:
            self._reply(peer, ev.WorkerFailed(kind="config", fatal=False, request=type(command).__name__, message=(
                f"{type(command).__name__} is not served while the worker is {self.state}")))

    def _start_scoring(self, command: ev.ScoreHeldOut) -> None:
        """Begin a held-out comparison; its rows are answered one at a time when nothing else waits
        (between training steps too), so chat and training go on meanwhile."""
        from studio.engine.evaluate import HeldOutScoring

        def refuse(message: str) -> None:
            self.emit(ev.HeldOutFinished(request_id=command.request_id, ok=False, message=message))

        if self._scoring is not None:
            refuse(f"run {self.run.id} is already scoring held-out rows; wait for that to finish")
            return
        if not self._ensure_trainer():
            refuse(f"the model did not load; the failure above says why (details in {self.run.log_path})")
            return
        session = self._session
        assert session is not None  # loaded by _ensure_trainer

        def generate(row: dict[str, str], adapter: bool, max_new_tokens: int | None) -> str:
            return session.generate(row, adapter=adapter, max_new_tokens=max_new_tokens, temperature=0.0).text

        grpo = session.grpo  # GRPO: greedy answers to each row's prompt, scored by the run's rewards
        try:
            preference = session.preference  # DPO / ORPO: pairs scored by margin too
            if grpo is not None:
                self._scoring = HeldOutScoring(self.run, command, lambda row, adapter, _n: grpo.answer(row, adapter),
                                               self.emit, render=grpo.render, rewards=grpo.score_row)
            else:
                self._scoring = HeldOutScoring(self.run, command, generate, self.emit, render=session.render_prompt,
                                               margin=preference.margin if preference is not None else None)
        except (OSError, ValueError) as exc:  # DataError is a ValueError: a message a person can act on
            refuse(str(exc))

    def _score_next_row(self) -> None:
        scoring = self._scoring
        assert scoring is not None
        try:
            if scoring.next_row():
                self._scoring = None
        except Exception as exc:  # reported; the worker and any training go on
            self._scoring = None
            self._report(exc, request="ScoreHeldOut")
            self.emit(ev.HeldOutFinished(request_id=scoring.request.request_id, ok=False,
                                         message=f"scoring stopped at row {len(scoring.results) + 1}: {exc}"))

    def _serve_job(self, command: ev.Command) -> None:
        previous, self.state = self.state, WorkerState.EXPORTING
        try:
            serve_job(self.run, command, self.emit)
        finally:
            self.state = previous

    def _reply(self, peer: Peer | None, event: ev.Event) -> None:
        if peer is not None:
            peer.reply(event)
        elif isinstance(event, ev.WorkerFailed):
            self.emit(event)

    def _guarded(self, action: Callable[[], Any], request: str) -> bool:
        """Run ``action`` (the command ``request``); a failure becomes a WorkerFailed naming that
        request, and the worker stays up."""
        try:
            action()
            return True
        except Exception as exc:  # every failure is reported, none kills the worker
            self._report(exc, request=request)
            return False

    def _report(self, exc: Exception, request: str = "") -> None:
        """Log the traceback and emit a WorkerFailed (fatal, or of ``request`` alone), unless the
        trainer already emitted one; a full disk stops the worker (:meth:`_stop_for_disk_full`)."""
        if is_disk_full(exc, self.run.path):
            self._stop_for_disk_full(exc)
            return
        try:
            if self.foreground:
                # The terminal shows the one-line WorkerFailed; the traceback goes where a daemon's goes.
                with open(self.run.log_path, "a", encoding="utf-8") as log:
                    traceback.print_exception(exc, file=log)
            else:
                traceback.print_exception(exc)
        except OSError:
            pass  # worker.log cannot take it; the event below still says what happened
        if not isinstance(exc, ev.ReportedFailure):  # the engine's own failures are reported already
            self.emit(dataclasses.replace(classify_failure(exc, self.run.log_path), fatal=not request,
                                          request=request))

    def _evaluate(self) -> None:
        """The trainer emits EvalLogged itself; with no validation rows it has nothing to emit."""
        assert self._session is not None  # loaded by _ensure_trainer
        before, warned = self._evaluations, self._warnings
        self._session.evaluate()
        if self._evaluations == before and self._warnings == warned:  # not skipped for memory either
            self.emit(ev.WarningRaised(kind="data", message=(
                "nothing to evaluate: the run has no validation rows; set data.val_fraction or give "
                "the data a split column with 1 for validation rows")))

    def _ensure_trainer(self, for_training: bool = False) -> bool:
        """Build the trainer and load the model once; False (with a WorkerFailed) if that fails.

        Loaded to answer (LoadModel, Generate, Evaluate) rather than to train, the model gets the
        run's trained adapter when it has one (chat with a past run), not an untrained LoRA.
        """
        if self._session is not None and self.model_loaded:
            return True
        previous, self.state = self.state, WorkerState.LOADING
        try:
            if self._session is None:
                factory = self._trainer_factory or default_trainer_factory()
                self._session = factory(self.run.config(), self.run, self.emit,
                                        between_steps=self._between_steps)
            self._session.load()
            if not for_training:
                self._session.load_trained_adapter()
        except Exception as exc:
            self._report(exc)
            self.state = WorkerState.FAILED
            return False
        self.model_loaded = True
        self.state = previous
        return True

    def _train(self, resume: bool) -> None:
        if not self._ensure_trainer(for_training=True):
            return
        assert self._session is not None
        self.state = WorkerState.TRAINING
        self._paused = False
        self._stop_training = False
        try:
            self._session.train(resume=resume)
        except Exception as exc:
            self._report(exc)
            self.state = WorkerState.FAILED
            return
        finally:
            self._paused = False
        self.state = WorkerState.STOPPED if self._stop_training else WorkerState.FINISHED

    def _generate(self, command: ev.Generate) -> None:
        """Stream an answer; every request ends with a GenerationFinished (empty when it failed)."""
        request = command.request_id or f"gen-{time.monotonic_ns()}"
        self.emit(ev.GenerationStarted(request_id=request, adapter=command.adapter, prompt=command.prompt))
        if not self._ensure_trainer():
            self.emit(ev.GenerationFinished(request_id=request, adapter=command.adapter))
            return

        def on_text(text: str) -> None:
            self.emit(ev.TokenGenerated(request_id=request, text=text))

        session = self._session
        assert session is not None  # loaded by _ensure_trainer

        def run() -> None:
            result = session.generate(command.row or command.prompt, adapter=command.adapter,
                                      max_new_tokens=command.max_new_tokens, temperature=command.temperature,
                                      top_p=command.top_p, on_text=on_text)
            self.emit(ev.GenerationFinished(request_id=request, adapter=command.adapter, text=result.text,
                                            new_tokens=result.new_tokens, tokens_per_s=result.tokens_per_s))

        if not self._guarded(run, "Generate"):
            self.emit(ev.GenerationFinished(request_id=request, adapter=command.adapter))

    # ------------------------------------------------------------------------ between steps

    def _between_steps(self, trainer: StepHook | None = None) -> str | None:
        """The trainer's hook after every optimizer step: serve queued commands; "stop" ends training.

        While paused this blocks here, still serving generation and status, until Resume or Stop.
        """
        while True:
            if self._terminate.is_set():
                self._exit_reason = "terminated (SIGTERM)"
            if self.stop_requested:
                self._stop_training = True
            if self._exit_reason is not None or self._stop_training:
                self._stop_training = True
                return "stop"
            try:
                peer, command = self.commands.get(timeout=0.25) if self._paused else \
                    self.commands.get_nowait()
            except queue.Empty:
                if self._scoring is not None:
                    self._score_next_row()  # one held-out row per optimizer step
                if self._paused:
                    if trainer is not None:
                        trainer.keep_alive()  # a data-parallel run's other ranks keep waiting
                    continue
                return None
            if isinstance(command, ev.Pause):
                if not self._paused:
                    self._paused, self.state = True, WorkerState.PAUSED
                    self.emit(ev.TrainingPaused(step=self.step))
            elif isinstance(command, ev.Resume):
                if self._paused:
                    self._paused, self.state = False, WorkerState.TRAINING
                    self.emit(ev.TrainingResumed(step=self.step))
            elif isinstance(command, ev.Stop):
                self._stop_training = True
            elif isinstance(command, ev.Shutdown):
                self._exit_reason = "shutdown requested"
            elif isinstance(command, (ev.StartTraining, ev.LoadModel)):
                self._reply(peer, ev.WorkerFailed(kind="config", fatal=False, request=type(command).__name__, message=(
                    f"run {self.run.id} is already {self.state}; pause, resume or stop it instead")))
            else:
                self._serve_anytime(peer, command)
