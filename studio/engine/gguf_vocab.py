"""A model folder's tokenizer as GGUF tokenizer metadata, read from its ``tokenizer.json``.

Two tokenizer kinds cover the families Studio exports, and llama.cpp runs each its own way:

- byte-level BPE (GPT-2 style: Llama 3, Qwen, SmolLM, Phi-4): ``tokenizer.ggml.model = "gpt2"``, the
  merges, and ``tokenizer.ggml.pre``, the name under which llama.cpp keeps the regular expression
  that splits text before BPE. llama.cpp's converter finds that name by hashing the tokenizer's
  output on a fixed text; here the model's own pre-tokenizer is run on a probe text beside each
  split llama.cpp knows (written as a ``tokenizers`` pre-tokenizer from the expression llama.cpp
  uses), and the one that cuts the text the same way names it. None does: GgufExportError.
- SentencePiece-style BPE with byte fallback (Gemma, Llama 2, Mistral 7B, Phi-3):
  ``tokenizer.ggml.model = "llama"``. llama.cpp merges by token *score*, which ``tokenizer.json`` does
  not keep; a token's score is minus the rank of the first merge that makes it, so llama.cpp merges
  in exactly the order the merges list does. No merges are written, as llama.cpp's converter writes
  none for these.

Anything else (Unigram, WordPiece) raises :class:`GgufExportError` with what to do instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from studio.engine.gguf_families import GgufExportError

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLITS = {
    # The expressions as the models' own tokenizer.json files write them (llama.cpp keeps a
    # hand-adapted copy of each under the same name).
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL,
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL,
    "gpt-4o": (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "tekken": (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
"""llama.cpp pre-tokenizer names whose split is one regular expression ahead of byte-level BPE."""

_PROBE = ("Hello World, HelloWorld I'VE he's we'll 12345 3.14 x=1/2 100,000 x²³ path/to\n\n  \n\tTabs   spaces!!! ...\n"
          "Ünïcödé façade 你好世界 🦙🚀 don't SHOUT ok\r\nend  ")
"""Text whose pre-token cuts tell every split in :data:`_SPLITS` and the GPT-2 ones apart."""

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass
class Vocab:
    """What goes under ``tokenizer.ggml.*`` (besides the special ids, merges and chat template that
    ``gguf.SpecialVocab`` reads from the folder)."""

    model: str
    """``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece-style BPE)."""
    pre: str
    """llama.cpp's pre-tokenizer name (``default`` for SentencePiece-style)."""
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    """Merge priority per token (SentencePiece-style only)."""
    add_space_prefix: bool
    """Whether the tokenizer puts a space before the text (``▁`` for SentencePiece)."""

    @property
    def needs_merges(self) -> bool:
        """Byte-level BPE is run from its merges; SentencePiece-style from its scores."""
        return self.model == "gpt2"


def _candidates() -> dict[str, Any]:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    found = {name: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(expr), behavior="isolated"), byte_level])
             for name, expr in _SPLITS.items()}
    # GPT-2's own expression is the one ByteLevel applies itself; SmolLM splits digits first.
    found["gpt-2"] = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    found["smollm"] = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return found


def _same_ids(tokenizer: Any, pre_tokenizer: Any) -> bool:
    """Whether ``tokenizer`` encodes the probe to the same ids with ``pre_tokenizer`` in its place."""
    own = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    kept = tokenizer.pre_tokenizer
    tokenizer.pre_tokenizer = pre_tokenizer
    try:
        return tokenizer.encode(_PROBE, add_special_tokens=False).ids == own
    finally:
        tokenizer.pre_tokenizer = kept


def pre_tokenizer_name(tokenizer_json: Path) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    own = tokenizer.pre_tokenizer
    if own is None:
        raise GgufExportError(f"{tokenizer_json}: the tokenizer has no pre-tokenizer; llama.cpp cannot split text "
                              "the same way. Export --format merged and convert with convert_hf_to_gguf.py")
    cuts = [piece for piece, _ in own.pre_tokenize_str(_PROBE)]
    model = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]
    for name, candidate in _candidates().items():
        if [piece for piece, _ in candidate.pre_tokenize_str(_PROBE)] != cuts:
            continue
        if name == "llama-bpe" and not model.get("ignore_merges"):
            # The same split with merges applied to whole words is llama.cpp's "dbrx" (Phi-4's tokenizer).
            return "dbrx"
        if name == "gpt-2" and _same_ids(tokenizer, _candidates()["smollm"]):
            # No token joins a digit to anything: SmolLM's split (digits apart, then GPT-2's) gives the
            # same tokens, and "smollm" is llama.cpp's name for these vocabularies (SmolLM, SmolLM2).
            return "smollm"
        return name
    raise GgufExportError(f"{tokenizer_json}: the tokenizer splits text in a way Studio cannot name for llama.cpp "
                          f"(known: {', '.join(_candidates())}). Export --format merged and convert with "
                          "llama.cpp's convert_hf_to_gguf.py")


