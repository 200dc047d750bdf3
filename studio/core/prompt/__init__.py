"""Prompts: a dataset row -> training text with the span that is the response, then token ids and labels.

- ``template``: prompt templates (presets, ``{field}`` placeholders, a chat template as a prompt
  template), rendering a row, and the template's lint;
- ``chat``: conversations (ShareGPT / OpenAI shapes, tool calls), their lint, the model's chat
  template rendered as transformers renders it, loss spans on the assistant turns;
- ``tokens``: the model's tokenizer through the ``tokenizers`` package alone (counts without torch).

Callers import the template's public names from here. Plain Python (plus jinja2 for chat templates):
the UI imports this.
"""

from studio.core.prompt.template import (
    IGNORE_INDEX,
    PRESETS,
    RAW_TEXT,
    Encoded,
    Rendered,
    Span,
    TemplateError,
    TemplateIssue,
    bos_to_prepend,
    encode,
    eos_to_append,
    lint_template,
    parse,
    placeholder_spans,
    render,
    resolve_template,
    syntax_issues,
    template_fields,
    token_boundary,
)

__all__ = [
    "IGNORE_INDEX", "PRESETS", "RAW_TEXT", "Encoded", "Rendered", "Span", "TemplateError", "TemplateIssue",
    "bos_to_prepend", "encode", "eos_to_append", "lint_template", "parse", "placeholder_spans", "render",
    "resolve_template", "syntax_issues", "template_fields", "token_boundary",
]
