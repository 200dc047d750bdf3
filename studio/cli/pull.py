"""``studio pull [MODEL] [--tiny]``: the default model (or any hub model) into the local cache, once
(studio/engine/pull.py says from where), or the tiny test model built."""

from __future__ import annotations

import argparse
import sys

from studio.core.config import DEFAULT_MODEL


def main(args: argparse.Namespace) -> int:
    """``studio pull [MODEL] [--tiny]``: fetch (or build) a model into the local cache."""
    def say(msg: str) -> None:
        print(msg, flush=True)

    try:
        if getattr(args, "tiny", False):
            from studio.engine.tiny import build_tiny_model

            path = build_tiny_model(progress=say)
        else:
            from studio.engine.pull import pull

            path = pull(getattr(args, "model", None) or DEFAULT_MODEL, say)
    except (RuntimeError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