def _adds_prefix_space(data: dict[str, Any]) -> bool:
    """Whether tokenizer.json puts a space before the text: ByteLevel's ``add_prefix_space``, a
    ``Prepend("▁")`` normalizer (Llama 2, Phi-3) or a Metaspace that prepends (newer Llama/Mistral)."""
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "ByteLevel" and node.get("add_prefix_space"):
                return True
            if kind == "Prepend" and node.get("prepend") == "\u2581":
                return True
            if kind == "Metaspace" and (node.get("prepend_scheme") in ("first", "always")
                                        or node.get("add_prefix_space")):
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(data.get("normalizer")) or walk(data.get("pre_tokenizer"))


def _is_byte_level(data: dict[str, Any]) -> bool:
    return "ByteLevel" in json.dumps(data.get("pre_tokenizer") or {}) or \
        "ByteLevel" in json.dumps(data.get("decoder") or {})


def read_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    """The GGUF tokenizer of ``model_dir``'s ``tokenizer.json``, padded with unused ``[PADn]`` tokens
    to ``n_vocab`` (the embedding's rows) where the tokenizer has fewer; GgufExportError where it has more."""
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise GgufExportError(f"{model_dir}: no tokenizer.json; GGUF export needs a fast tokenizer "
                              "(save it with AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    spm = model.get("type") == "BPE" and bool(model.get("byte_fallback"))
    if model.get("type") != "BPE" or not (spm or _is_byte_level(data)):
        what = "BPE tokenizer without byte fallback or byte-level pre-tokenizer" if model.get("type") == "BPE" \
            else f"{model.get('type', 'unknown')} tokenizer"
        raise GgufExportError(f"{path}: a {what};"
                              " GGUF export covers byte-level BPE (Llama 3, Qwen, SmolLM) and SentencePiece-style "
                              "BPE (Gemma, Llama 2, Mistral, Phi-3). Export --format merged and convert with "
                              "llama.cpp's convert_hf_to_gguf.py")
    types = gguf.TokenType
    by_id: dict[int, tuple[str, int]] = {}
    for token, index in model["vocab"].items():
        kind = types.NORMAL
        if spm and _BYTE_TOKEN.fullmatch(token):
            kind = types.BYTE
        elif spm and token == model.get("unk_token"):
            kind = types.UNKNOWN
        by_id[int(index)] = (token, int(kind))
    for added in data.get("added_tokens") or []:
        if spm and added["content"] == model.get("unk_token"):
            continue  # SentencePiece's unknown piece keeps its own type, as llama.cpp's converter writes it
        if added.get("special"):
            by_id[int(added["id"])] = (added["content"], int(types.CONTROL))
        else:
            # llama.cpp matches user-defined tokens in raw text: a SentencePiece "▁" is a space there.
            text = added["content"].replace("\u2581", " ") if spm else added["content"]
            by_id[int(added["id"])] = (text, int(types.USER_DEFINED))
    if max(by_id) >= n_vocab:
        raise GgufExportError(f"{path}: the tokenizer has token id {max(by_id)} but the model's embedding has "
                              f"{n_vocab} rows; llama.cpp needs a row for every token. Resize the embedding "
                              "(model.resize_token_embeddings) before training, or export with the tokenizer the "
                              "model was trained with")
    size = n_vocab
    tokens, kinds = [], []
    for i in range(size):
        token, kind = by_id.get(i, (f"[PAD{i}]", int(types.UNUSED)))
        tokens.append(token)
        kinds.append(kind)
    if not spm:
        return Vocab("gpt2", pre_tokenizer_name(path), tokens, kinds, None, _adds_prefix_space(data))
    return Vocab("llama", "default", tokens, kinds, _scores(tokens, model.get("merges") or []),
                 _adds_prefix_space(data))


def _scores(tokens: list[str], merges: list[Any]) -> list[float]:
    """Minus the rank of the first merge that makes each token; tokens no merge makes (single
    characters, bytes, added tokens) score below every merge, so llama.cpp never prefers them."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        rank.setdefault(left + right, r)
    floor = -float(len(merges) + 1)
    return [-float(rank[t]) if t in rank else floor for t in tokens]
