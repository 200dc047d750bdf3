"""Where the VRAM pane's model field finds a model's shape: a config.json file, a model folder, or a
hub id (Studio's cache, the Hugging Face cache, the Hub itself, then the configs Studio bundles).

Only config.json is ever fetched (a few kB, with the standard library: no huggingface_hub import
on the UI's side), and it is kept under Studio's cache directory, so a model looked at once is sized
offline afterwards. Blocking: the pane calls :func:`find_model` from a thread worker.

Plain Python: the UI imports this.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from studio.core.model.info import ModelInfo, ModelInfoError, _hub_cache_config, _known, bundled_config, read_config
from studio.core.model.ref import looks_local
from studio.core.paths import cache_dir

HUB_TIMEOUT_S = 10.0
"""Seconds to wait for the Hub before calling it unreachable."""

WHAT_TO_DO = "give a local folder or a config.json path"


@dataclass(frozen=True)
class ModelSource:
    """A model's shape and where it came from."""

    info: ModelInfo
    """The shape, named by what the person typed."""

    where: str
    """Where config.json was read, in words (shown beside the model's name)."""


class HubUnreachable(OSError):
    """The Hub did not answer (offline, DNS, timeout, HF_HUB_OFFLINE)."""


class HubRefused(OSError):
    """The Hub answered with an error: ``status`` 401/403 (gated or private) or 404 (no such model)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def cached_config(ref: str, revision: str | None = None) -> Path:
    """Where Studio keeps the config.json it fetched for ``ref`` (it may not exist yet)."""
    return cache_dir() / "model_configs" / ref.replace("/", "--") / (revision or "main") / "config.json"


def fetch_config(ref: str, revision: str | None = None, timeout: float = HUB_TIMEOUT_S) -> bytes:
    """config.json of hub model ``ref``, downloaded from the Hub ($HF_ENDPOINT, else huggingface.co),
    with $HF_TOKEN when set. Raises HubUnreachable or HubRefused."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise HubUnreachable("HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    request = urllib.request.Request(f"{endpoint}/{ref}/resolve/{revision or 'main'}/config.json")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        raise HubRefused(exc.code) from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise HubUnreachable(str(exc)) from None


def find_model(ref: str, revision: str | None = None,
               fetch: Callable[[str, str | None], bytes] = fetch_config) -> ModelSource:
    """The shape of ``ref``: a config.json path, a model folder, or a hub id. Raises ModelInfoError
    with a one-line message naming ``ref`` and what to do."""
    ref = ref.strip()
    path = Path(ref).expanduser()
    if path.is_file():
        return ModelSource(read_config(path, ref), "config.json file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelInfoError(f"{ref}: this folder has no config.json; {WHAT_TO_DO}, or a hub id")
        return ModelSource(read_config(path / "config.json", ref), "model folder")
    if looks_local(ref):
        raise ModelInfoError(f"{ref}: no such file or folder; give a hub id (owner/name), a model folder "
                             "or a config.json path")
    cached = cached_config(ref, revision)
    if cached.is_file():
        return ModelSource(read_config(cached, ref), "the Hub's config.json (cached)")
    in_hf_cache = _hub_cache_config(ref, revision)
    if in_hf_cache is not None:
        return ModelSource(read_config(in_hf_cache, ref), "the Hugging Face cache")
    try:
        body = fetch(ref, revision)
    except HubRefused as exc:
        if exc.status == 404:
            raise ModelInfoError(f"{ref}: no such model on the Hub (404); check the id, or {WHAT_TO_DO}") from None
        problem = (f"the Hub refused {ref} (HTTP {exc.status}: gated or private; accept its licence on "
                   "huggingface.co and set HF_TOKEN)")
        short = f"the Hub refused it: HTTP {exc.status}, gated?"
    except HubUnreachable:
        problem = f"could not reach the Hub for {ref} (offline?)"
        short = "the Hub could not be reached: offline?"
    else:
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".part")
        partial.write_bytes(body)
        info = read_config(partial, ref)  # only a config.json that parses is kept
        partial.replace(cached)
        return ModelSource(info, "the Hub")
    bundled = bundled_config(ref)
    if bundled is not None:
        return ModelSource(read_config(bundled, ref), f"Studio's bundled config.json ({short})")
    known = _known(ref)
    if known is not None:
        return ModelSource(known, f"Studio's table of known shapes ({short})")
    raise ModelInfoError(f"{problem}: {WHAT_TO_DO}")
