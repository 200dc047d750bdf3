"""GRPO's reward functions: the built-ins, your own Python functions, and calling them safely.

A reward function has TRL's signature, ``f(completions, prompts, **columns) -> list[float | None]``:
one value per completion (None where the reward does not apply, which counts as 0 in the total).
``completions`` and ``prompts`` are text, or for conversational data lists of ``{role, content}``
messages (a completion is ``[{"role": "assistant", "content": ...}]``), as TRL passes them; every
other column of the data row arrives as a keyword argument, one value per completion, and so does
``completion_ids`` (each completion's token ids). A function without ``**kwargs`` receives only the
arguments it names, so ``def f(completions, answer)`` works as well. TRL reward functions work
unchanged.

Functions are called one group at a time (one prompt's completions), so a failure names its prompt:
a function that raises, returns the wrong number of values, or a value that is not a finite number
raises :class:`RewardFailed` with one line naming the function, the prompt and the problem.

Your functions are your own Python, imported into the worker process that trains (docs/grpo.md).
Built-ins: ``exact_match`` (the stripped completion equals the column's value), ``regex`` (the
pattern is found in the completion), ``number_match`` (the completion's last number equals the
column's last number, GSM8K-style), ``length`` (at most ``max_chars`` characters).

Plain Python: the UI and ``studio config check`` import this (the functions it loads may import
anything).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from studio.core.grpo.reward_builtins import BUILTINS, NEEDS, builtin, completion_text
from studio.core.runs.cells import cell

if TYPE_CHECKING:
    from studio.core.config import RewardConfig, RunConfig
    from studio.core.config.reader import Reader


ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every reward function may take besides the data's columns."""



_counter = itertools.count()


class RewardError(ValueError):
    """A reward in the config that cannot be used (unknown, unreadable, missing an option); the
    message names the config key and what to do."""


class RewardFailed(RuntimeError):
    """A reward function failed on a group of completions; the message is the one line to show."""

    def __init__(self, message: str, reward: str = "", prompt: str = ""):
        super().__init__(message)
        self.reward = reward
        self.prompt = prompt


@dataclass(frozen=True)
class Reward:
    """A reward ready to call: its label, weight, the function and which arguments it takes."""

    label: str
    """Unique short name: the function's name (``format_ok``) or the built-in's; events and plots use it."""

    weight: float
    function: Callable[..., Any]
    source: str
    """Where it came from, as written in the config (``my_rewards.py:format_ok``, ``exact_match``)."""

    takes: frozenset[str] | None = None
    """The keyword arguments it names; None when it takes ``**kwargs`` (it gets everything)."""


# ------------------------------------------------------------------------------------ the config


def check_configs(config: RunConfig, reader: Reader) -> None:
    """What a GRPO config's rewards can be checked for without importing anything: at least one,
    each a built-in with its option or a ``file.py:function`` / ``module:function`` reference, a
    finite weight. Each problem is reported to ``reader`` (one line a key; the caller raises them
    all at once)."""
    rewards = config.grpo.rewards
    if not rewards:
        reader.report(("trainer", "method"), (
            "'trainer.method' is grpo but 'grpo.rewards' is empty; name at least one reward, e.g. "
            "grpo: {rewards: [{name: exact_match, column: answer}]} (docs/grpo.md)"))
    for index, spec in enumerate(rewards):
        key = ("grpo", "rewards", str(index))
        where = f"'grpo.rewards[{index}]'"
        name = spec.name.strip()
        if not name:
            reader.report(key, f"{where} has no name; give a built-in ({', '.join(BUILTINS)}) or file.py:function")
            continue
        if not math.isfinite(spec.weight):
            reader.report((*key, "weight"), f"{where}: weight must be a finite number; it is {spec.weight}")
        if name in BUILTINS:
            option = NEEDS[name]
            value = getattr(spec, option)
            if value is None or (isinstance(value, str) and not value.strip()):
                example = {"column": "column: answer", "pattern": "pattern: '^\\\\d+$'",
                           "max_chars": "max_chars: 200"}[option]
                reader.report(key, f"{where}: {name} needs '{option}' ({{name: {name}, {example}}})")
                continue
            if name == "regex":
                try:
                    re.compile(str(spec.pattern))
                except re.error as exc:
                    reader.report((*key, "pattern"), f"{where}: the pattern {spec.pattern!r} is not a "
                                  f"regular expression ({exc}); fix it")
            if name == "length" and int(spec.max_chars or 0) <= 0:
                reader.report((*key, "max_chars"), f"{where}: max_chars must be greater than 0")
        elif ":" not in name or not all(part.strip() for part in name.rsplit(":", 1)):
            reader.report(key, (f"{where} is {name!r}: not a built-in ({', '.join(BUILTINS)}); name your "
                                "own function as file.py:function (relative to the config file) or "
                                "package.module:function"))


