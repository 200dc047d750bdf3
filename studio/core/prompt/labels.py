"""A rendered row as token ids and labels: the loss on the response (or a conversation's assistant turns) only.

Any tokenizer encodes through these (the engine's, and the ``tokenizers``-only one config check and
the UI count with): ``tokenize`` is a callable from text to ids that adds no special tokens. Labels
are :data:`IGNORE_INDEX` where no loss is taken. Plain Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from studio.core.prompt.rendered import Rendered

IGNORE_INDEX = -100
"""The label of a token that takes no loss (the prompt, padding): PyTorch's cross-entropy default,
which transformers' models and Studio's fast path use too."""


@dataclass(frozen=True)
class Encoded:
    """Token ids and labels for one example; labels are :data:`IGNORE_INDEX` where no loss is taken."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool
    """True when max_len cut tokens off (the response tail, or the prompt's start)."""

    prompt_tokens: int
    """How many leading tokens are prompt (labels :data:`IGNORE_INDEX`), BOS included."""

    total_tokens: int = 0
    """Tokens before truncation (prompt + response + EOS): what max_len is compared against."""


def encode(
    rendered: Rendered,
    tokenize: Callable[[str], Sequence[int]],
    max_len: int,
    eos_id: int | None,
    bos_id: int | None = None,
) -> Encoded:
    """Token ids and labels for a rendered row, with loss on the response only.

    The whole text is tokenized once, as ``apply_chat_template`` and inference tokenize it; the labels
    start at the first token that the prompt tokenized alone does not share (where a token spans the
    boundary, as ``\n\n`` before an answer can, it counts as response). ``bos_id`` (when given) starts
    the prompt; ``eos_id`` (when given) ends the response (pass :func:`eos_to_append`'s answer).
    ``tokenize`` must not add special tokens itself. A conversation (``rendered.loss_spans``) is encoded by
    :func:`encode_turns`: loss on every assistant turn, no EOS added.

    Truncation to ``max_len``: the response's tail goes first (and the EOS with it: a cut answer
    should not teach the model to stop there). If the prompt alone leaves no room, the prompt loses
    tokens from its start (BOS kept) so that the response keeps its first
    ``min(len(response), max(1, max_len // 4))`` tokens: an example with no response tokens would
    train nothing.
    """
    if max_len < 2:
        raise ValueError("max_len must be at least 2")
    if rendered.loss_spans:
        return encode_turns(rendered, tokenize, max_len, bos_id)
    whole = list(tokenize(rendered.text))
    cut = token_boundary(whole, tokenize(rendered.prompt))
    prompt, response = whole[:cut], whole[cut:]
    bos = [bos_id] if bos_id is not None else []
    eos = [eos_id] if eos_id is not None else []
    total = len(bos) + len(prompt) + len(response) + len(eos)
    truncated = total > max_len
    if truncated:
        if len(bos) + len(prompt) < max_len:
            response = response[: max_len - len(bos) - len(prompt)]
        else:
            keep = min(len(response), max(1, max_len // 4))
            response = response[:keep]
            room = max_len - len(bos) - keep
            prompt = prompt[len(prompt) - room:] if room > 0 else []
        eos = []
    prompt_ids = bos + prompt
    answer = response + eos
    return Encoded(
        input_ids=prompt_ids + answer,
        labels=[IGNORE_INDEX] * len(prompt_ids) + answer,
        truncated=truncated,
        prompt_tokens=len(prompt_ids),
        total_tokens=total,
    )


def token_boundary(whole: Sequence[int], head: Sequence[int]) -> int:
    """How many leading tokens of ``whole`` (a text's tokens) belong to ``head`` (its start's tokens
    alone): their common prefix."""
    n = 0
    for a, b in zip(whole, head, strict=False):
        if a != b:
            break
        n += 1
    return n


def eos_to_append(rendered: Rendered, eos_id: int | None, eos_token: str | None, add_eos: bool = True
                  ) -> int | None:
    """The EOS id :func:`encode` should append to ``rendered``'s response, or None.

    None when ``prompt.add_eos`` is off, for a conversation (the chat template ends each assistant
    turn itself), and when the response already holds the EOS token's text: a chat template's
    end of turn (``<|im_end|>``) is the EOS of an instruct model, and a second one would teach the
    model to emit it twice (what ``apply_chat_template`` renders has one).
    """
    if not add_eos or eos_id is None or rendered.loss_spans:
        return None
    if eos_token and eos_token in rendered.response:
        return None
    return eos_id


def bos_to_prepend(text: str, bos_id: int | None, bos_token: str | None) -> int | None:
    """``bos_id``, unless ``text`` starts with the BOS token's text already (a chat template that
    writes ``{{ bos_token }}``, as Llama 3's does): one BOS, as ``apply_chat_template`` makes."""
    if bos_id is None or (bos_token and text.startswith(bos_token)):
        return None
    return bos_id


def encode_turns(rendered: Rendered, tokenize: Callable[[str], Sequence[int]], max_len: int,
                 bos_id: int | None = None) -> Encoded:
    """Token ids and labels for a rendered conversation: loss on the loss spans only.

    The whole text is tokenized once (the ids ``apply_chat_template`` gives); a span edge falls after
    the tokens that the text before it, tokenized alone, shares with the whole. No EOS is appended
    (the template's end of turn is part of each assistant span). Over ``max_len`` the tail is cut;
    when that would leave no assistant token, the conversation is encoded as its last assistant turn
    after a prompt that loses its start instead (see :func:`prompt.encode`).
    """
    whole = list(tokenize(rendered.text))
    # Each span edge's token index: the tokens the text before it shares with the whole text.
    at = {0: 0, len(rendered.text): len(whole)}
    for edge in sorted({e for span in rendered.loss_spans for e in span} - set(at)):
        at[edge] = token_boundary(whole, tokenize(rendered.text[:edge]))
    labels = [IGNORE_INDEX] * len(whole)
    for start, end in rendered.loss_spans:
        labels[at[start]:at[end]] = whole[at[start]:at[end]]
    ids = ([bos_id] if bos_id is not None else []) + whole
    labels = ([IGNORE_INDEX] if bos_id is not None else []) + labels
    total = len(ids)
    first_label = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), total)
    if total > max_len and first_label >= max_len and rendered.loss_spans:
        start, end = rendered.loss_spans[-1]
        last = Rendered(rendered.text[:end], start)
        cut = encode(last, tokenize, max_len, None, bos_id)
        return Encoded(cut.input_ids, cut.labels, True, cut.prompt_tokens, total)
    if total > max_len:
        ids, labels = ids[:max_len], labels[:max_len]
    return Encoded(ids, labels, total > max_len, min(first_label, len(ids)), total)
