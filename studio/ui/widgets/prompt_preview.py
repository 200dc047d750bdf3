"""A rendered training example as a person should see it: prompt and response (loss) in different
colours, the token counts, and where ``max_seq_length`` cuts it.

:func:`measure` runs :func:`studio.core.prompt.encode` (the same code that builds training batches)
and locates the cut in the text; :func:`preview_content` turns that into styled Content. Colours are
theme variables only ($studio-prompt, $studio-response, $studio-truncated).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content

from studio.core import prompt as prompts
from studio.ui.widgets.token_counter import TokenCounter


@dataclass(frozen=True)
class Measured:
    """Token counts of one rendered example and where truncation falls in its text."""

    rendered: prompts.Rendered
    prompt_tokens: int
    """Prompt tokens before truncation (BOS included when the model adds one)."""
    response_tokens: int
    """Response tokens before truncation (EOS not included)."""
    eos: bool
    """Whether an EOS token is appended."""
    total: int
    """All tokens before truncation: what max length is compared against."""
    max_len: int
    truncated: bool
    keep_from: int = 0
    """Character offset where the kept text starts (> 0 when the prompt's start is dropped)."""
    keep_to: int | None = None
    """Character offset where the kept text ends (None: to the end)."""


def measure(rendered: prompts.Rendered, counter: TokenCounter, max_len: int, add_eos: bool) -> Measured:
    """Count tokens the way training does and find the characters max length drops."""
    if rendered.loss_spans:
        return _measure_conversation(rendered, counter, max_len)
    eos_id = prompts.eos_to_append(rendered, counter.eos_id, counter.eos_token, add_eos)
    encoded = prompts.encode(rendered, counter.tokenize, max_len, eos_id, counter.bos_id)
    prompt_offsets = counter.offsets(rendered.prompt)
    response_offsets = counter.offsets(rendered.response)
    bos = 1 if counter.bos_id is not None else 0
    keep_from, keep_to = 0, None
    if encoded.truncated:
        kept_prompt = encoded.prompt_tokens - bos
        dropped = len(prompt_offsets) - kept_prompt
        if dropped > 0 and kept_prompt > 0:
            keep_from = prompt_offsets[dropped][0]
        elif dropped > 0:
            keep_from = rendered.response_start
        kept_response = len(encoded.input_ids) - encoded.prompt_tokens
        if kept_response < len(response_offsets):
            keep_to = rendered.response_start + response_offsets[kept_response][0]
    return Measured(rendered, bos + len(prompt_offsets), len(response_offsets), eos_id is not None,
                    encoded.total_tokens, max_len, encoded.truncated, keep_from, keep_to)


def _measure_conversation(rendered: prompts.Rendered, counter: TokenCounter, max_len: int) -> Measured:
    """A conversation: prompt tokens are every turn but the assistant's, response tokens the
    assistant turns'; training cuts the tail at max length."""
    whole = prompts.encode(rendered, counter.tokenize, 1 << 30, None, counter.bos_id)
    learned = sum(1 for label in whole.labels if label != prompts.IGNORE_INDEX)
    bos = 1 if counter.bos_id is not None else 0
    keep_to = None
    if whole.total_tokens > max_len:
        offsets = counter.offsets(rendered.text)
        keep_to = offsets[max_len - bos][0] if 0 <= max_len - bos < len(offsets) else None
    return Measured(rendered, whole.total_tokens - learned, learned, False, whole.total_tokens, max_len,
                    whole.total_tokens > max_len, 0, keep_to)


def count_line(m: Measured, counter: TokenCounter) -> Content:
    """``143 tokens = prompt 98 + response 44 + EOS 1 · max 512`` with a cut warning."""
    eos = " + EOS 1" if m.eos else ""
    text = f"{m.total:,} tokens = prompt {m.prompt_tokens:,} + response {m.response_tokens:,}{eos} · max {m.max_len:,}"
    line = Content.from_markup("[b]$text[/b]", text=text)
    if m.truncated:
        line += Content.from_markup("  [b $studio-truncated]✂ cut at $max[/]", max=f"{m.max_len:,}")
    return line + Content.from_markup("\n[dim]$label[/]", label=counter.label)


def untrained_note(m: Measured) -> Content | None:
    """``✗ trains on no token: why`` for an example whose response has no token to learn (a run is
    refused when most of its rows are such: studio/core/data/encoding.py), else None."""
    if m.response_tokens > 0:
        return None
    said = "".join(m.rendered.text[a:b] for a, b in m.rendered.loss_spans) if m.rendered.loss_spans \
        else m.rendered.response
    why = ("the tokenizer encodes its response to no tokens" if said.strip()
           else "nothing is left to learn after the template (an empty response, or no assistant turn)")
    return Content.from_markup("[b $error]✗ this row trains on no token:[/] $why", why=why)


def preview_content(m: Measured, eos_token: str | None) -> Content:
    """The example with the prompt and the response (what the loss is computed on) coloured apart,
    dropped text struck through after a ✂ marker."""
    text = m.rendered.text
    if m.rendered.loss_spans:
        return _conversation_content(m)
    start = m.rendered.response_start
    end = len(text) if m.keep_to is None else m.keep_to
    parts: list[Content] = []
    if m.keep_from > 0:
        parts.append(Content.styled(text[: m.keep_from], "$studio-truncated strike"))
        parts.append(Content.styled("✂", "bold $studio-truncated"))
    parts.append(Content.styled(text[m.keep_from:max(m.keep_from, start)], "$studio-prompt"))
    parts.append(Content.styled(text[max(m.keep_from, start):end], "bold $studio-response"))
    if m.keep_to is not None:
        parts.append(Content.styled(f"✂ max length {m.max_len} ✂", "bold reverse $studio-truncated"))
        parts.append(Content.styled(text[end:], "strike $studio-truncated"))
    elif m.eos:
        parts.append(Content.styled(eos_token or "⟨eos⟩", "italic $studio-response"))
    return Content("").join(parts)


def _conversation_content(m: Measured) -> Content:
    """A conversation with every assistant turn (content and end of turn: the loss) coloured as
    response, the rest as prompt, and the text past max length struck through."""
    text = m.rendered.text
    end = len(text) if m.keep_to is None else m.keep_to
    parts: list[Content] = []
    at = 0
    for start, stop in [*m.rendered.loss_spans, (len(text), len(text))]:
        for a, b, style in ((at, start, "$studio-prompt"), (start, stop, "bold $studio-response")):
            if min(b, end) > a:
                parts.append(Content.styled(text[a:min(b, end)], style))
        at = stop
    if m.keep_to is not None:
        parts.append(Content.styled(f"✂ max length {m.max_len} ✂", "bold reverse $studio-truncated"))
        parts.append(Content.styled(text[end:], "strike $studio-truncated"))
    return Content("").join(parts)


def legend() -> Content:
    """What the colours mean."""
    return Content.from_markup("[$studio-prompt]■ prompt[/]  [b $studio-response]■ response (loss)[/]  "
                               "[$studio-truncated]✂ cut by max length[/]")
