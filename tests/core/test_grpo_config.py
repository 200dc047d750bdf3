"""GRPO without a model: the config section, the rewards (built-ins and your own functions with TRL's
signature), their one-line failures, the two data shapes, and `studio config check` calling every
reward on one row before any model loads."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers.cli import run_studio

from studio.core.config import ConfigError, RewardConfig, RunConfig, load_config, parse_config
from studio.core.data import load_splits
from studio.core.grpo import rewards as rw
from studio.core.grpo.rows import conversation, reward_columns
from studio.core.paths import sample_data_dir

ISSUE_YAML = """\
model: {base_model: tiny}
data: {path: rows.jsonl}
trainer:
  method: grpo
grpo:
  num_generations: 8          # completions per prompt (the group)
  max_completion_length: 256
  temperature: 1.0
  beta: 0.0                   # KL to the base model (the adapters switched off); 0: no reference pass
  loss: grpo                  # or dr_grpo (token-level normalisation, no length bias)
  rewards:
    - my_rewards.py:format_ok
    - {name: exact_match, column: answer, weight: 2.0}
"""


def test_the_issues_grpo_section_reads_and_round_trips() -> None:
    config = parse_config(ISSUE_YAML, "grpo.yaml")
    g = config.grpo
    assert (config.trainer.method, g.num_generations, g.max_completion_length, g.temperature, g.beta, g.loss) \
        == ("grpo", 8, 256, 1.0, 0.0, "grpo")
    assert g.rewards == [RewardConfig(name="my_rewards.py:format_ok"),
                         RewardConfig(name="exact_match", column="answer", weight=2.0)]
    again = parse_config(config.to_yaml(), "dumped.yaml")
    assert again.grpo == g


@pytest.mark.parametrize(("change", "expected"), [
    ("    - {name: exact_match}\n", ["line 12", "grpo.rewards[0]", "exact_match needs 'column'"]),
    ("    - {name: regex, pattern: '(unclosed'}\n", ["line 12", "not a regular expression"]),
    ("    - just_a_name\n", ["line 11", "'just_a_name'", "file.py:function"]),
    ("    - {name: length, max_chars: 0}\n", ["line 12", "max_chars must be greater than 0"]),
    ("    - {name: exact_match, column: answer, wieght: 2}\n", ["line 12", "grpo.rewards.0.wieght", "'weight'"]),
])
def test_a_bad_reward_is_refused_naming_its_line_and_what_to_do(change: str, expected: list[str]) -> None:
    text = ISSUE_YAML.replace("    - my_rewards.py:format_ok\n    - {name: exact_match, column: answer, weight: 2.0}\n",
                              change)
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "grpo.yaml")
    message = str(caught.value)
    assert message.startswith("grpo.yaml: line") and all(part in message for part in expected), message


def test_grpo_keys_are_checked() -> None:
    for text, expected in (
        (ISSUE_YAML.replace("num_generations: 8", "num_generations: 1"), "'grpo.num_generations' must be at least 2"),
        (ISSUE_YAML.replace("loss: grpo ", "loss: dapo "), "'grpo.loss' is 'dapo'; choose one of grpo, dr_grpo"),
        (ISSUE_YAML.replace("temperature: 1.0", "temperature: 0"), "'grpo.temperature' must be in (0, 100]"),
        (ISSUE_YAML.replace("data: {path: rows.jsonl}", "data: {path: rows.jsonl, max_seq_length: 200}"),
         "'data.max_seq_length' is 200 but 'grpo.max_completion_length' is 256"),
        (ISSUE_YAML.split("  rewards:")[0], "'grpo.rewards' is empty"),
    ):
        with pytest.raises(ConfigError, match="grpo.yaml: line") as caught:
            parse_config(text, "grpo.yaml")
        assert expected in str(caught.value)


# ----------------------------------------------------------------------------------- built-ins


def _builtin(**spec) -> rw.Reward:
    config = RunConfig()
    config.grpo.rewards = [RewardConfig(**spec)]
    return rw.load_rewards(config)[0]


def _score(reward: rw.Reward, completions: list, **columns) -> list:
    return rw.score_group([reward], "the prompt", completions, columns).scores[reward.label]


def test_builtin_rewards() -> None:
    exact = _builtin(name="exact_match", column="answer")
    assert _score(exact, [" Paris\n", "paris", "Paris!"], answer="Paris") == [1.0, 0.0, 0.0]
    number = _builtin(name="number_match", column="answer")
    gsm8k = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert _score(number, ["48 + 24 = 72", "so 72.0 clips", "it is 1,234", "no idea", "72 then 73"],
                  answer=gsm8k) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert _score(number, ["1,234", "-3.5 and .5"], answer=1234) == [1.0, 0.0]
    assert _score(number, ["12"], answer="no number here") == [None]  # the reward does not apply
    regex = _builtin(name="regex", pattern=r"^<think>.*</think>")
    assert _score(regex, ["<think>hm</think> 4", "4"]) == [1.0, 0.0]
    length = _builtin(name="length", max_chars=10)
    assert _score(length, ["short", "x" * 15, "x" * 30]) == [1.0, 0.5, 0.0]
    chat = [[{"role": "assistant", "content": "Paris"}]]  # a conversational completion
    assert _score(exact, chat, answer="Paris") == [1.0]


# ------------------------------------------------------------------------------ your own rewards


def _config_with(tmp_path: Path, source: str, name: str, rows: list[dict] | None = None) -> tuple[RunConfig, Path]:
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(source))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows or [
        {"question": "What is 6 x 7?", "answer": 42, "source": "times tables"}]))
    (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f"""\
        model: {{base_model: tiny}}
        prompt: {{template: "Q: {{question}}\\nA:"}}
        data: {{path: rows.jsonl, val_fraction: 0}}
        trainer: {{method: grpo}}
        grpo:
          rewards:
            - {name}
            - {{name: number_match, column: answer, weight: 0.5}}
        """))
    return load_config(tmp_path / "grpo.yaml"), tmp_path / "grpo.yaml"


def test_a_trl_reward_function_gets_prompts_completions_ids_and_every_column(tmp_path: Path) -> None:
    """A function written for TRL (``**kwargs``) gets the prompts, the completions, their token ids and
    every other column, each a list with one value per completion; a column keeps its type."""
    config, path = _config_with(tmp_path, """
        seen = []
        def format_ok(completions, prompts, **kwargs):
            seen.append((prompts, completions, kwargs))
            return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
        """, "my_rewards.py:format_ok")
    splits = load_splits(config, path.parent)
    row = splits.train[0]
    rewards = rw.load_rewards(config, path.parent)
    scores = rw.score_group(rewards, "Q: What is 6 x 7?\nA:", [" 42", "forty-two"], reward_columns(row),
                            completion_ids=[[1, 2], [3]])
    assert scores.scores == {"format_ok": [1.0, 0.0], "number_match": [1.0, 0.0]}
    assert scores.totals == [1.5, 0.0]
    module = rewards[0].function.__globals__
    prompts, completions, kwargs = module["seen"][-1]
    assert prompts == ["Q: What is 6 x 7?\nA:"] * 2 and completions == [" 42", "forty-two"]
    assert kwargs["answer"] == [42, 42] and kwargs["source"] == ["times tables"] * 2
    assert kwargs["question"] == ["What is 6 x 7?"] * 2 and kwargs["completion_ids"] == [[1, 2], [3]]


def test_a_function_without_kwargs_gets_only_what_it_names(tmp_path: Path) -> None:
    config, path = _config_with(tmp_path, """
        def right(completions, answer):
            return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
        """, "my_rewards.py:right")
    rewards = rw.load_rewards(config, path.parent)
    row = load_splits(config, path.parent).train[0]
    assert rw.score_group(rewards, "p", ["42", "41"], reward_columns(row)).scores["right"] == [1.0, 0.0]


def test_reward_paths_resolve_against_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, path = _config_with(tmp_path, "def f(completions, **kw):\n    return [0.0] * len(completions)\n",
                                "my_rewards.py:f")
    monkeypatch.chdir("/")
    rw.resolve_paths(config, path.parent)
    assert config.grpo.rewards[0].name == f"{tmp_path / 'my_rewards.py'}:f"
    assert rw.load_rewards(config)[0].label == "f"  # from any directory now, as a run's saved config is read


@pytest.mark.parametrize(("body", "expected"), [
    ("return [1 / 0 for _ in completions]", "raised ZeroDivisionError: division by zero"),
    ("return [1.0]", "returned 1 values for 2 completions"),
    ("return [float('nan'), 1.0]", "returned nan for completion 1"),
    ("return ['good', 1.0]", "returned 'good' for completion 1"),
    ("return 3.0", "returned 3.0, not a list of 2 numbers"),
])
def test_a_failing_reward_is_one_line_naming_the_function_and_the_prompt(tmp_path: Path, body: str,
                                                                          expected: str) -> None:
    config, path = _config_with(tmp_path, f"def bad(completions, **kwargs):\n    {body}\n", "my_rewards.py:bad")
    rewards = rw.load_rewards(config, path.parent)
    with pytest.raises(rw.RewardFailed) as caught:
        rw.score_group(rewards, "Q: What is 6 x 7?\nA:", ["1", "2"], {"answer": 42})
    message = str(caught.value)
    assert "\n" not in message and message.startswith("reward bad (my_rewards.py:bad) ")
    assert expected in message and message.endswith("on the prompt 'Q: What is 6 x 7?⏎ A:'")


def test_a_reward_that_cannot_load_says_why(tmp_path: Path) -> None:
    for source, name, expected in (
        ("def f(completions, **kw): return []\n", "missing.py:f", "no file"),
        ("def f(completions, **kw): return []\n", "my_rewards.py:g", "no function 'g' there (functions: f)"),
        ("import not_a_module_anyone_has\n", "my_rewards.py:f", "importing"),
        ("def f(completions, *args): return []\n", "my_rewards.py:f", "takes *args"),
    ):
        config, path = _config_with(tmp_path, source, name)
        with pytest.raises(rw.RewardError) as caught:
            rw.load_rewards(config, path.parent)
        assert str(caught.value).startswith(f"grpo.rewards[0] ({name}): ") and expected in str(caught.value)


# ------------------------------------------------------------------------------------ data shapes


def test_conversational_prompts_keep_their_columns(tmp_path: Path) -> None:
    """TRL's conversational shape: a ``prompt`` column of messages whose last turn is the user's; a
    conversation that ends with the assistant prompts with the turns before it."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "6 x 7?"}],
         "answer": "42"},
        {"prompt": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}], "answer": "4"},
    ]))
    config = parse_config(f"data: {{path: {data}, val_fraction: 0}}\nprompt: {{template: chat}}\ntrainer: "
                          "{method: grpo}\ngrpo: {rewards: [{name: exact_match, column: answer}]}\n")
    rows = load_splits(config).train
    assert [m["role"] for m in conversation(rows[0])] == ["system", "user"]
    assert conversation(rows[1]) == [{"role": "user", "content": "2 + 2?"}]
    assert [reward_columns(r) for r in rows] == [{"answer": "42"}, {"answer": "4"}]
    config.prompt.template = "Q: {question}"
    with pytest.raises(ValueError, match="set prompt.template: chat"):
        load_splits(config)


