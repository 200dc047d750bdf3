"""Which run the app follows, and which run a request about the config being edited goes to.

The app follows one run at a time (:meth:`~studio.ui.app.StudioApp.open_run`); this is the one place
that decides which: the newest run of the runs folder when Studio opens (as ``studio attach`` does),
the run picked in the run picker, the run whose worker answers a zero-shot preview or an early chat
question, and the run Start trains.

A run made only so that a worker can answer for the config is a *draft*. Start trains the draft
while the config is still the one it was made from (its model is loaded already), so a preview and
then Start make one run, not two; a draft that never trained is removed (worker and folder) when
another run is followed or Studio quits, so that it never stays listed as ``created``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the first frame imports no run machinery
    from studio.core.config import RunConfig
    from studio.core.runs import RunDir
    from studio.ui.app import StudioApp


class RunChoice:
    """The app's choices of run (see the module docstring); the app asks, this decides."""

    def __init__(self, app: StudioApp) -> None:
        """``app`` follows the runs chosen here (``open_run``) and holds the config they are made from."""
        self._app = app
        self._draft: tuple[RunDir, RunConfig] | None = None
        """The followed run when :meth:`for_config` made it and it has not trained, with the config
        it was made from."""

    def draft(self) -> RunDir | None:
        """The followed run if it is a draft that has not trained, else None."""
        if self._draft is not None and self._draft[0] == self._app.current_run:
            return self._draft[0]
        return None

    def leaving(self, previous: RunDir | None, run: RunDir | None) -> bool:
        """The app stops following ``previous`` for ``run``: True when ``previous`` is a draft that
        never trained, to be removed (it is forgotten here)."""
        if previous is None or previous == run or self.draft() != previous:
            return False
        self._draft = None
        return True

    def follow_latest(self) -> None:
        """Follow the newest run of the runs folder, found in a thread (a directory listing), unless
        a run is followed by the time it is found."""
        self._app.run_worker(self._find_latest, name="find_latest_run", group="latest-run", thread=True,
                             exclusive=True, exit_on_error=False, description="looking for the latest run")

    def _find_latest(self) -> None:
        from studio.core.runs import list_runs

        runs = list_runs(self._app.config.output_dir)
        if runs:
            self._app.call_from_thread(self._open_latest, runs[0])

    def _open_latest(self, run: RunDir) -> None:
        if self._app.current_run is None:
            self._app.open_run(run)

    def pick(self) -> None:
        """The run picker: Enter follows the highlighted run (its plots, its chat; the config being
        edited stays), ``c`` compares two marked runs' curves."""
        from studio.ui.widgets.run_picker import CompareScreen, PickResult, RunPickerScreen

        app = self._app

        def picked(result: PickResult) -> None:
            if result is None:
                return
            kind, value = result
            if kind == "compare" and isinstance(value, list):
                app.push_screen(CompareScreen(value))
            elif kind == "open" and not isinstance(value, list):
                # A live worker on that run is reconnected when a command needs it; a finished run
                # needs none until chat asks.
                app.open_run(value)

        app.push_screen(RunPickerScreen(app.config.output_dir), picked)

    def for_config(self) -> RunDir | None:
        """The run whose worker answers for the config being edited: the followed run when its worker
        loads the model the config names (same model and quantization settings), else a draft made
        from the config, followed from now on with its worker started. None (with a notice) when no
        run folder can be made."""
        app = self._app
        run = app.current_run
        if run is not None:
            made_from = self._draft[1] if self.draft() == run and self._draft else _config_of(run)
            if made_from is not None and (made_from.model, made_from.quantization) == \
                    (app.config.model, app.config.quantization):
                return run
        run = self._new_run()
        if run is not None:
            app.open_run(run, start_worker=True)
            self._draft = (run, copy.deepcopy(app.config))
        return run

    def for_training(self) -> RunDir | None:
        """The run Start trains, followed with its worker started: the followed draft when it was
        made from this very config (its model is loaded already), else a new run. No longer a draft
        from now on: it stays. None (with a notice) when no run folder can be made."""
        app = self._app
        run = app.current_run
        if run is None or self._draft != (run, app.config):
            run = self._new_run()
            if run is None:
                return None
            app.open_run(run, start_worker=True)
        self._draft = None
        return run

    def _new_run(self) -> RunDir | None:
        """A new run folder made from the config being edited; None (with a notice) when it cannot
        be made."""
        from studio.core.runs import create_run

        config = self._app.config
        try:
            return create_run(config)
        except OSError as exc:
            self._app.notify(f"Cannot create a run directory under {config.output_dir}: {exc}",
                             title="No run made", severity="error", timeout=10)
            return None


def _config_of(run: RunDir) -> RunConfig | None:
    """The config ``run`` was made from (a small YAML file), or None when it cannot be read."""
    try:
        return run.config()
    except (OSError, ValueError):
        return None
