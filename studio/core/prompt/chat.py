"""Chat datasets: conversations in ShareGPT or OpenAI shape, read, checked and rendered.

Two shapes are common on the Hub: ShareGPT's ``conversations`` column (``[{"from": "human", "value":
...}, {"from": "gpt", ...}]``, roles human / gpt / system) and OpenAI's ``messages`` column
(``[{"role": "user", "content": ...}]``, with an optional system turn first). Both become a list of
:class:`Turn` with OpenAI's role names, and a training row ``{"messages": [{"role", "content", ...}]}``.

Tool calling is OpenAI's shape too: an assistant message with ``tool_calls`` (``[{"type": "function",
"function": {"name", "arguments"}}]``), ``tool`` messages with the results, and the tools offered as
JSON schemas in a ``tools`` column (the row gets ``{"tools": [...]}`` beside its messages). Every key
of a message is kept for the template, as ``apply_chat_template`` passes it (keys whose value is
null are dropped, as transformers drops them).

A conversation is rendered with the tokenizer's own Jinja chat template, in the environment
transformers' ``apply_chat_template`` uses, with the same variables (``messages``, ``tools``,
``add_generation_prompt``, the special tokens), so the text is the one the model sees at inference.
Loss is taken on every assistant turn (its content, its tool calls and its end of turn) and nowhere
else, never on a tool's result: an assistant turn starts where the conversation before it, rendered
with the generation prompt, ends, and ends where the conversation up to it does. A template that
renders the last assistant turn differently from the same turn followed by more (Qwen3 adds an
empty ``<think>`` block to the last one) is matched on the part the two renderings share.

Plain Python plus jinja2: the UI imports this.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from studio.core.prompt.jinja import compile_chat_template
from studio.core.prompt.rendered import Rendered, Span, TemplateError

CHAT_FIELD = "messages"
"""The field a chat row carries its turns in (after reading either shape)."""

CHAT_COLUMNS = ("messages", "conversations", "conversation", "chat", "dialog")
"""Column names looked at first for conversations (``data.columns: {messages: COLUMN}`` names another)."""

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "bot": "assistant", "chatgpt": "assistant", "tool": "tool", "function": "tool",
         "ipython": "tool"}
"""Role names either shape uses -> OpenAI's (system, user, assistant, tool)."""


class ChatFormatError(ValueError):
    """A value that is not a conversation in either shape; the message says what is wrong."""


TOOLS_FIELD = "tools"
"""The field a chat row carries the tools offered to the model in (JSON schemas), when its data has them."""

TOOLS_COLUMNS = ("tools", "functions")
"""Column names looked at for the tools (``data.columns: {tools: COLUMN}`` names another)."""


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, with OpenAI's role name."""

    role: str
    content: str
    """The message's text (OpenAI's list-of-parts content joined; empty when it has none)."""

    extra: tuple[tuple[str, Any], ...] = ()
    """The message's other keys, as given (``tool_calls``, ``tool_call_id``, ``name``, ...)."""

    has_content: bool = True
    """False when the message had no content (an assistant turn that only calls tools): the
    template then sees no ``content`` key, as transformers passes it."""

    def as_message(self) -> dict[str, Any]:
        """The turn as the dict chat templates read: role, content and the message's other keys."""
        message: dict[str, Any] = {"role": self.role}
        if self.has_content:
            message["content"] = self.content
        message.update(self.extra)
        return message

    @property
    def tool_calls(self) -> list[Any]:
        """The tool calls an assistant turn makes (empty for other turns)."""
        calls = dict(self.extra).get("tool_calls")
        return list(calls) if isinstance(calls, list) else []


def shape_of(value: Any) -> str | None:
    """``"openai"`` (role/content), ``"sharegpt"`` (from/value) or None when ``value`` is neither.

    A string holding such a list as JSON (a CSV column) counts too.
    """
    value = decoded(value)
    if not isinstance(value, list) or not value or not all(isinstance(m, Mapping) for m in value):
        return None
    first = value[0]
    if "role" in first and "content" in first:
        return "openai"
    if "from" in first and "value" in first:
        return "sharegpt"
    return None


def decoded(value: Any) -> Any:
    """A conversation given as JSON text (a CSV cell) as the list it holds; any other value as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def find_chat_column(columns: Sequence[str], sample: Callable[[str], Any],
                     mapping: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The column holding conversations and its shape, or None for instruction data.

    ``sample(column)`` gives the column's first non-empty value. The column ``data.columns`` maps
    ``messages`` to is the only one tried when set; otherwise the usual names, then every column.
    """
    mapped = (mapping or {}).get(CHAT_FIELD)
    if mapped:
        tried: Sequence[str] = [mapped] if mapped in columns else []
    else:
        tried = [c for c in CHAT_COLUMNS if c in columns] + [c for c in columns if c not in CHAT_COLUMNS]
    for column in tried:
        shape = shape_of(sample(column))
        if shape is not None:
            return column, shape
    return None


