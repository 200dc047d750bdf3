"""`studio` with no subcommand (and `studio chat`): open the TUI.

With no arguments it opens on the bundled sample config and data with the default model, so a first
run shows something real at once. ``--config`` edits a file (Save writes it back), ``--data`` opens
another dataset, a run reference follows that run; without one, the newest run of the runs folder
is followed (plots redrawn from its log), as `studio attach` does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studio.core.config import ConfigError, RunConfig, default_config, load_config
from studio.core.config.reader import error_lines
from studio.core.paths import sample_data_dir


def initial_config(config_path: str | None, data: str | None) -> tuple[RunConfig, Path | None]:
    """The config to open and the path Save writes to (None: ask, never the bundled sample).

    A relative data path in a config file is made absolute (against the working directory, then the
    file's folder) so that the browser opens it from wherever Studio was started.
    """
    from studio.core.paths import resolve_path

    if config_path:
        path: Path | None = Path(config_path)
        config = load_config(path)
        base = path.parent
    else:
        path = None
        sample = sample_data_dir() / "sample_config.yaml"
        config = load_config(sample) if sample.exists() else default_config()
        base = sample.parent
    if data:
        config.data.path = data
    elif config.data.path:
        found = resolve_path(config.data.path, base)
        if found is not None and not Path(config.data.path).is_absolute() and path is None:
            config.data.path = str(found.resolve())
    return config, path


def main(args: argparse.Namespace) -> int:
    """Run the TUI until the person quits; 2 on a config or run that cannot be opened."""
    run = None
    ref = getattr(args, "run", None)
    runs_dir = getattr(args, "runs_dir", "runs")
    name = "sample config"
    try:
        if ref is not None or getattr(args, "pane", None) == "chat":
            from studio.core.runs import find_run

            run = find_run(ref, runs_dir)
            config, path = run.config(), None
            name = f"config of run {run.id}"
        else:
            config, path = initial_config(getattr(args, "config", None), getattr(args, "data", None))
    except (ConfigError, FileNotFoundError) as exc:
        print(error_lines(exc), file=sys.stderr)
        return 2
    if runs_dir != "runs":
        config.output_dir = runs_dir

    import gc

    from studio.ui.app import StudioApp

    # With no run named, the newest run of the runs folder is followed: a run outlives the UI.
    app = StudioApp(config, path, run, initial_pane=getattr(args, "pane", None), follow_latest=True,
                    config_name=name, freeze_gc=True)
    gc.freeze()  # the imported modules live as long as the process: no collection need walk them
    app.run()
    return 0
