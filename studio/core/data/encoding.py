"""Training rows -> token ids and labels, for every data shape, as the engine trains them.

One place renders and encodes a training row, whichever tokenizer encodes it: the engine's
(transformers') when it trains, ``tokenizers``' (studio/core/prompt/tokens.py) when ``studio config check``
or the estimator reads the data without a model. A row gives a list of examples:

- an instruction row: one (its template's text, loss on the response);
- a conversation: one (the chat template's text, loss on the assistant turns and their tool calls);
- a preference pair: two (the chosen answer's text, then the rejected one's);
- raw text: the document cut into blocks of ``data.max_seq_length`` tokens, every token trained
  (nothing is dropped, as continued pretraining wants; packing then fills rows with the blocks).

And the check that keeps a run from training on nothing: :func:`untrained` finds rows whose
examples carry no trained token and says why (the template leaves no response, or the tokenizer
encodes the text to nothing); :func:`refusal` words the one line a run is refused with when all or
most training rows are such.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from studio.core import prompt as prompts
from studio.core.data.shapes import CHAT_PAIRS, PAIRS, TEXT, TRL_PROMPT
from studio.core.prompt import IGNORE_INDEX
from studio.core.prompt import chat as chats

if TYPE_CHECKING:
    from studio.core.config import RunConfig
    from studio.core.prompt.tokens import TokenizerInfo


@dataclass(frozen=True)
class Vocab:
    """What encoding needs of a tokenizer."""

    tokenize: Callable[[str], Sequence[int]]
    """Text -> ids, no special tokens added."""

    eos_id: int | None = None
    eos_token: str | None = None
    bos_id: int | None = None
    """The BOS id the model takes first, or None when it takes none."""

    bos_token: str | None = None
    chat_template: str | None = None

    @classmethod
    def of(cls, info: TokenizerInfo) -> Vocab:
        """The vocabulary of a tokenizer read by studio/core/prompt/tokens.py (no torch)."""
        from studio.core.prompt.tokens import make_tokenize

        return cls(make_tokenize(info.tokenizer), info.eos_id, info.eos_token,
                   info.bos_id if info.add_bos else None, info.bos_token, info.chat_template)


class RowEncoder:
    """Renders and encodes the training rows of ``config`` (adapted to its data's shape, see
    studio/core/data/shapes.py) whose shape is ``kind``."""

    def __init__(self, config: RunConfig, vocab: Vocab, kind: str):
        self.config = config
        self.vocab = vocab
        self.kind = kind
        self._template: str | None = None
        self._chat: chats.ChatRenderer | None = None

    @property
    def template(self) -> str:
        """``prompt.template`` as a literal template (a preset resolved; ``chat`` through the chat template)."""
        if self._template is None:
            v = self.vocab
            self._template = prompts.resolve_template(self.config.prompt, v.chat_template,
                                                      bos_token=v.bos_token or "", eos_token=v.eos_token or "")
        return self._template

    @property
    def chat(self) -> chats.ChatRenderer:
        """The chat template's renderer (made on first use: instruction data needs none)."""
        if self._chat is None:
            v = self.vocab
            if not v.chat_template and self.kind == CHAT_PAIRS:
                raise prompts.TemplateError(
                    "conversational preference pairs render through the model's chat template, as TRL renders "
                    "them, and this model's tokenizer has none; pick a model with one (an -Instruct model), or "
                    "write a template with {prompt} and the answer's field (the turns become role: content lines)")
            self._chat = chats.ChatRenderer(v.chat_template or "", bos_token=v.bos_token or "",
                                            eos_token=v.eos_token or "")
        return self._chat

    def render(self, row: dict[str, Any]) -> list[prompts.Rendered]:
        """The row's training texts: one, or two for a preference pair (chosen, then rejected)."""
        p = self.config.prompt
        if self.kind == CHAT_PAIRS:
            before = chats.parse_turns(row.get(TRL_PROMPT) or [])
            tools = chats.tools_of(row)
            return [self.chat.render(before + chats.parse_turns(row.get(side)), tools, train_from=len(before))
                    for side in (p.response_field, p.rejected_field)]
        if chats.is_chat_row(row):
            return [self.chat.render(chats.messages_of(row), chats.tools_of(row))]
        if self.kind == PAIRS:
            rejected = {**row, p.response_field: row.get(p.rejected_field, "")}
            return [prompts.render(self.template, row, p.response_field),
                    prompts.render(self.template, rejected, p.response_field)]
        return [prompts.render(self.template, row, p.response_field)]

    def encode_rendered(self, rendered: prompts.Rendered) -> list[prompts.Encoded]:
        """One rendered text as examples: one, or for raw text a block per ``data.max_seq_length`` tokens."""
        v, max_len = self.vocab, self.config.data.max_seq_length
        eos = prompts.eos_to_append(rendered, v.eos_id, v.eos_token, self.config.prompt.add_eos)
        bos = prompts.bos_to_prepend(rendered.text, v.bos_id, v.bos_token)
        if self.kind != TEXT:
            return [prompts.encode(rendered, v.tokenize, max_len, eos, bos)]
        ids = ([bos] if bos is not None else []) + list(v.tokenize(rendered.text)) + ([eos] if eos is not None else [])
        return [prompts.Encoded(block, list(block), False, 0, len(block))
                for block in (ids[i:i + max_len] for i in range(0, len(ids), max_len))]

    def encode(self, row: dict[str, Any]) -> list[prompts.Encoded]:
        """The row's examples (see the module docstring)."""
        return [e for rendered in self.render(row) for e in self.encode_rendered(rendered)]