def _plain(value: Any) -> Any:
    """A JSON value with the keys whose value is null dropped from every mapping in it: the tools'
    schemas and the tool calls' arguments read through Arrow get every key any other row has, as
    null (and a null in a schema or an argument list means nothing to a template)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parse_tools(value: Any, where: str = "") -> list[dict[str, Any]] | None:
    """The tools a row offers (a list of JSON schemas, or its JSON text), None when it has none;
    :class:`ChatFormatError` when it is something else."""
    value = decoded(value)
    if value is None or value == [] or value == "":
        return None
    if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        return [_plain(t) for t in value]
    prefix = f"{where}: " if where else ""
    raise ChatFormatError(f"{prefix}the tools are {type(value).__name__}, not a list of JSON schemas "
                          "({\"type\": \"function\", \"function\": {\"name\", \"parameters\"}})")


def parse_turns(value: Any, where: str = "") -> list[Turn]:
    """A conversation in either shape as turns; :class:`ChatFormatError` says what is wrong and where.

    ``where`` (``"data.jsonl, row 12"``) starts the message.
    """
    prefix = f"{where}: " if where else ""
    value = decoded(value)
    if value is None or value == []:
        raise ChatFormatError(f"{prefix}the conversation is empty; give it at least a user and an "
                              "assistant turn, or drop the row")
    if not isinstance(value, list):
        raise ChatFormatError(f"{prefix}the conversation is {type(value).__name__}, not a list of turns")
    turns: list[Turn] = []
    for number, message in enumerate(value, start=1):
        message = _decoded_message(message)
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"{prefix}turn {number} is {type(message).__name__}, not an object with "
                                  "role/content (or from/value)")
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if role is None:
            raise ChatFormatError(f"{prefix}turn {number} has no 'role' (or ShareGPT 'from') key")
        name = ROLES.get(str(role).strip().lower())
        if name is None:
            raise ChatFormatError(f"{prefix}turn {number} has the role {role!r}; use system, user, "
                                  "assistant or tool (ShareGPT: system, human, gpt)")
        extra = tuple((str(k), _plain(v)) for k, v in message.items()
                      if k not in ("role", "from", "content", "value") and v is not None)
        turns.append(Turn(name, _content_text(content), _reasoning_aliases(dict(extra)), content is not None))
    return turns


def _decoded_message(message: Any) -> Any:
    """A message stored as JSON text (``datasets`` keeps messages whose keys differ row to row so)."""
    if isinstance(message, str) and message.lstrip().startswith("{"):
        try:
            return json.loads(message)
        except ValueError:
            return message
    return message


def _reasoning_aliases(extra: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A turn's reasoning under every name templates read it by (``reasoning_content``, and
    ``thinking`` for gpt-oss's), as transformers fills them in from whichever the data used."""
    reasoning = next((extra[k] for k in ("reasoning_content", "thinking", "reasoning") if k in extra), None)
    if reasoning is not None:
        extra = {"thinking": reasoning, **extra, "reasoning_content": reasoning}
    return tuple(extra.items())


def _content_text(content: Any) -> str:
    """A turn's content as text: OpenAI's list-of-parts content joins its text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) if isinstance(part, Mapping) else str(part) for part in content)
    return content if isinstance(content, str) else str(content)


def messages_of(row: Mapping[str, Any]) -> list[Turn]:
    """The turns of a training row (``{"messages": ...}``, a list or its JSON text)."""
    return parse_turns(row.get(CHAT_FIELD))


def tools_of(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a training row offers (``{"tools": ...}``), or None."""
    return parse_tools(row.get(TOOLS_FIELD))


def find_tools_column(columns: Sequence[str], mapping: Mapping[str, str] | None = None) -> str | None:
    """The column holding a chat dataset's tools: ``data.columns``' ``tools`` entry, else the usual names."""
    mapped = (mapping or {}).get(TOOLS_FIELD)
    if mapped:
        return mapped if mapped in columns else None
    return next((c for c in TOOLS_COLUMNS if c in columns), None)


def is_chat_row(row: Mapping[str, Any]) -> bool:
    """Whether a training row is a conversation (carries :data:`CHAT_FIELD`)."""
    return CHAT_FIELD in row


def split_last_answer(turns: Sequence[Turn]) -> tuple[list[Turn], str]:
    """Everything before the last assistant turn, and that turn's text: the held-out prompt and target."""
    for index in range(len(turns) - 1, -1, -1):
        if turns[index].role == "assistant":
            return list(turns[:index]), turns[index].content
    return list(turns), ""


# ---------------------------------------------------------------------------------------- lint


