"""Chat templates compiled as transformers compiles them: the same sandboxed Jinja environment and helpers.

``apply_chat_template`` renders with an ``ImmutableSandboxedEnvironment`` (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``), a ``tojson`` filter that keeps non-ASCII text, and the
``raise_exception`` and ``strftime_now`` globals; the same here, so the text Studio trains on is the
text the model sees at inference. Plain Python plus jinja2 (imported when first used).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from studio.core.prompt.rendered import TemplateError


def jinja_environment() -> Any:
    """A Jinja environment like the one transformers renders chat templates in."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


@lru_cache(maxsize=8)
def compile_chat_template(chat_template: str) -> Any:
    """The compiled Jinja template (cached: compiling costs far more than rendering)."""
    from jinja2 import TemplateError as JinjaError

    try:
        return jinja_environment().from_string(chat_template)
    except JinjaError as exc:
        raise TemplateError(f"the tokenizer's chat template does not compile: {exc}") from None