def resolve_paths(config: RunConfig, base_dir: str | Path | None) -> None:
    """Make each ``file.py:function`` reward's file absolute, in place: found relative to
    ``base_dir`` (the config file's folder) first, then the working directory. A run's saved config
    must work from any directory, as its data path does. References that find no file are left for
    :func:`load_rewards` to report."""
    for spec in config.grpo.rewards:
        file, function = _file_reference(spec.name)
        if file is None:
            continue
        path = Path(file).expanduser()
        if path.is_absolute():
            continue
        for root in ([Path(base_dir)] if base_dir is not None else []) + [Path.cwd()]:
            if (root / path).is_file():
                spec.name = f"{(root / path).resolve()}:{function}"
                break


def _file_reference(name: str) -> tuple[str | None, str]:
    """``("path/to/file.py", "function")`` for a file reference, ``(None, name)`` otherwise."""
    if ":" not in name:
        return None, name
    module, function = name.strip().rsplit(":", 1)
    if module.endswith(".py") or "/" in module or "\\" in module:
        return module, function
    return None, name


def load_rewards(config: RunConfig, base_dir: str | Path | None = None) -> list[Reward]:
    """The config's rewards, ready to call; your files are imported now (each time: a file you
    fixed is read again). Raises :class:`RewardError` naming the reward and what to do."""
    rewards: list[Reward] = []
    for index, spec in enumerate(config.grpo.rewards):
        where = f"grpo.rewards[{index}] ({spec.name})"
        if spec.name in BUILTINS:
            function, takes = builtin(spec)
        else:
            function = _import(spec.name, base_dir, where)
            takes = _named_arguments(function, where)
        rewards.append(Reward(label="", weight=float(spec.weight), function=function, source=spec.name, takes=takes))
    return _labelled(rewards, config.grpo.rewards)


def _import(name: str, base_dir: str | Path | None, where: str) -> Callable[..., Any]:
    file, function_name = _file_reference(name)
    if file is not None:
        path = Path(file).expanduser()
        if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).is_file():
            path = Path(base_dir) / path
        if not path.is_file():
            raise RewardError(f"{where}: no file {path}; give the path relative to the config file "
                              "(or an absolute one)")
        module_name = f"studio_reward_{path.stem}_{next(_counter)}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RewardError(f"{where}: {path} cannot be imported as Python; name a .py file")
        module = importlib.util.module_from_spec(spec)
        folder = str(path.resolve().parent)
        sys.path.insert(0, folder)  # so that it imports its own helpers beside it
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise RewardError(f"{where}: importing {path} failed: {type(exc).__name__}: {_first_line(exc)}") from None
        finally:
            if sys.path and sys.path[0] == folder:
                sys.path.pop(0)
    else:
        module_path, function_name = name.rsplit(":", 1)
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise RewardError(f"{where}: cannot import {module_path} ({type(exc).__name__}: "
                              f"{_first_line(exc)}); is it installed in this environment?") from None
    function = getattr(module, function_name, None)
    if function is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"{where}: no function '{function_name}' there"
                          + (f" (functions: {', '.join(found)})" if found else ""))
    if not callable(function):
        raise RewardError(f"{where}: '{function_name}' is not a function")
    return function


def _named_arguments(function: Callable[..., Any], where: str) -> frozenset[str] | None:
    """The keyword arguments ``function`` takes, or None when it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin or C function: pass everything, as TRL does
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        raise RewardError(f"{where}: takes *args; reward functions are called with keyword arguments "
                          "(completions=..., prompts=..., and the data's columns)")
    return frozenset(p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY)


def _labelled(rewards: list[Reward], specs: Sequence[RewardConfig]) -> list[Reward]:
    """Labels: the function's own name (TRL logs ``rewards/<name>``); a name used twice gets its
    column or pattern, then a number."""
    bases = []
    for reward, spec in zip(rewards, specs, strict=True):
        base = spec.name if spec.name in BUILTINS else getattr(reward.function, "__name__",
                                                              type(reward.function).__name__)
        bases.append(base)
    labels: list[str] = []
    for spec, base in zip(specs, bases, strict=True):
        label = base
        if bases.count(base) > 1 and (spec.column or spec.pattern):
            label = f"{base}:{spec.column or spec.pattern}"
        while label in labels:
            label = f"{label}#{sum(1 for x in labels if x.startswith(base)) + 1}"
        labels.append(label)
    return [Reward(label, r.weight, r.function, r.source, r.takes) for r, label in zip(rewards, labels, strict=True)]


def needed_columns(rewards: Sequence[Reward], columns: Sequence[str], where: str) -> None:
    """Raise :class:`RewardError` when a reward names an argument that is neither one of
    :data:`ARGUMENTS` nor a column of the data (and has no default)."""
    available = set(ARGUMENTS) | set(columns)
    for reward in rewards:
        if reward.takes is None:
            continue
        try:
            parameters = inspect.signature(reward.function).parameters.values()
        except (TypeError, ValueError):
            continue
        wanted = [p.name for p in parameters if p.default is p.empty and p.kind is not p.POSITIONAL_ONLY] \
            if reward.source not in BUILTINS else sorted(reward.takes)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise RewardError(f"reward {reward.label} ({reward.source}) needs '{missing[0]}', which is not a "
                              f"column of {where} (columns: {', '.join(columns) or 'none'})")


# ------------------------------------------------------------------------------------ calling


@dataclass(frozen=True)
class GroupScores:
    """One group's rewards: per reward label, a value per completion (None: does not apply), and
    each completion's weighted total."""

    scores: dict[str, list[float | None]]
    totals: list[float]


