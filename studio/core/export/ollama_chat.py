"""A model's Jinja chat template as the Go template Ollama renders conversations with.

Ollama does not run Jinja. Its templates walk ``.Messages`` in Go's ``text/template``, with the
system prompt in ``.System``. Nearly every chat template wraps each message in fixed text (ChatML's
``<|im_start|>user\\n ... <|im_end|>\\n``, Gemma's ``<start_of_turn>``, Phi-3's ``<|user|>``, Llama 3's
headers), so the wrappers are read off the template by rendering conversations of sentinel
messages (:func:`chat_turns`): the text before and after a user turn, before and after an
assistant turn, the generation prompt, a default system turn the template adds on its own (Qwen
2.5), and the system turn, either as its own block or folded into the first user turn (Gemma).

The wrappers are then checked: conversations rebuilt from them must equal the Jinja template's own
rendering, text for text. A template that does more than wrap (tool calls, per-message logic)
fails that check and :func:`chat_turns` returns None; the Modelfile then keeps the run's template.

Plain Python plus jinja2: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_U1, _A1, _U2, _A2, _S = ("\x00U1\x00", "\x00A1\x00", "\x00U2\x00", "\x00A2\x00", "\x00S\x00")


@dataclass(frozen=True)
class ChatTurns:
    """The fixed text a chat template puts around each message."""

    user_prefix: str
    user_suffix: str
    assistant_prefix: str
    """The generation prompt after a user turn (``<|im_start|>assistant\\n``)."""
    assistant_suffix: str
    """The end of an assistant turn: where generation stops (``<|im_end|>\\n``)."""
    preamble: str = ""
    """Text the template puts first when there is no system message (Qwen 2.5's default system turn)."""
    system_prefix: str | None = None
    """Before a system message in its own block; None when the system text is folded into the first
    user turn (``system_join`` after it) or the template has no system turn."""
    system_suffix: str = ""
    system_join: str | None = None
    """Folded system: the text between the system text and the first user message (Gemma's ``\\n\\n``)."""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation as these wrappers lay it out (what the Go template makes Ollama write)."""
        system = "".join(m["content"] for m in messages if m["role"] == "system")
        out = self.preamble if not system else ""
        if system and self.system_prefix is not None:
            out += self.system_prefix + system + self.system_suffix
        fold = system if system and self.system_join is not None else ""
        turns = [m for m in messages if m["role"] in ("user", "assistant")]
        for i, m in enumerate(turns):
            last = i == len(turns) - 1
            if m["role"] == "user":
                out += self.user_prefix + (fold + self.system_join if fold else "") + m["content"] + self.user_suffix
                fold = ""
                if last and add_generation_prompt:
                    out += self.assistant_prefix
            else:
                out += self.assistant_prefix + m["content"] + ("" if last else self.assistant_suffix)
        return out

    @property
    def end_marker(self) -> str:
        """The assistant's end-of-turn text without surrounding whitespace (a stop sequence)."""
        return self.assistant_suffix.strip()


def _common_prefix(a: str, b: str) -> str:
    """The longest common start, never ending inside a ``<...>`` marker (``<eos>`` and ``<|assistant|>``
    share a ``<`` that belongs to neither turn)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    common = a[:n]
    return common[:common.rfind("<")] if common.rfind("<") > common.rfind(">") else common


def _common_suffix(a: str, b: str) -> str:
    """The longest common end, never starting inside a ``<...>`` marker."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    common = a[len(a) - n:]
    close, opening = common.find(">"), common.find("<")
    return common[close + 1:] if close >= 0 and (opening < 0 or close < opening) else common


def chat_turns(chat_template: str, **chat_vars: Any) -> ChatTurns | None:
    """The wrappers of ``chat_template`` (``chat_vars``: ``eos_token`` and the like; BOS is left to
    the GGUF's ``add_bos_token``), or None when the template is not a plain per-message wrapper."""
    from jinja2 import TemplateError as JinjaError

    from studio.core.prompt.jinja import compile_chat_template

    template = compile_chat_template(chat_template)
    values = {"eos_token": "", **chat_vars, "bos_token": ""}

    def render(messages: list[tuple[str, str]], gen: bool) -> str:
        return template.render(messages=[{"role": r, "content": c} for r, c in messages],
                               add_generation_prompt=gen, **values)

    try:
        full = render([("user", _U1), ("assistant", _A1), ("user", _U2), ("assistant", _A2)], False)
        asked = render([("user", _U1)], True)
        alone = render([("user", _U1)], False)
        turns = _wrappers(full, asked, alone)
        if turns is None:
            return None
        turns = _with_system(turns, render)
    except (JinjaError, ValueError, TypeError, IndexError, KeyError):
        return None
    # What Ollama renders: a conversation ending in a user turn, then the generation prompt.
    probes = [[("user", _U1)], [("user", _U1), ("assistant", _A1), ("user", _U2)]]
    if turns.system_prefix is not None or turns.system_join is not None:
        probes.append([("system", _S), ("user", _U1), ("assistant", _A1), ("user", _U2)])
    for probe in probes:
        try:
            if turns.render([{"role": r, "content": c} for r, c in probe], True) != render(probe, True):
                return None
        except JinjaError:
            return None
    return turns


def _wrappers(full: str, asked: str, alone: str) -> ChatTurns | None:
    if any(s not in full for s in (_U1, _A1, _U2, _A2)) or _U1 not in asked:
        return None
    after_user = asked[asked.index(_U1) + len(_U1):]  # user suffix + generation prompt
    user_suffix = _common_prefix(after_user, alone[alone.index(_U1) + len(_U1):])
    assistant_prefix = after_user[len(user_suffix):]
    between = full[full.index(_A1) + len(_A1):full.index(_U2)]  # assistant suffix + user prefix
    head = full[:full.index(_U1)]  # preamble + user prefix
    if between.startswith(user_suffix) and user_suffix:
        assistant_suffix, user_prefix = user_suffix, between[len(user_suffix):]
    else:
        user_prefix = _common_suffix(head, between)
        assistant_suffix = between[:len(between) - len(user_prefix)]
    if not head.endswith(user_prefix):
        return None
    return ChatTurns(user_prefix, user_suffix, assistant_prefix, assistant_suffix,
                     preamble=head[:len(head) - len(user_prefix)])


def _with_system(turns: ChatTurns, render: Any) -> ChatTurns:
    """``turns`` with how the template writes a system message (unchanged when it writes none)."""
    from jinja2 import TemplateError as JinjaError

    try:
        text = render([("system", _S), ("user", _U1), ("assistant", _A1)], False)
    except JinjaError:  # templates that refuse a system turn (Gemma 2) have none
        return turns
    if _S not in text or _U1 not in text:
        return turns
    before, between = text[:text.index(_S)], text[text.index(_S) + len(_S):text.index(_U1)]
    if text.index(_S) < text.index(_U1) and between.endswith(turns.user_prefix) and before != turns.user_prefix:
        suffix = between[:len(between) - len(turns.user_prefix)]
        return ChatTurns(**{**turns.__dict__, "system_prefix": before, "system_suffix": suffix})
    if before == turns.user_prefix:
        return ChatTurns(**{**turns.__dict__, "system_join": between})
    return turns


def _go(text: str) -> str:
    """Literal text in a Go template: a ``{{`` of its own becomes a printed string."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(turns: ChatTurns) -> str:
    """Ollama's TEMPLATE for these turns. One line with no ``{{-`` trimming, so every newline the
    chat template writes is kept exactly."""
    g = _go
    system = ""
    if turns.system_prefix is not None:
        system = f"{{{{ if .System }}}}{g(turns.system_prefix)}{{{{ .System }}}}{g(turns.system_suffix)}"
        system += f"{{{{ else }}}}{g(turns.preamble)}{{{{ end }}}}" if turns.preamble else "{{ end }}"
    elif turns.preamble:
        system = f"{{{{ if not .System }}}}{g(turns.preamble)}{{{{ end }}}}"
    fold = ""
    if turns.system_join is not None:
        # The system text goes into the first user turn only: $system is emptied once written.
        fold = f"{{{{ if $system }}}}{{{{ $system }}}}{g(turns.system_join)}{{{{ $system = \"\" }}}}{{{{ end }}}}"
    return (("{{ $system := .System }}" if fold else "") + system
            + "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            + f"{{{{ if eq .Role \"user\" }}}}{g(turns.user_prefix)}{fold}{{{{ .Content }}}}{g(turns.user_suffix)}"
            + f"{{{{ if $last }}}}{g(turns.assistant_prefix)}{{{{ end }}}}"
            + f"{{{{ else if eq .Role \"assistant\" }}}}{g(turns.assistant_prefix)}{{{{ .Content }}}}"
            + f"{{{{ if not $last }}}}{g(turns.assistant_suffix)}{{{{ end }}}}"
            + "{{ end }}{{ end }}")
