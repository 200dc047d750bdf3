"""The training examples' token lengths, for sizing a step from the data instead of max_seq_length.

Without packing, every example is a row of its own and a micro-batch is padded to its longest row;
the fast path drops the padding before the model, so a step on short rows computes on far fewer
tokens than ``micro_batch x max_seq_length`` (the Llama-2-7B seq1024 mb4 short-padded row was
estimated 24% high). Where the data and the run's tokenizer are at hand (``studio estimate`` with a
local or cached tokenizer, engine/planning.py at a run's start) the estimator takes these lengths
(core/memory/plan.py's ``Plan.lengths``) and bounds a micro-batch by the sum of the longest examples it
could hold: no micro-batch drawn from the data, in any order, holds more real tokens than the
``micro_batch`` longest examples together. That is the largest step a whole epoch can meet, which is
what a plan must fit, not the typical one. Packed runs fill ``max_seq_length`` and keep it.

Rows are rendered and tokenized as engine/session.py encodes them (the template or the chat
template, BOS where the tokenizer puts one, EOS after an instruction row's response), then capped
at ``data.max_seq_length`` as the encoder truncates them.

Plain Python: the tokenizer is read with ``tokenizers`` (core/prompt/tokens.py), never torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.prompt.tokens import TokenizerInfo


def row_lengths(rows: Iterable[dict], config: RunConfig, tok: TokenizerInfo) -> tuple[int, ...]:
    """Token lengths of ``rows`` as the engine encodes them, each capped at ``data.max_seq_length``,
    longest first. Raises :class:`~studio.core.prompt.TemplateError` for a template that does not
    render."""
    from studio.core import prompt
    from studio.core.prompt import chat

    template = prompt.resolve_template(config.prompt, tok.chat_template, bos_token=tok.bos_token or "",
                                       eos_token=tok.eos_token or "")
    renderer = None
    texts: list[str] = []
    extra: list[int] = []
    for row in rows:
        if chat.is_chat_row(row):
            renderer = renderer or chat.ChatRenderer(tok.chat_template or "", bos_token=tok.bos_token or "",
                                                     eos_token=tok.eos_token or "")
            rendered = renderer.render(chat.messages_of(row), chat.tools_of(row))
        else:
            rendered = prompt.render(template, row, config.prompt.response_field)
        bos = prompt.bos_to_prepend(rendered.text, tok.bos_id if tok.add_bos else None, tok.bos_token)
        eos = prompt.eos_to_append(rendered, tok.eos_id, tok.eos_token, config.prompt.add_eos)
        texts.append(rendered.text)
        extra.append((bos is not None) + (eos is not None))
    cap = config.data.max_seq_length
    encoded = tok.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    return tuple(sorted((min(cap, len(e.ids) + n) for e, n in zip(encoded, extra, strict=True)), reverse=True))


def data_lengths(config: RunConfig, rows: Iterable[dict] | None = None,
                 base_dir: str | Path | None = None) -> tuple[tuple[int, ...], str]:
    """The training rows' token lengths (:func:`row_lengths`) and ''; or () and why they could not
    be had (no data path, the data or the tokenizer not readable here, a preference run). ``rows``:
    the training split when the caller has it loaded; ``base_dir``: the config file's folder."""
    from studio.core.data.pairs import is_preference
    from studio.core.prompt.tokens import TokenizerNotFound, load_tokenizer_info

    if is_preference(config):
        return (), "preference pairs are sized as max_seq_length rows"
    if config.trainer.method == "grpo":
        return (), "GRPO's rows (a prompt and a completion) are sized as max_seq_length rows"
    try:
        tok = load_tokenizer_info(config.model.base_model, config.model.revision)
    except (TokenizerNotFound, OSError, ValueError) as exc:
        return (), f"no local tokenizer ({str(exc).splitlines()[0][:120]})"
    if rows is None:
        if not config.data.path:
            return (), "no data.path"
        from studio.core.data import DataError, load_splits

        try:
            splits = load_splits(config, base_dir)
        except (DataError, OSError, ValueError) as exc:
            return (), f"the data cannot be read here ({str(exc).splitlines()[0][:120]})"
        rows, config = splits.train, splits.shape.adapt(config)  # raw text renders through its own preset
    try:
        lengths = row_lengths(rows, config, tok)
    except ValueError as exc:  # TemplateError: the run itself will say it better
        return (), f"the rows do not render ({str(exc).splitlines()[0][:120]})"
    return (lengths, "") if lengths else ((), "no training rows")
