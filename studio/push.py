"""``studio push RUN --repo user/name [--private] [--merged]``: the run's adapter (or merged model) on the Hub.

The folder is made by the run's worker, exactly as ``studio export`` makes it (the adapter with its
model card, or the merged safetensors), then uploaded with ``huggingface_hub``: the repo is created
if missing and the folder goes up as one commit. The token comes from the usual places (``HF_TOKEN``,
or ``hf auth login``'s stored token), and ``HF_ENDPOINT`` points it at another Hub. Offline, without
a token or without access: one line saying what to do. No torch here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from studio.core import events as ev
from studio.core.runs import find_run

_REPO_HELP = "give --repo as user/name (or org/name)"


class PushError(RuntimeError):
    """The upload cannot go ahead; the message says what to do."""


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def check_ready(repo: str) -> str:
    """The token to upload with; PushError when the repo name, the network mode or the token is wrong."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PushError(f"--repo {repo!r}: {_REPO_HELP}")
    try:
        from huggingface_hub import constants, get_token
    except ImportError:
        raise PushError("pushing needs huggingface_hub: pip install huggingface_hub") from None
    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it when this machine is online")
    token = get_token()
    if not token:
        raise PushError("no Hugging Face token found; run 'hf auth login' (or set HF_TOKEN to a token with "
                        "write access from https://huggingface.co/settings/tokens) and push again")
    return token


def upload(folder: Path, repo: str, token: str, private: bool, message: str) -> str:
    """Create ``repo`` if needed and upload ``folder`` as one commit; returns the repo's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)
    try:
        url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(folder), repo_id=repo, repo_type="model", commit_message=message)
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise PushError(f"the Hub refused the token for {repo} (HTTP {status}); check that it has write "
                            "access ('hf auth login' with a write token) and that you may write to that "
                            "namespace") from None
        raise PushError(f"the Hub answered HTTP {status} for {repo}: {_first_line(exc)}") from None
    except Exception as exc:  # requests / httpx connection errors are not one class tree
        if isinstance(exc, OSError) or any(w in type(exc).__name__.lower() for w in ("connect", "timeout")):
            raise PushError(f"cannot reach the Hub at {api.endpoint} ({_first_line(exc)}); check the network, "
                            "or HF_ENDPOINT if you use a mirror") from None
        raise PushError(f"uploading to {repo} failed: {type(exc).__name__}: {_first_line(exc)}") from None
    return str(url)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main(args: argparse.Namespace) -> int:
    """``studio push [RUN] --repo user/name [--private] [--merged]``."""
    from studio.cli_export import run_job

    run = find_run(getattr(args, "run", None), getattr(args, "runs_dir", None) or "runs")
    try:
        token = check_ready(args.repo)
    except PushError as exc:
        return _fail(str(exc))
    fmt = "merged" if args.merged else "adapter"
    folder = (run.path / "export" / f"push-{fmt}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}").resolve()
    result = run_job(run, ev.ExportRun(path=str(folder), format=fmt), str(folder), f"export {fmt}")
    if isinstance(result, str):
        return _fail(result)
    if not result.ok:
        return _fail(result.message)
    print(f"uploading {folder} to {args.repo}…", file=sys.stderr, flush=True)
    try:
        url = upload(folder, args.repo, token, args.private, f"Upload {fmt} of Studio run {run.id}")
    except PushError as exc:
        return _fail(str(exc))
    print(url)
    return 0