def test_an_instruction_row_needs_only_the_prompts_fields(tmp_path: Path) -> None:
    config = load_config(sample_data_dir() / "grpo" / "grpo_config.yaml")
    config.data.path = str(sample_data_dir() / "grpo" / "copy_words.jsonl")
    splits = load_splits(config)
    assert splits.counts() == {"train": 720, "validation": 40, "test": 40}
    row = splits.train[0]
    assert set(reward_columns(row)) == {"instruction", "input", "word", "split"} and "output" not in row


# ---------------------------------------------------------------------------------- the console


def test_a_grpo_step_is_one_console_line_with_its_rewards_length_and_kl() -> None:
    """`studio train` and `studio attach` word a GRPO step's metrics into that step's line; the group
    gets no line; an evaluation gets its own."""
    from studio.core import events as ev
    from studio.core.runs.report import StepLines

    lines = StepLines()
    grpo = ev.GrpoStepLogged(step=3, rewards={"exact_match": 0.25, "format_ok": None}, reward=0.5, reward_std=0.2,
                             completion_length=41.5, truncated=0.125, kl=0.0123, completions=16, prompts=2)
    assert lines(grpo) is None and lines(ev.GrpoGroupSampled(step=3, prompt="p", completions=[])) is None
    line = lines(ev.StepLogged(step=3, total_steps=10, loss=0.01, learning_rate=1e-5))
    assert line == ("step 3/10  loss 0.0100  lr 1.00e-05  reward 0.500 (exact_match 0.250, format_ok --)  "
                    "spread 0.200  length 41.5  cut 12%  kl 0.0123")
    assert lines(ev.StepLogged(step=4, total_steps=10, loss=0.01, learning_rate=1e-5)) == \
        "step 4/10  loss 0.0100  lr 1.00e-05"  # an SFT step, or a GRPO step without its metrics
    held_out = ev.GrpoStepLogged(step=0, split="validation", rewards={"exact_match": 0.0}, reward=0.0,
                                 completion_length=9.0, prompts=16)
    assert lines(held_out) == ("grpo eval of the base model (step 0): reward 0.000 (exact_match 0.000)  "
                               "length 9.0 (16 prompts)")


# ---------------------------------------------------------------------------------- config check


def test_config_check_calls_every_reward_on_one_row_without_loading_torch(tmp_path: Path, python: str,
                                                                           studio_env: dict) -> None:
    sample = sample_data_dir() / "grpo" / "grpo_config.yaml"
    code = ("import sys; from studio.cli import main; code = main(['config', 'check', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(code)")
    done = subprocess.run([python, "-c", code, str(sample)], cwd=sample_data_dir().parent, env=studio_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rewards ok on one row: exact_match (weight 1), letters_right (weight 1)" in done.stdout

    config, path = _config_with(tmp_path, "def broken(completions, **kwargs):\n    return [len(c) / 0 for c in "
                                "completions]\n", "my_rewards.py:broken")
    done = run_studio("config", "check", str(path), cwd=tmp_path, env=studio_env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: reward broken (my_rewards.py:broken) raised ZeroDivisionError: division "
                                   "by zero on the prompt 'Q: What is 6 x 7?⏎ A:'")