# ------------------------------------------------------------------------------ trained tokens


def trained_tokens(encoded: prompts.Encoded) -> int:
    """Tokens of an example that take loss. The first token never does: nothing before it in the
    example predicts it (studio/engine/batching.py's collate drops its label)."""
    return sum(1 for label in encoded.labels[1:] if label != IGNORE_INDEX)


TEMPLATE, TOKENIZER = "template", "tokenizer"
"""Why a row trains nothing: the template leaves it no response, or the tokenizer encodes its text
to no tokens. Truncation never is: past data.max_seq_length an example loses its prompt's start
before its whole response (prompt.encode, prompt.labels.encode_turns), and raw text is cut into blocks."""


def why_untrained(rendered: prompts.Rendered, examples: Sequence[prompts.Encoded], encoder: RowEncoder
                  ) -> str | None:
    """Why one rendered text trains nothing (``template`` or ``tokenizer``), or None
    when ``examples`` (its encoding) train on a token of its text. The EOS appended after a
    response does not count: a row whose answer encodes to nothing but that EOS learns nothing of it."""
    v = encoder.vocab
    eos = prompts.eos_to_append(rendered, v.eos_id, v.eos_token, encoder.config.prompt.add_eos)
    trained = sum(trained_tokens(e) for e in examples)
    if eos is not None and any(e.labels and e.labels[-1] == eos for e in examples):
        trained -= 1
    if trained > 0:
        return None
    if rendered.loss_spans:
        said = "".join(rendered.text[a:b] for a, b in rendered.loss_spans)
    elif rendered.template == "chat":
        return TEMPLATE  # a conversation with no assistant turn to learn
    else:
        said = rendered.response
    if not said.strip():
        return TEMPLATE
    return TOKENIZER


@dataclass
class Untrained:
    """The rows of a split whose examples carry no trained token, counted by reason."""

    total: int
    """Rows looked at."""

    reasons: Counter[str] = field(default_factory=Counter)
    """Reason -> rows (a pair counts when either side trains nothing)."""

    rows: list[int] = field(default_factory=list)
    """Which rows (0-based, in the split), in order."""

    @property
    def count(self) -> int:
        """Rows that train nothing."""
        return len(self.rows)

    @property
    def refused(self) -> bool:
        """Whether a run must not train on these rows: every row, or most of them, trains nothing."""
        return self.count > 0 and self.count * 2 > self.total


def untrained(rows: Sequence[dict[str, Any]], encoder: RowEncoder) -> Untrained:
    """Which of ``rows`` would train nothing, and why (raises TemplateError as rendering does)."""
    found = Untrained(total=len(rows))
    for index, row in enumerate(rows):
        for rendered in encoder.render(row):
            reason = why_untrained(rendered, encoder.encode_rendered(rendered), encoder)
            if reason is not None:
                found.reasons[reason] += 1
                found.rows.append(index)
                break
    return found


def refusal(found: Untrained, config: RunConfig, source: str) -> str:
    """The one line a run whose training rows train nothing is refused with: how many rows, why,
    and what to do."""
    p = config.prompt
    why = {
        TOKENIZER: ("the tokenizer encodes {n} of them to no tokens",
                    f"check the tokenizer files of model.base_model ({config.model.base_model}): does "
                    "transformers load them as this model's tokenizer?"),
        TEMPLATE: ("{n} leave no response after the template" + (
                       f" (prompt.response_field '{p.response_field}' is empty or not in the template)"
                       if p.template != "chat" else " (no assistant turn)"),
                   "check prompt.template, prompt.response_field and data.columns (the template pane "
                   "marks such rows)"),
    }
    order = [r for r, _n in found.reasons.most_common()]
    causes = ", ".join(why[r][0].format(n=f"{found.reasons[r]:,}") for r in order)
    advice = "; ".join(why[r][1] for r in order)
    every = "all" if found.count == found.total else f"{found.count:,}"
    return (f"{source}: {every} of the {found.total:,} training rows would train on no token ({causes}), "
            f"so the loss would read 0 and nothing would be learned; {advice}")
