"""Length statistics and lint over a dataset: what the dataset pane plots and lists before training.

Works on a ``datasets.Dataset``, a :class:`studio.core.data.Table` or a list of row dicts. Lint is
hash-based (100k rows in about half a second); token counts use ``tokenizers`` in parallel batches,
never torch. Row numbers are 0-based positions in the table.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from studio.core import prompt as prompts
from studio.core.data.browse import arrow_table, column_values, row_count
from studio.core.data.fields import as_text, template_fields_for
from studio.core.data.pairs import flatten_table, lint_pairs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from studio.core.config import RunConfig


@dataclass(frozen=True)
class LengthStats:
    """Summary and histogram of lengths (characters or tokens) over a column."""

    count: int
    min: int
    mean: float
    p50: float
    p95: float
    max: int
    edges: list[int]
    """Bucket boundaries, one more than ``counts``; bucket i holds lengths in [edges[i], edges[i+1])."""
    counts: list[int]
    """Rows in each bucket."""


def length_stats(lengths: Sequence[int], bins: int = 20) -> LengthStats:
    """Min/mean/p50/p95/max and a histogram of ``lengths`` in at most ``bins`` equal integer buckets."""
    import numpy as np

    if len(lengths) == 0:
        return LengthStats(0, 0, 0.0, 0.0, 0.0, 0, [0, 1], [0])
    values = np.asarray(lengths, dtype=np.int64)
    low, high = int(values.min()), int(values.max())
    # Integer-wide buckets so each label reads as a whole length range ("100-109").
    width = max(1, -(-(high - low + 1) // max(1, bins)))
    buckets = -(-(high - low + 1) // width)
    counts = np.bincount((values - low) // width, minlength=buckets)
    return LengthStats(
        count=len(values), min=low, mean=float(values.mean()), p50=float(np.percentile(values, 50)),
        p95=float(np.percentile(values, 95)), max=high,
        edges=[low + k * width for k in range(buckets + 1)], counts=[int(c) for c in counts],
    )


@dataclass(frozen=True)
class ColumnStats:
    """Length statistics of one column."""

    column: str
    chars: LengthStats
    tokens: LengthStats | None
    """None when no tokenizer was given."""
    empty: int
    """Rows whose value is empty or only whitespace."""


def column_stats(
    source: Any,
    columns: Sequence[str] | None = None,
    tokenize: Tokenizer | Callable[[str], Sequence[int]] | None = None,
    bins: int = 20,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, ColumnStats]:
    """Character (and, given a tokenizer, token) length statistics per text column.

    ``source`` is a Dataset, a :class:`Table` or a list of row dicts; ``tokenize`` a
    ``tokenizers.Tokenizer`` (fast, batched) or any ``str -> ids`` callable. ``progress(done, total)``
    reports the texts tokenized so far, over all columns.
    """
    from studio.core.prompt.tokens import count_tokens

    values = _columns_of(source, columns)
    total = sum(len(texts) for texts in values.values())
    stats: dict[str, ColumnStats] = {}
    done = 0
    for name, texts in values.items():
        texts = [as_text(t) for t in texts]
        tokens = None
        if tokenize is not None:
            report = None if progress is None else (lambda n, _, base=done: progress(base + n, total))
            tokens = length_stats(count_tokens(tokenize, texts, report), bins)
        done += len(texts)
        stats[name] = ColumnStats(name, length_stats([len(t) for t in texts], bins), tokens,
                                  sum(1 for t in texts if not t.strip()))
    return stats


def _columns_of(source: Any, columns: Sequence[str] | None) -> dict[str, list[Any]]:
    """Column name -> values, from a Dataset/Table or a list of dicts."""
    if isinstance(source, list):
        names = list(columns) if columns else (list(source[0]) if source else [])
        return {name: [row.get(name) for row in source] for name in names}
    table = arrow_table(source)
    names = list(columns) if columns else table.column_names
    return {name: column_values(source, name) for name in names}


# ---------------------------------------------------------------------------------------- lint


@dataclass(frozen=True)
class DataIssue:
    """A row worth a look before training."""

    kind: str
    """``empty_output``, ``duplicate_prompt`` (same prompt, different answers) or ``too_long``; for a
    chat dataset ``not_a_conversation``, ``empty_turn``, ``role_order`` or ``too_long``."""
    row: int
    """The (first) row concerned, 0-based."""
    message: str
    related_rows: tuple[int, ...] = ()
    """Every row of a duplicate group (including ``row``)."""


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def lint_rows(
    source: Any,
    response_field: str = "output",
    prompt_fields: Sequence[str] | None = None,
    *,
    columns: Mapping[str, str] | None = None,
    tokenize: Tokenizer | Callable[[str], Sequence[int]] | None = None,
    max_seq_length: int | None = None,
    template: str | None = None,
    add_eos: bool = True,
    progress: Callable[[int, int], None] | None = None,
    chat_template: str | None = None,
) -> list[DataIssue]:
    """Rows that would hurt a fine-tune: empty outputs, the same prompt with different answers (after
    whitespace/case normalisation), and rows longer than ``max_seq_length`` tokens.

    ``source`` is a list of row dicts keyed by field, or a Dataset/Table whose columns are mapped to
    fields by ``columns`` (field -> column). ``prompt_fields`` default to instruction and input (those
    present). Length is measured on the row rendered through ``template`` (or its fields joined by
    newlines), plus the EOS token when ``add_eos``; ``progress(done, total)`` follows that
    tokenization. Hash-based: 100k rows lint in well under a second without a tokenizer.

    A chat dataset (a ``messages`` / ``conversations`` column) is linted as conversations instead
    (:func:`lint_conversations`), its length measured through ``chat_template`` when given.
    """
    mapping = dict(columns or {})
    if not isinstance(source, list):
        from studio.core.data.fields import chat_column

        found = chat_column(source, mapping)
        if found is not None:
            return lint_conversations(column_values(source, found[0]), tokenize=tokenize,
                                      max_seq_length=max_seq_length, chat_template=chat_template,
                                      progress=progress)
    if isinstance(source, list):
        available = list(source[0]) if source else []
    else:
        available = arrow_table(source).column_names
    has = [f for f in (*available, *mapping) if mapping.get(f, f) in available]
    if prompt_fields is None:
        if template is not None:
            prompt_fields = [f for f in prompts.template_fields(template) if f != response_field]
        else:
            prompt_fields = [f for f in ("instruction", "input") if f in has] or [
                f for f in has if f not in (response_field, "split")]
    total = row_count(source)
    values: dict[str, list[str]] = {}
    for name in dict.fromkeys([*prompt_fields, response_field]):
        column = mapping.get(name, name)
        raw = _columns_of(source, [column])[column] if column in available else [""] * total
        values[name] = [as_text(v) for v in raw]

    issues: list[DataIssue] = []
    answers = values[response_field]
    for index, answer in enumerate(answers):
        if not answer.strip():
            issues.append(DataIssue("empty_output", index, f"row {index}: the {response_field} is empty; "
                                    "fill it in or drop the row (it teaches the model to say nothing)"))

    groups: dict[tuple[str, ...], list[int]] = {}
    with _no_gc():  # only containers are made here; collection passes would double the time
        keys = zip(*(map(_normalise, values[f]) for f in prompt_fields), strict=True)
        for index, key in enumerate(keys):
            groups.setdefault(key, []).append(index)
    for members in groups.values():
        if len(members) > 1 and len({_normalise(answers[i]) for i in members}) > 1:
            shown = ", ".join(str(i) for i in members[:10]) + (" ..." if len(members) > 10 else "")
            issues.append(DataIssue(
                "duplicate_prompt", members[0],
                f"rows {shown}: the same prompt has {len({_normalise(answers[i]) for i in members})} "
                "different answers; keep one answer per prompt", tuple(members)))

    if tokenize is not None and max_seq_length:
        issues.extend(_too_long(values, total, response_field, tokenize, max_seq_length, template, add_eos,
                                progress))
    issues.sort(key=lambda issue: issue.row)
    return issues


def _too_long(values: dict[str, list[str]], total: int, response_field: str, tokenize: Any,
              max_seq_length: int, template: str | None, add_eos: bool,
              progress: Callable[[int, int], None] | None = None) -> list[DataIssue]:
    """Rows whose rendered text is over ``max_seq_length`` tokens.

    Tokenizing every rendered row of a large dataset takes tens of seconds, so rows are first bounded
    by their UTF-8 size: every token of a real tokenizer covers at least one byte (plus, at most, one
    leading word-start marker), so a row whose byte count fits certainly fits and is never tokenized.
    """
    from studio.core.prompt.tokens import count_tokens

    names = list(values)
    extra = 1 if add_eos else 0
    if template is not None:
        pieces = prompts.parse(template)
        literal = len("".join(p.text for p in pieces if p.field is None).encode())
        uses = {n: sum(1 for p in pieces if p.field == n) for n in names}
        uses[response_field] = max(1, uses.get(response_field, 0))
    else:
        literal, uses = max(0, len(names) - 1), dict.fromkeys(names, 1)
    sizes = [literal + 1 + extra] * total
    for name in names:
        if uses.get(name):
            sizes = [size + uses[name] * len(text.encode()) for size, text in zip(sizes, values[name], strict=True)]
    candidates = [i for i, size in enumerate(sizes) if size > max_seq_length]

    def text_of(index: int) -> str:
        row = {n: values[n][index] for n in names}
        if template is not None:
            return prompts.render(template, row, response_field).text
        return "\n".join(row.values())

    counts = count_tokens(tokenize, [text_of(i) for i in candidates], progress)
    return [
        DataIssue("too_long", index, f"row {index}: {count + extra} tokens, over data.max_seq_length "
                  f"{max_seq_length}; the end of its response will be cut (raise max_seq_length or shorten it)")
        for index, count in zip(candidates, counts, strict=True) if count + extra > max_seq_length
    ]


def lint_conversations(
    values: Sequence[Any],
    *,
    tokenize: Tokenizer | Callable[[str], Sequence[int]] | None = None,
    max_seq_length: int | None = None,
    chat_template: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[DataIssue]:
    """Conversations that would hurt a fine-tune: a value that is no conversation, empty turns,
    turns out of order (see :func:`studio.core.prompt.chat.conversation_issues`), and conversations longer
    than ``max_seq_length`` tokens (rendered through ``chat_template``, else their turns joined)."""
    from studio.core.prompt import TemplateError, chat

    issues: list[DataIssue] = []
    conversations: dict[int, list[chat.Turn]] = {}
    for index, value in enumerate(values):
        try:
            turns = chat.parse_turns(value, f"row {index}")
        except chat.ChatFormatError as exc:
            issues.append(DataIssue("not_a_conversation", index, f"{exc}"))
            continue
        conversations[index] = turns
        for kind, message in chat.conversation_issues(turns):
            issues.append(DataIssue(kind, index, f"row {index}: {message}"))
    if tokenize is not None and max_seq_length:
        from studio.core.prompt.tokens import count_tokens

        renderer = chat.ChatRenderer(chat_template) if chat_template else None

        def text_of(turns: list[chat.Turn]) -> str:
            if renderer is not None:
                with contextlib.suppress(TemplateError):
                    return renderer.text(turns)
            return "\n".join(f"{t.role}: {t.content}" for t in turns)

        # Only conversations whose UTF-8 size could exceed the limit are tokenized (a token covers
        # at least one byte).
        texts = {i: text_of(turns) for i, turns in conversations.items()}
        candidates = [i for i, text in texts.items() if len(text.encode()) > max_seq_length]
        counts = count_tokens(tokenize, [texts[i] for i in candidates], progress)
        issues.extend(
            DataIssue("too_long", index, f"row {index}: {count} tokens, over data.max_seq_length "
                      f"{max_seq_length}; the end of the conversation will be cut (raise max_seq_length, "
                      "or split the conversation)")
            for index, count in zip(candidates, counts, strict=True) if count > max_seq_length)
    issues.sort(key=lambda issue: issue.row)
    return issues


def template_column_issues(config: RunConfig, columns: Sequence[str], *, conversations: bool = False,
                           filled: Mapping[str, int] | None = None) -> list[prompts.TemplateIssue]:
    """What the config's template does with the data's ``columns``, beyond the template's own lint
    (:func:`studio.core.prompt.lint_template`, which finds the fields the data lacks):

    - ``not_for_conversations`` (an error, as loading the data says): the rows are conversations
      (``conversations``), which only the model's chat template renders; any template but the
      ``chat`` preset names fields ({instruction}, {output}) that are none of the data's.
    - ``conversation_turns`` (info): the ``chat`` preset on conversations; its {field} form (what
      the template editor shows) is for instruction rows, the conversations go turn by turn.
    - ``unused_column``: a column with text that no placeholder reads (``input`` under the
      ``alpaca_no_input`` preset): the model never sees it. The split column and columns whose rows
      are all empty (``filled``: rows with text per column, when counted) are not flagged.
    """

    prompt = config.prompt
    fields, _optional = template_fields_for(config)
    if conversations:
        shown = ", ".join(f"{{{field}}}" for field in fields)
        if prompt.template == "chat":
            return [prompts.TemplateIssue(
                "conversation_turns", f"the rows are conversations: each is rendered turn by turn with the "
                f"model's chat template, the loss on every assistant turn; the fields {shown} of this form are "
                "for instruction rows, not this data", 0, "info")]
        return [prompts.TemplateIssue(
            "not_for_conversations", f"the rows are conversations: they are rendered with the model's chat "
            f"template, not this one, and its fields {shown} are not in the data; set prompt.template: chat",
            0, "error")]
    used = {config.data.columns.get(field, field) for field in fields}
    unused = [c for c in columns if c not in used and c != config.data.split_column
              and (filled is None or filled.get(c, 0) > 0)]
    issues = []
    for column in unused:
        count = f" ({filled[column]:,} rows have text)" if filled is not None else ""
        hint = (f"; the alpaca preset shows {{{column}}} when a row has one" if prompt.template == "alpaca_no_input"
                else f"; add {{{column}}} to the template, or leave the column out of the data")
        issues.append(prompts.TemplateIssue(
            "unused_column", f"column {column} is in no placeholder: the model never sees it{count}{hint}", 0))
    return issues


def filled_counts(source: Any) -> dict[str, int]:
    """Per column of ``source`` (a Dataset/Table or a list of row dicts), the rows holding a non-empty
    text (for :func:`template_column_issues`)."""
    return {name: sum(1 for value in values if isinstance(value, str) and value.strip())
            for name, values in _columns_of(source, None).items()}


def pair_lint(dataset: Any, config: RunConfig, issues: Sequence[Any]) -> list[Any]:
    """The dataset pane's lint for a preference run: :func:`lint_pairs` on every row (chat-shaped
    pairs flattened first) in place of the SFT lint's empty-answer and same-prompt findings (several
    pairs for one prompt are normal preference data) and its turn-order findings (a pair's prompt
    ends before the answer, with the user); the other findings (too long) are kept."""
    columns = config.data.columns
    names = [columns.get(f, f) for f in (config.prompt.response_field, config.prompt.rejected_field)]
    flat = flatten_table(dataset, config, template_fields_for(config)[0][0])
    present = flat.column_names
    values = [[str(v or "") for v in column_values(flat, n)] if n in present else [""] * len(flat) for n in names]
    found = [DataIssue(i.kind, i.row, i.message) for i in lint_pairs(values[0], values[1], *names)]
    kept = [i for i in issues if i.kind not in ("empty_output", "duplicate_prompt", "role_order")]
    return sorted([*kept, *found], key=lambda issue: issue.row)
