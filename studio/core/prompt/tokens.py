"""The model's tokenizer through the ``tokenizers`` package alone: token counts without torch.

The UI counts tokens while a person edits a template or browses data, long before (and without) a
model in memory. ``tokenizers`` reads ``tokenizer.json`` in milliseconds; ``transformers`` would
import torch and take seconds, so it is never imported here.

A tokenizer is found, in order, in: a local folder (or a ``tokenizer.json`` path), Studio's cache
(:func:`studio.core.paths.cache_dir`, where ``studio pull`` and the tiny test model put theirs) and
the Hugging Face hub cache. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from studio.core.model.ref import local_problem
from studio.core.paths import cache_dir


class TokenizerNotFound(FileNotFoundError):
    """No tokenizer.json for the model could be found locally; the message says where we looked."""


@dataclass
class TokenizerInfo:
    """A tokenizer with the bits of its config the prompt layer needs."""

    tokenizer: Tokenizer
    """The fast tokenizer, loaded from tokenizer.json."""

    folder: Path
    """The folder that holds tokenizer.json (and tokenizer_config.json when there is one)."""

    eos_id: int | None = None
    """End-of-sequence token id, appended to every response so the model learns to stop."""

    bos_id: int | None = None
    """Beginning-of-sequence token id, when the model's tokenizer prepends one."""

    eos_token: str | None = None
    """End-of-sequence token text (``<|im_end|>``, ``</s>``)."""

    bos_token: str | None = None
    """Beginning-of-sequence token text."""

    add_bos: bool = False
    """Whether the model expects its BOS token at the start of every sequence."""

    chat_template: str | None = None
    """The tokenizer's own Jinja chat template, or None when it has none."""


def _candidate_folders(ref: str) -> list[Path]:
    """Where a model's tokenizer may live on this machine, most specific first."""
    folders: list[Path] = []
    path = Path(ref).expanduser()
    if path.is_file():
        folders.append(path.parent)
    elif path.is_dir():
        folders.append(path)
    # Studio's cache: converted or built models live under cache_dir() by their name.
    studio = cache_dir()
    slug = ref.replace("/", "--")
    for sub in (ref, slug, f"models/{ref}", f"models/{slug}", f"models--{slug}"):
        folders.append(studio / sub)
    folders.extend(_hub_snapshots(ref))
    return folders


def _hub_cache() -> Path:
    """The Hugging Face hub cache folder, honouring the same environment variables as the hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface" / "hub"


def _hub_snapshots(ref: str, revision: str | None = None) -> list[Path]:
    """Snapshot folders of ``ref`` in the hub cache: the revision's (or main's) first, then others."""
    if "/" not in ref or ref.startswith(("/", ".", "~")):
        return []
    repo = _hub_cache() / ("models--" + ref.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return []
    found: list[Path] = []
    ref_file = repo / "refs" / (revision or "main")
    if ref_file.is_file():
        found.append(snapshots / ref_file.read_text().strip())
    elif revision:
        found.append(snapshots / revision)
    found.extend(sorted(p for p in snapshots.iterdir() if p not in found))
    return found


def find_tokenizer_folder(ref: str, revision: str | None = None) -> Path:
    """The folder holding ``tokenizer.json`` for a model folder, file or hub id; no download.

    Raises :class:`TokenizerNotFound` naming the places searched and what to do.
    """
    if not Path(ref).expanduser().exists() and (problem := local_problem(ref)):
        raise TokenizerNotFound(problem)  # a folder that is not there: say so, not where else we looked
    folders = _candidate_folders(ref)
    if revision:
        folders = _hub_snapshots(ref, revision) + folders
    for folder in folders:
        if (folder / "tokenizer.json").is_file():
            return folder
    raise TokenizerNotFound(
        f"{ref}: no tokenizer.json found in the folder, in Studio's cache ({cache_dir()}) or in the "
        f"Hugging Face cache ({_hub_cache()}); run 'studio pull {ref}' or give a local model folder"
    )


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The chat template: chat_template.jinja (newer transformers) or tokenizer_config.json's key."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the default one is what apply_chat_template would use.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def load_tokenizer(ref: str | Path, revision: str | None = None) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a model (local folder, tokenizer.json path or cached hub id)."""
    return load_tokenizer_info(ref, revision).tokenizer


def load_tokenizer_info(ref: str | Path, revision: str | None = None) -> TokenizerInfo:
    """The tokenizer plus its EOS/BOS ids and chat template, read from the model's files."""
    folder = find_tokenizer_folder(str(ref), revision)
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise TokenizerNotFound(f"{folder / 'tokenizer.json'}: cannot read the tokenizer ({exc}); "
                                "re-download or rebuild the model folder") from None
    config = _read_json(folder / "tokenizer_config.json")
    special = _read_json(folder / "special_tokens_map.json")
    model_config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")

    def token(name: str) -> str | None:
        return _token_text(config.get(name)) or _token_text(special.get(name))

    def token_id(text: str | None, key: str) -> int | None:
        if text is not None and tokenizer.token_to_id(text) is not None:
            return tokenizer.token_to_id(text)
        # No text in the tokenizer files: the model's own config names the id.
        for source in (generation, model_config):
            value = source.get(key)
            if isinstance(value, list) and value:
                value = value[0]
            if isinstance(value, int):
                return value
        return None

    eos_token, bos_token = token("eos_token"), token("bos_token")
    eos_id = token_id(eos_token, "eos_token_id")
    bos_id = token_id(bos_token, "bos_token_id")
    if eos_token is None and eos_id is not None:
        eos_token = tokenizer.id_to_token(eos_id)
    if bos_token is None and bos_id is not None:
        bos_token = tokenizer.id_to_token(bos_id)
    add_bos = bool(config.get("add_bos_token", _post_processor_adds(tokenizer, bos_id)))
    return TokenizerInfo(
        tokenizer=tokenizer, folder=folder, eos_id=eos_id, bos_id=bos_id, eos_token=eos_token,
        bos_token=bos_token, add_bos=add_bos and bos_id is not None,
        chat_template=_chat_template(folder, config),
    )


def _post_processor_adds(tokenizer: Tokenizer, bos_id: int | None) -> bool:
    """Whether encoding with special tokens puts BOS first (Llama-style post-processors do)."""
    if bos_id is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def make_tokenize(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    """A ``str -> ids`` callable without special tokens: what :func:`studio.core.prompt.encode` wants."""

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return tokenize


def count_tokens(
    tokenize: Tokenizer | Callable[[str], Sequence[int]],
    texts: Iterable[str],
    progress: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Token count of each text. A ``Tokenizer`` is run in parallel batches (fast on 100k rows).

    ``progress(done, total)`` is called after each batch, for a progress bar over large datasets.
    """
    texts = [t if isinstance(t, str) else "" if t is None else str(t) for t in texts]
    step = 8192  # bounded batches keep memory flat and give the progress bar something to show
    counts: list[int] = []
    for start in range(0, len(texts), step):
        batch = texts[start:start + step]
        if isinstance(tokenize, Tokenizer):
            counts.extend(len(e.ids) for e in tokenize.encode_batch(batch, add_special_tokens=False))
        else:
            counts.extend(len(tokenize(t)) for t in batch)
        if progress is not None:
            progress(len(counts), len(texts))
    return counts
