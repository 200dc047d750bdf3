"""A small evaluator for the part of Go's text/template that Studio's Ollama templates use, so tests
can render a Modelfile's TEMPLATE the way Ollama would (Go is not installed here).

Covered: text, ``{{ if }} / {{ else if }} / {{ else }} / {{ end }}``, ``{{ range $i, $_ := .Messages }}``,
``$x := ...`` and ``$x = ...`` (assignment reaches the variable declared outside the range, as in Go
1.11+), fields (``.System``, ``.Content``, ``$.Messages``), string and number literals, and the
functions ``not``, ``and``, ``eq``, ``len``, ``slice``. Anything else raises, so a template that
strays from this subset fails the test rather than passing unchecked.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

_ACTION = re.compile(r"({{.*?}})", re.S)


def _parse(template: str) -> list[Any]:
    """The template as a tree: strings, ("do", expr), ("if", [(cond, body)...], else_body), ("range", vars, expr, body)."""
    tokens = [t for t in _ACTION.split(template) if t]
    pos = 0

    def block(stop: tuple[str, ...]) -> tuple[list[Any], str]:
        nonlocal pos
        body: list[Any] = []
        while pos < len(tokens):
            token = tokens[pos]
            pos += 1
            if not (token.startswith("{{") and token.endswith("}}")):
                body.append(token)
                continue
            action = token[2:-2].strip()
            word = action.split(" ", 1)[0]
            if word in stop or action.startswith("else"):
                return body, action
            if word == "if":
                branches, otherwise = [(action[3:], None)], []
                inner, end = block(("end",))
                branches[-1] = (branches[-1][0], inner)
                while end.startswith("else"):
                    if end.startswith("else if "):
                        inner, next_end = block(("end",))
                        branches.append((end[len("else if "):], inner))
                    else:
                        otherwise, next_end = block(("end",))
                    end = next_end
                body.append(("if", branches, otherwise))
            elif word == "range":
                names, expr = action[len("range "):].split(":=")
                inner, _ = block(("end",))
                body.append(("range", [n.strip() for n in names.split(",")], expr.strip(), inner))
            else:
                body.append(("do", action))
        return body, ""

    tree, rest = block(())
    assert rest == "", f"unbalanced template: {rest}"
    return tree


def _split(expr: str) -> list[str]:
    lexer = shlex.shlex(expr.replace("(", " ( ").replace(")", " ) "), posix=False)
    lexer.whitespace_split = True
    return list(lexer)


def _value(tokens: list[str], scope: dict[str, Any], dot: Any) -> tuple[Any, list[str]]:
    head, rest = tokens[0], tokens[1:]
    if head == "(":
        depth, i = 1, 0
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        return _call(rest[:i - 1], scope, dot), rest[i:]
    if head.startswith('"'):
        return head[1:-1], rest
    if head.isdigit():
        return int(head), rest
    if head.startswith("$"):
        name, _, path = head.partition(".")
        value = scope["$"] if name == "$" else scope[name]
        for part in filter(None, path.split(".")):
            value = value[part]
        return value, rest
    if head.startswith("."):
        value = dot
        for part in filter(None, head.split(".")):
            value = value[part]
        return value, rest
    raise ValueError(f"not in the evaluated subset: {head}")


def _call(tokens: list[str], scope: dict[str, Any], dot: Any) -> Any:
    functions = {"not": lambda a: not a, "eq": lambda a, b: a == b, "len": len, "and": lambda *a: all(a),
                 "slice": lambda seq, start: seq[start:]}
    if tokens[0] in functions:
        args, rest = [], tokens[1:]
        while rest:
            value, rest = _value(rest, scope, dot)
            args.append(value)
        return functions[tokens[0]](*args)
    value, rest = _value(tokens, scope, dot)
    assert not rest, f"not in the evaluated subset: {tokens}"
    return value


def _run(tree: list[Any], scopes: list[dict[str, Any]], dot: Any) -> str:
    out = []
    for node in tree:
        if isinstance(node, str):
            out.append(node)
        elif node[0] == "do":
            action = node[1]
            if ":=" in action or re.match(r"^\$\w+ = ", action):
                name, expr = re.split(r"\s*:?=\s*", action, maxsplit=1)
                value = _call(_split(expr), _flat(scopes), dot)
                if ":=" in action:
                    scopes[-1][name] = value
                else:
                    next(s for s in reversed(scopes) if name in s)[name] = value
            else:
                value = _call(_split(action), _flat(scopes), dot)
                out.append("" if value is None else str(value))
        elif node[0] == "if":
            for cond, body in node[1]:
                if _call(_split(cond), _flat(scopes), dot):
                    out.append(_run(body, scopes + [{}], dot))
                    break
            else:
                out.append(_run(node[2], scopes + [{}], dot))
        else:
            _, names, expr, body = node
            for i, item in enumerate(_call(_split(expr), _flat(scopes), dot)):
                out.append(_run(body, scopes + [{names[0]: i, names[1]: item}], item))
    return "".join(out)


def _flat(scopes: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for scope in scopes:
        merged.update(scope)
    return merged


def render(template: str, messages: list[dict[str, str]], system: str = "") -> str:
    """What Ollama writes for ``messages`` (``system``: Ollama's ``.System``)."""
    data = {"System": system, "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}
    return _run(_parse(template), [{"$": data}], data)
