"""Prompts: a dataset row -> training text with the span that is the response, then token ids and labels.

Modules, each importing only those above it:

- ``rendered``: :class:`Rendered`, what a template renders (text, response start, field spans);
- ``jinja``: chat templates compiled in the environment transformers renders them in;
- ``labels``: a rendered row as token ids and labels (:data:`IGNORE_INDEX` where no loss is taken);
- ``template``: prompt templates (presets, ``{field}`` placeholders, a chat template as a prompt
  template), rendering a row, and the template's lint;
- ``chat``: conversations (ShareGPT / OpenAI shapes, tool calls), their lint, rendered with the
  model's chat template, loss spans on the assistant turns;
- ``tokens``: the model's tokenizer through the ``tokenizers`` package alone (counts without torch).

Callers import the names of the first four from here (``render``, ``encode``, ``Rendered``, ...).
Plain Python (plus jinja2 for chat templates): the UI imports this.
"""

from studio.core.prompt.labels import (
    IGNORE_INDEX,
    Encoded,
    bos_to_prepend,
    encode,
    eos_to_append,
    token_boundary,
)
from studio.core.prompt.rendered import Rendered, Span, TemplateError
from studio.core.prompt.template import (
    PRESETS,
    RAW_TEXT,
    TemplateIssue,
    lint_template,
    parse,
    placeholder_spans,
    render,
    resolve_template,
    syntax_issues,
    template_fields,
)

__all__ = [
    "IGNORE_INDEX", "PRESETS", "RAW_TEXT", "Encoded", "Rendered", "Span", "TemplateError", "TemplateIssue",
    "bos_to_prepend", "encode", "eos_to_append", "lint_template", "parse", "placeholder_spans", "render",
    "resolve_template", "syntax_issues", "template_fields", "token_boundary",
]