def score_group(rewards: Sequence[Reward], prompt: Any, completions: Sequence[Any],
                columns: Mapping[str, Any], completion_ids: Sequence[Sequence[int]] | None = None,
                shown_prompt: str | None = None) -> GroupScores:
    """Score one prompt's ``completions`` with every reward. ``columns`` are the row's other
    columns (one value each, repeated for every completion as TRL does). Raises
    :class:`RewardFailed` with one line naming the reward, the prompt and the problem."""
    n = len(completions)
    arguments: dict[str, Any] = {"prompts": [prompt] * n, "completions": list(completions),
                                 "completion_ids": [list(ids) for ids in completion_ids] if completion_ids
                                 is not None else [[] for _ in range(n)]}
    for name, value in columns.items():
        if name not in arguments:
            arguments[name] = [value] * n
    if shown_prompt is None:
        shown_prompt = prompt if isinstance(prompt, str) else completion_text(prompt)
    shown = cell(shown_prompt, 60)
    scores: dict[str, list[float | None]] = {}
    totals = [0.0] * n
    for reward in rewards:
        passed = arguments if reward.takes is None else {k: v for k, v in arguments.items() if k in reward.takes}

        def failed(problem: str, reward: Reward = reward) -> RewardFailed:
            return RewardFailed(f"reward {reward.label} ({reward.source}) {problem} on the prompt {shown!r}",
                                reward.label, shown)

        try:
            values = reward.function(**passed)
        except Exception as exc:
            raise failed(f"raised {type(exc).__name__}: {_first_line(exc)}") from exc
        try:
            values = list(values)
        except TypeError:
            raise failed(f"returned {cell(repr(values), 40)}, not a list of {n} numbers") from None
        if len(values) != n:
            raise failed(f"returned {len(values)} values for {n} completions; return one per completion")
        row: list[float | None] = []
        for i, value in enumerate(values):
            if value is None:
                row.append(None)
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise failed(f"returned {cell(repr(value), 30)} for completion {i + 1}; return numbers "
                             "(or None where it does not apply)") from None
            if not math.isfinite(number):
                raise failed(f"returned {number} for completion {i + 1}; return finite numbers (None where "
                             "it does not apply)")
            row.append(number)
            totals[i] += reward.weight * number
        scores[reward.label] = row
    return GroupScores(scores, totals)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return cell(text.splitlines()[0] if text else type(exc).__name__, 160)


def check_on_row(config: RunConfig, row: Mapping[str, Any], base_dir: str | Path | None = None) -> list[Reward]:
    """Import the config's rewards and call each on ``row`` with two completions: an empty one and
    the row's own answer (its response field's or a reward's column, when it has one), before any
    model loads (``studio config check``, and a worker before it loads the model). Raises
    :class:`RewardError` or :class:`RewardFailed` with the line to show; returns the rewards."""
    from studio.core import prompt as prompts
    from studio.core.grpo import rows as grpo_rows

    rewards = load_rewards(config, base_dir)
    columns = grpo_rows.reward_columns(row)
    needed_columns(rewards, list(columns), str(config.data.path or "the data"))
    names = [config.prompt.response_field, *(spec.column for spec in config.grpo.rewards if spec.column)]
    answer = next((str(columns[name]) for name in names if columns.get(name) is not None), "")
    texts = ["", answer]
    messages = grpo_rows.conversation(row)
    if messages is not None:
        prompt: Any = messages
        shown = str(messages[-1].get("content", "")) if messages else ""
        completions: list[Any] = [[{"role": "assistant", "content": text}] for text in texts]
    else:
        fields = grpo_rows.template_row(row, config)
        template = config.prompt.template
        shown = ("\n\n".join(v for v in fields.values() if v) if template == "chat"  # needs the tokenizer
                 else prompts.render(template, fields, config.prompt.response_field).prompt)
        prompt, completions = shown, texts
    score_group(rewards, prompt, completions, columns, completion_ids=[[], []], shown_prompt=shown)
    return rewards
