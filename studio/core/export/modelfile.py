"""An Ollama Modelfile for an exported GGUF: the model's chat turns or the run's prompt template as
Ollama's TEMPLATE, and the stop sequences.

A run that trained through the model's chat template (``prompt.template: chat``) gets that chat
template as Ollama's Go template (:mod:`studio.core.export.ollama_chat`): the model is then used as the
chat model it is, system prompt and earlier turns included. Any other run gets its own template.

For the run's template, Studio's chat sends a person's text as the template's first field (the
instruction) with the other fields empty, and the model answers from where the response field
starts; the Modelfile makes Ollama do exactly that: the prompt part of the template with
``{{ .Prompt }}`` where that field goes.

The stop sequences are the tokenizer's end-of-sequence token, the family's end-of-turn marker (read
off the model's chat template: ``<|im_end|>`` for Qwen, ``<end_of_turn>`` for Gemma, ``<|end|>`` for
Phi-3, ``<|eot_id|>`` for Llama 3), and for a run's own template any end-of-turn marker it puts after
the response and the heading line just before the first field (a model that starts a new
``### Instruction:`` block or user turn is done answering).

Plain Python: no torch, no Ollama needed to write one.
"""

from __future__ import annotations

import re

from studio.core.export.ollama_chat import chat_turns, go_template
from studio.core.prompt.template import _preset, parse, render, template_fields

_SENTINEL = "\x00PROMPT\x00"
_END_MARKER = re.compile(r"<[^<>\s{}]+>")


def _go_literal(text: str) -> str:
    """Text placed in a Go template verbatim: a ``{{`` of its own becomes a printed string."""
    return text.replace("{{", '{{ "{{" }}')


def ollama_template(template: str, response_field: str = "output") -> str:
    """The Go template Ollama renders a prompt through, from a Studio template (``{field}`` form)."""
    template = _preset(template, response_field) or template
    fields = [f for f in template_fields(template) if f != response_field]
    first = fields[0] if fields else None
    row = {response_field: ""}
    if first is not None:
        row[first] = _SENTINEL
    prompt = render(template, row, response_field).prompt
    head = prompt if first is not None else prompt + _SENTINEL
    return _go_literal(head).replace(_SENTINEL, "{{ .Prompt }}")


def stop_sequences(template: str, response_field: str = "output", eos_token: str | None = None) -> list[str]:
    """Where Ollama should stop: EOS, end-of-turn markers after the response, the first field's heading."""
    template = _preset(template, response_field) or template
    stops: list[str] = []
    if eos_token:
        stops.append(eos_token)
    pieces = parse(template)
    after = False
    for piece in pieces:
        if piece.field == response_field:
            after = True
        elif after and piece.field is None:
            stops += _END_MARKER.findall(piece.text)
    if len(pieces) > 1 and pieces[0].field is None and pieces[1].field != response_field:
        opening = pieces[0].text.strip().splitlines()
        if opening:
            stops.append(opening[-1].strip())
    return list(dict.fromkeys(s for s in stops if s))


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile(gguf_name: str, template: str, response_field: str = "output", eos_token: str | None = None,
              temperature: float | None = None, adapter_name: str | None = None,
              base_gguf_hint: str | None = None, chat_template: str | None = None, use_chat: bool = False) -> str:
    """The text of a Modelfile: ``FROM ./gguf_name`` with a TEMPLATE and stop sequences.

    ``chat_template`` is the model's own (Jinja); with ``use_chat`` (the run trained through it) it
    becomes the TEMPLATE, else ``template`` (the run's) does, and the chat template only adds its
    end-of-turn marker to the stops. A chat template Studio cannot read as per-message turns leaves
    the run's template in place, said in a comment. ``adapter_name`` (the LoRA GGUF) is mentioned as
    the alternative to the merged file: Ollama's ``ADAPTER`` needs the base model's own GGUF as
    ``FROM``, which ``base_gguf_hint`` names.
    """
    lines = [
        "# Made by Studio. Create the model with:  ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
    ]
    if adapter_name:
        lines += [
            f"# Or, over the base model's own GGUF ({base_gguf_hint or 'the base model as GGUF'}), the adapter alone:",
            "#   FROM /path/to/base.gguf",
            f"#   ADAPTER ./{adapter_name}",
        ]
    turns = chat_turns(chat_template, eos_token=eos_token or "") if chat_template else None
    if use_chat and turns is not None:
        lines.append("# The model's chat template, as Ollama's Go template (system prompt and earlier turns included).")
        lines.append(f'TEMPLATE """{go_template(turns)}"""')
        stops = [eos_token or "", turns.end_marker]
    else:
        if use_chat:
            lines.append("# The model's chat template does more than wrap each message; the run's template is used.")
        lines.append(f'TEMPLATE """{ollama_template(template, response_field)}"""')
        stops = stop_sequences(template, response_field, eos_token)
        if turns is not None:
            stops.append(turns.end_marker)
    for stop in dict.fromkeys(s for s in stops if s):
        lines.append(f"PARAMETER stop {_quote(stop)}")
    if temperature is not None:
        lines.append(f"PARAMETER temperature {temperature:g}")
    return "\n".join(lines) + "\n"