def conversation_issues(turns: Sequence[Turn]) -> list[tuple[str, str]]:
    """``(kind, message)`` for what would hurt training: ``empty_turn`` and ``role_order`` (a system
    turn after the start, a conversation that does not start with the user, two turns in a row from
    one side, no assistant turn at the end)."""
    issues: list[tuple[str, str]] = []
    for number, turn in enumerate(turns, start=1):
        if not turn.content.strip() and not turn.tool_calls:
            issues.append(("empty_turn", f"turn {number} ({turn.role}) is empty; fill it in or drop the row"))
    expected = "user"
    for number, turn in enumerate(turns, start=1):
        if turn.role == "system":
            if number != 1:
                issues.append(("role_order", f"turn {number} is a system turn; only the first turn may be one"))
            continue
        if turn.role == "tool":
            expected = "assistant"
            continue
        if turn.role != expected:
            issues.append(("role_order", f"turn {number} is {turn.role} where {expected} was expected; "
                           "turns go user, assistant, user, ..."))
            break
        expected = "user" if expected == "assistant" else "assistant"
    if turns and turns[-1].role != "assistant":
        issues.append(("role_order", "the last turn is not the assistant's: nothing ends the conversation "
                       "for the model to learn; drop the trailing turn"))
    return issues


# ------------------------------------------------------------------------------------ rendering


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template. ``chat_vars`` (``bos_token``,
    ``eos_token``) are passed to the template, as transformers passes the special tokens."""

    def __init__(self, chat_template: str, **chat_vars: Any):
        if not chat_template:
            raise TemplateError("this is a chat dataset but the model's tokenizer has no chat template; "
                                "pick a model with one (an -Instruct model) or convert the data to "
                                "instruction/output columns")
        self._template = compile_chat_template(chat_template)
        self._vars = {"bos_token": "", "eos_token": "", **chat_vars}

    def text(self, turns: Sequence[Turn], add_generation_prompt: bool = False, *,
             tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as the template renders it (``apply_chat_template(messages, tools=tools,
        tokenize=False)``)."""
        from jinja2 import TemplateError as JinjaError

        try:
            return self._template.render(messages=[t.as_message() for t in turns],
                                         tools=list(tools) if tools else None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._vars)
        except JinjaError as exc:
            raise TemplateError(f"the tokenizer's chat template does not render: {exc}") from None

    def prompt(self, turns: Sequence[Turn], tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """What the model is given to answer after ``turns``: the conversation plus the generation prompt."""
        return self.text(turns, add_generation_prompt=True, tools=tools)

    def render(self, turns: Sequence[Turn], tools: Sequence[Mapping[str, Any]] | None = None,
               train_from: int = 0) -> Rendered:
        """The conversation with a span per turn's content (for the preview) and a loss span per
        assistant turn from index ``train_from`` on (its content, tool calls and end of turn; a
        preference pair trains its answer only). ``response_start`` is where the last assistant turn
        begins, so ``.prompt`` is everything before it."""
        turns = list(turns)
        full = self.text(turns, tools=tools)
        spans: list[Span] = []
        loss: list[tuple[int, int]] = []
        at = 0
        for index, turn in enumerate(turns):
            if turn.role == "assistant":
                if index == 0:
                    raise TemplateError(f"turn {index + 1}: the conversation starts with the assistant; "
                                        "start it with a user turn (lint lists such rows)")
                head = self.prompt(turns[:index], tools)
                if not full.startswith(head):
                    raise TemplateError(
                        f"the chat template does not render the turns before turn {index + 1} as the start "
                        "of the whole conversation, so the assistant turns cannot be told apart for the "
                        "loss; use a template that renders each message in order")
                start = len(head)
                end = start + _turn_length(self.text(turns[: index + 1], tools=tools), head, full, _said(turn))
                if end == start:
                    raise TemplateError(f"turn {index + 1}: the chat template renders this assistant turn "
                                        "differently inside the conversation than at its end; the loss "
                                        "cannot be placed on it")
                if index >= train_from:
                    loss.append((start, end))
                at = start
            found = full.find(turn.content, at) if turn.content else -1
            if found >= 0:
                spans.append(Span(turn.role, found, found + len(turn.content)))
                at = found + len(turn.content)
        response_start = loss[-1][0] if loss else len(full)
        return Rendered(full, response_start, tuple(spans), template="chat", loss_spans=tuple(loss))


def _said(turn: Turn) -> list[str]:
    """Text an assistant turn's rendering must hold: its content and the names of the tools it calls."""
    names = [str((call.get("function") or call).get("name", "")) for call in turn.tool_calls
             if isinstance(call, Mapping) and isinstance(call.get("function") or call, Mapping)]
    return [t for t in (turn.content.strip(), *names) if t]


def _turn_length(upto: str, head: str, full: str, said: Sequence[str]) -> int:
    """How many characters of ``full`` after ``head`` are the assistant turn that ``upto`` (the
    conversation rendered up to and including that turn) ends with; 0 when it cannot be told.

    Most templates render a turn the same wherever it falls: ``upto`` is then a prefix of ``full``.
    Some render the last turn with something more in front (Qwen3's empty ``<think>`` block): the
    turn inside ``full`` is then the longest tail of ``upto``'s turn that ``full`` continues with,
    as long as that tail still holds everything the turn ``said``.
    """
    if full.startswith(upto):
        return len(upto) - len(head)
    if not upto.startswith(head):
        return 0
    turn = upto[len(head):]
    for cut in range(len(turn)):
        tail = turn[cut:]
        if not all(text in tail for text in said):
            return 0
        if full.startswith(tail, len(head)):
            return len(tail)
    return 0


