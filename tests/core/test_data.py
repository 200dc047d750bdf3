"""core/data/__init__.py: loading every format, the errors a person reads, splits, statistics, lint, browsing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studio.core import data
from studio.core.config import RunConfig, default_config
from studio.core.data import DataError, Table, column_stats, lint_rows, load_splits, load_table
from studio.core.data import load as dataload
from studio.core.paths import sample_data_dir

ROWS = [
    {"instruction": "Add the numbers", "input": "1 2", "output": "3"},
    {"instruction": "Reverse the word", "input": "abc", "output": "cba"},
    {"instruction": "Say hi", "input": "", "output": "hi"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_for(path: Path | str, **data_fields) -> RunConfig:
    config = RunConfig()
    config.data.path = str(path)
    for key, value in data_fields.items():
        setattr(config.data, key, value)
    return config


# ------------------------------------------------------------------------------------- loading


def test_importing_data_keeps_torch_and_datasets_out(tmp_path):
    """The UI imports core.data while painting: no torch ever, and datasets only once data is loaded."""
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    code = (
        "import sys, studio.core.data as d, studio.core.prompt, studio.core.prompt.tokens\n"
        "assert 'torch' not in sys.modules and 'datasets' not in sys.modules, 'imported at import time'\n"
        f"t = d.Table.open({str(path)!r}); d.lint_rows(t); d.column_stats(t); d.search(t, 'hi')\n"
        "assert 'torch' not in sys.modules, 'loading data imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _save_formats(tmp_path: Path) -> dict[str, Path]:
    import datasets
    import pandas as pd

    frame = pd.DataFrame(ROWS)
    paths = {
        "jsonl": write_jsonl(tmp_path / "rows.jsonl", ROWS),
        "csv": tmp_path / "rows.csv",
        "json-array": tmp_path / "array.json",
        "json-records-under-key": tmp_path / "keyed.json",
        "json-columns": tmp_path / "columns.json",
        "parquet": tmp_path / "rows.parquet",
        "saved": tmp_path / "saved",
    }
    frame.to_csv(paths["csv"], index=False)
    paths["json-array"].write_text(json.dumps(ROWS, indent=2))
    paths["json-records-under-key"].write_text(json.dumps({"data": ROWS}))
    paths["json-columns"].write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))
    frame.to_parquet(paths["parquet"])
    datasets.Dataset.from_list(ROWS).save_to_disk(str(paths["saved"]))
    return paths


@pytest.mark.parametrize("kind", ["jsonl", "csv", "json-array", "json-records-under-key", "json-columns",
                                  "parquet", "saved"])
def test_every_format_loads_the_same_rows(tmp_path, kind):
    path = _save_formats(tmp_path)[kind]
    table = load_table(path)
    got = [{k: ("" if r[k] is None else str(r[k])) for k in ("instruction", "input", "output")}
           for r in data.rows(table, 0, 10)]
    assert got == ROWS


def test_csv_values_stay_text_exactly_as_written(tmp_path):
    path = tmp_path / "numbers.csv"
    path.write_text('instruction,input,output,split\nPad it,,007,0\nSay NA,NA,"1.50, then 2",1\n')
    splits = load_splits(config_for(path))
    assert splits.train == [{"instruction": "Pad it", "input": "", "output": "007"}]
    assert splits.validation == [{"instruction": "Say NA", "input": "NA", "output": "1.50, then 2"}]


def test_csv_with_a_repeated_column_name(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("instruction,output,output\na,b,c\n")
    with pytest.raises(DataError) as err:
        load_table(path)
    assert str(err.value) == f"{path}: line 1: column 'output' appears twice in the header; rename one"


def test_saved_dataset_dict_keeps_its_splits(tmp_path):
    import datasets

    saved = datasets.DatasetDict({
        "train": datasets.Dataset.from_list(ROWS[:2]), "test": datasets.Dataset.from_list(ROWS[2:]),
    })
    saved.save_to_disk(str(tmp_path / "dd"))
    splits = load_splits(config_for(tmp_path / "dd"))
    assert [r["output"] for r in splits.train] == ["3", "cba"]
    assert [r["output"] for r in splits.test] == ["hi"]


def test_relative_path_resolves_from_cwd_then_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    write_jsonl(folder / "rows.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="rows.jsonl: no such file"):
        load_table("rows.jsonl")
    assert len(load_table("rows.jsonl", base_dir=folder)) == 3
    # A file of that name in the working directory wins over the config's folder.
    write_jsonl(tmp_path / "rows.jsonl", ROWS[:1])
    assert len(load_table("rows.jsonl", base_dir=folder)) == 1
    # A config in configs/ may name configs/rows.jsonl as seen from the project root.
    monkeypatch.chdir(folder)
    assert data.resolve_path("configs/rows.jsonl", folder) == tmp_path / "configs" / "rows.jsonl"


def test_hub_ids_go_to_the_hub_and_fail_with_a_readable_error(monkeypatch):
    import datasets

    asked = {}

    def fake_load_dataset(name, split):
        asked.update(name=name, split=split)
        raise ConnectionError("Couldn't reach the Hub\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(dataload, "_hub_reachable", lambda: True)
    with pytest.raises(DataError) as err:
        load_table("someone/code_alpaca", hub_split="validation")
    assert asked == {"name": "someone/code_alpaca", "split": "validation"}
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("someone/code_alpaca:") and "hub" in message and "Couldn't reach" in message


def test_without_network_a_hub_id_fails_at_once_and_a_bare_name_is_a_missing_file(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(dataload, "_hub_reachable", lambda: False)
    with pytest.raises(DataError, match=r"^someone/code_alpaca: not a local file, and the Hugging Face hub "
                                        "cannot be reached"):
        load_table("someone/code_alpaca")
    with pytest.raises(DataError, match=r"^mydata: no such file"):
        load_table("mydata")


# ------------------------------------------------------------------------------- bad input errors


def assert_one_line(err: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    for part in parts:
        assert part in message, message
    return message


def test_missing_file_names_the_path_and_what_to_check(tmp_path):
    with pytest.raises(DataError) as err:
        load_table(tmp_path / "nope.jsonl")
    assert_one_line(err, str(tmp_path / "nope.jsonl"), "no such file", "data.path")


def test_binary_garbage_named_csv_is_unreadable(tmp_path):
    path = tmp_path / "garbage.csv"
    path.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "not a text CSV")


def test_non_utf8_csv_names_the_byte(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("instruction,output\ncaf\xe9,ok\n".encode("latin-1"))
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "line 2 is not UTF-8 text (byte 0xe9)", "save the file as UTF-8")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads files regardless of mode")
def test_unreadable_file_says_check_permissions(tmp_path):
    path = write_jsonl(tmp_path / "locked.jsonl", ROWS)
    path.chmod(0)
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "permission")


def test_permission_error_says_check_permissions(tmp_path, monkeypatch):
    """The same message as above, for runs as root, where file modes do not stop reads."""
    path = write_jsonl(tmp_path / "locked.jsonl", ROWS)
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "Permission denied", "check its permissions")


def test_mixed_type_values_become_their_text(tmp_path):
    rows = [{"instruction": "a", "input": "", "output": 1}, {"instruction": "b", "input": "", "output": "two"},
            {"instruction": "c", "input": "", "output": 2.5}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    splits = load_splits(config_for(path, val_fraction=0.0))
    assert [r["output"] for r in splits.train] == ["1", "two", "2.5"]
    assert [r["output"] for r in Table.open(path).rows(0, 3)] == [1, "two", 2.5]


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(2, '{"instruction": "oops", "output": "x"')  # line 3: unterminated object
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "line 3 ", "not valid JSON", "fix or delete")


def test_malformed_json_array_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c" "output": "d"}\n]\n')
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "line 3 column 23")


def test_missing_column_lists_columns_and_suggests_a_mapping(tmp_path):
    rows = [{"prompt": r["instruction"], "input": r["input"], "output": r["output"]} for r in ROWS]
    path = write_jsonl(tmp_path / "renamed.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_splits(config_for(path))
    assert_one_line(err, str(path), "'instruction'", "columns: prompt, input, output",
                    "data.columns: {instruction: prompt}")
    # The suggested mapping works.
    splits = load_splits(config_for(path, columns={"instruction": "prompt"}, val_fraction=0.0))
    assert [r["instruction"] for r in splits.train] == [r["instruction"] for r in ROWS]


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("header.csv", "a,b\n")])
def test_empty_dataset(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DataError) as err:
        load_table(path)
    message = assert_one_line(err, str(path))
    assert "empty" in message or "no rows" in message


def test_unsupported_extension_lists_the_supported_ones(tmp_path):
    path = tmp_path / "rows.xml"
    path.write_text("<rows/>\n")
    with pytest.raises(DataError) as err:
        load_table(path)
    assert_one_line(err, str(path), "'.xml'", ".jsonl", ".parquet", ".txt", "save_to_disk")


def test_bad_split_value_names_row_and_column(tmp_path):
    rows = [{**r, "split": s} for r, s in zip(ROWS, [0, 7, 1], strict=True)]
    path = write_jsonl(tmp_path / "split.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_splits(config_for(path))
    assert_one_line(err, "row 1", "column 'split'", "0/1/2")


# -------------------------------------------------------------------------------------- splits


def _many(n: int) -> list[dict]:
    return [{"instruction": f"task {i}", "input": "", "output": f"answer {i}"} for i in range(n)]


def test_split_column_decides_the_splits(tmp_path):
    rows = [{**r, "split": s} for r, s in zip(_many(6), [0, 2, 1, 0, 0, 2], strict=True)]
    splits = load_splits(config_for(write_jsonl(tmp_path / "s.jsonl", rows)))
    assert [r["instruction"] for r in splits.train] == ["task 0", "task 3", "task 4"]
    assert [r["instruction"] for r in splits.validation] == ["task 2"]
    assert [r["instruction"] for r in splits.test] == ["task 1", "task 5"]
    assert set(splits.train[0]) == {"instruction", "input", "output"}  # template fields only


def test_fraction_split_is_seeded_disjoint_and_sized(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", _many(200))
    config = config_for(path, val_fraction=0.1, test_fraction=0.05)
    first, again = load_splits(config), load_splits(config)
    assert first.counts() == {"train": 170, "validation": 20, "test": 10}
    assert first.indices == again.indices
    everything = first.indices["train"] + first.indices["validation"] + first.indices["test"]
    assert sorted(everything) == list(range(200))
    config.trainer.seed += 1
    assert load_splits(config).indices["validation"] != first.indices["validation"]


def test_sample_ratio_thins_only_the_training_rows(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", _many(200))
    full = load_splits(config_for(path))
    half = load_splits(config_for(path, sample_ratio=0.5))
    assert len(half.train) == len(full.train) // 2
    assert set(half.indices["train"]) <= set(full.indices["train"])
    assert half.validation == full.validation


def test_alpaca_data_without_input_column_renders_empty_input(tmp_path):
    rows = [{"instruction": r["instruction"], "output": r["output"]} for r in ROWS]
    splits = load_splits(config_for(write_jsonl(tmp_path / "noinput.jsonl", rows), val_fraction=0.0))
    assert [r["input"] for r in splits.train] == ["", "", ""]


def test_literal_template_needs_its_fields(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    config = config_for(path)
    config.prompt.template = "Q: {question}\nA: {output}"
    with pytest.raises(DataError, match="no column 'question' for the template field 'question'"):
        load_splits(config)
    config.data.columns = {"question": "instruction"}
    config.data.val_fraction = 0.0
    assert load_splits(config).train[0] == {"question": "Add the numbers", "output": "3"}


# ---------------------------------------------------------------------------------- statistics


def test_column_stats_chars_tokens_and_histogram():
    rows = [{"output": "a" * n} for n in (1, 2, 3, 4, 10)] + [{"output": "   "}]
    stats = column_stats(rows, ["output"], tokenize=lambda text: text.split("a")[1:], bins=4)["output"]
    assert (stats.chars.min, stats.chars.max, stats.chars.count) == (1, 10, 6)
    assert stats.chars.mean == pytest.approx(23 / 6)
    assert stats.chars.p50 == 3.0
    assert stats.empty == 1
    assert sum(stats.chars.counts) == 6
    assert len(stats.chars.edges) == len(stats.chars.counts) + 1
    # Buckets are [1,4), [4,7), [7,10), [10,13): integer widths.
    assert stats.chars.edges == [1, 4, 7, 10, 13]
    assert stats.chars.counts == [4, 1, 0, 1]
    assert stats.tokens.max == 10 and stats.tokens.min == 0


def test_column_stats_on_a_table_with_a_real_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    table = Table.open(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    seen = []
    stats = column_stats(table, tokenize=tokenizer, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(3, 9), (6, 9), (9, 9)]  # three columns of three rows
    assert set(stats) == {"instruction", "input", "output"}
    assert stats["instruction"].tokens.max == 3  # "Add the numbers", "Reverse the word"
    assert stats["input"].empty == 1


# ---------------------------------------------------------------------------------------- lint


def planted_rows() -> list[dict]:
    rows = _many(20)
    rows[3] = {"instruction": "Sort the list", "input": "[3, 1]", "output": "[1, 3]"}
    rows[11] = {"instruction": "  sort THE list ", "input": "[3,  1]", "output": "[3, 1]"}  # differs
    rows[15] = {"instruction": "Sort the list", "input": "[3, 1]", "output": "[1, 3] "}  # same answer
    rows[7] = {"instruction": "Say nothing", "input": "", "output": "  "}
    rows[8] = {"instruction": "Copy", "input": "", "output": "x"}
    rows[9] = {"instruction": "copy", "input": "", "output": "x"}  # duplicate, same answer: fine
    return rows


def test_lint_finds_planted_duplicates_and_empty_outputs():
    issues = lint_rows(planted_rows())
    kinds = sorted((i.kind, i.row) for i in issues)
    assert kinds == [("duplicate_prompt", 3), ("empty_output", 7)]
    duplicate = next(i for i in issues if i.kind == "duplicate_prompt")
    assert duplicate.related_rows == (3, 11, 15)
    assert "rows 3, 11, 15" in duplicate.message and "2 different answers" in duplicate.message
    assert "row 7" in next(i for i in issues if i.kind == "empty_output").message


def test_lint_on_a_table_with_mapped_columns(tmp_path):
    renamed = [{"q": r["instruction"], "input": r["input"], "a": r["output"]} for r in planted_rows()]
    table = Table.open(write_jsonl(tmp_path / "r.jsonl", renamed))
    issues = lint_rows(table, columns={"instruction": "q", "output": "a"})
    assert sorted((i.kind, i.row) for i in issues) == [("duplicate_prompt", 3), ("empty_output", 7)]


def test_lint_flags_rows_over_max_length_after_rendering():
    rows = [{"instruction": "w " * n, "input": "", "output": "ok"} for n in (5, 50, 8)]
    words = str.split  # one token a word
    template = "### Instruction:\n{instruction}\n### Response:\n{output}"  # 4 template words + "ok"
    # Row 1: 4 + 50 + 1 words + EOS = 56.
    issues = lint_rows(rows, tokenize=words, max_seq_length=14, template=template)
    assert [(i.kind, i.row) for i in issues] == [("too_long", 1)]
    assert "56 tokens" in issues[0].message and "max_seq_length 14" in issues[0].message
    # 8 words + 5 + EOS = 14 fits exactly; without the EOS a 13-token limit still fits it.
    assert [i.row for i in lint_rows(rows, tokenize=words, max_seq_length=13, template=template,
                                     add_eos=False)] == [1]


def test_lint_is_fast_on_100k_rows():
    rows = [{"instruction": f"task number {i % 90_000}", "input": "", "output": f"answer {i}"}
            for i in range(100_000)]
    start = time.perf_counter()
    issues = lint_rows(rows)
    elapsed = time.perf_counter() - start
    assert len(issues) == 10_000  # tasks 0..9999 appear twice with different answers
    assert elapsed < 3.0, f"lint took {elapsed:.2f}s"


# ------------------------------------------------------------------------------------ browsing


def test_table_pages_and_searches(tmp_path):
    table = Table.open(write_jsonl(tmp_path / "rows.jsonl", _many(1000)))
    assert len(table) == data.row_count(table.dataset) == 1000
    assert [r["instruction"] for r in table.rows(998, 1005)] == ["task 998", "task 999"]
    assert table.row(500)["output"] == "answer 500"
    assert table.search("TASK 99") == [99] + list(range(990, 1000))
    assert table.search("answer 5", columns=["instruction"]) == []
    assert table.search("task", limit=3) == [0, 1, 2]


# --------------------------------------------------------------------------------- sample data


def _generator():
    spec = importlib.util.spec_from_file_location("make_sample_data", sample_data_dir() / "make_sample_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_sample_data_is_what_the_generator_makes_and_answers_pass_their_checks():
    generator = _generator()
    path = sample_data_dir() / "code_alpaca_sample.jsonl"
    committed = [json.loads(line) for line in path.read_text().splitlines()]
    assert committed == generator.make_rows()
    assert 300 <= len(committed) <= 500
    picked = committed[:: len(committed) // 12]
    assert {bool(r["input"]) for r in picked} == {True, False}  # both kinds of rows re-checked
    for row in picked:
        generator.check_row(row)
    broken = dict(picked[0], output=picked[0]["output"].replace("return", "return 1 +", 1))
    with pytest.raises(AssertionError):
        generator.check_row(broken)


def test_default_config_trains_on_the_sample_data_with_a_clean_lint():
    config = default_config()
    splits = load_splits(config)
    counts = splits.counts()
    total = sum(counts.values())
    assert counts["train"] / total == pytest.approx(0.8, abs=0.03)
    assert counts["validation"] / total == pytest.approx(0.1, abs=0.03)
    assert lint_rows(splits.train + splits.validation + splits.test) == []


def test_a_template_that_drops_a_column_or_ignores_the_conversations_is_linted(tmp_path, capsys) -> None:
    """alpaca_no_input on rows with an input never shows the input: `studio config check` says so; a
    column empty everywhere, the split column and a template on conversations are judged too."""
    from studio.cli import main as studio
    from studio.core.config import load_config
    from studio.core.data.stats import filled_counts, template_column_issues

    path = sample_data_dir() / "sample_config.yaml"
    config = load_config(path)
    table = load_table(sample_data_dir() / "code_alpaca_sample.jsonl")
    filled = filled_counts(table)
    assert template_column_issues(config, table.column_names, filled=filled) == []
    config.prompt.template = "alpaca_no_input"
    (issue,) = template_column_issues(config, table.column_names, filled=filled)
    with_input = sum(1 for value in table["input"] if value.strip())
    assert issue.kind == "unused_column" and issue.severity == "warning"
    assert issue.message == (f"column input is in no placeholder: the model never sees it ({with_input:,} rows "
                             "have text); the alpaca preset shows {input} when a row has one")
    assert template_column_issues(config, table.column_names, filled={**filled, "input": 0}) == []
    config.prompt.template = "### Q: {instruction}\n### A: {output}"
    assert "add {input} to the template" in template_column_issues(config, table.column_names)[0].message
    config.prompt.template = "alpaca"
    (issue,) = template_column_issues(config, ["messages", "split"], conversations=True)
    assert issue.severity == "error" and "{output}" in issue.message and "prompt.template: chat" in issue.message
    config.prompt.template = "chat"
    assert [i.severity for i in template_column_issues(config, ["messages", "split"], conversations=True)] == ["info"]

    config.prompt.template = "alpaca_no_input"
    config.data.path = str(sample_data_dir() / "code_alpaca_sample.jsonl")
    config.save(tmp_path / "no_input.yaml")
    assert studio(["config", "check", str(tmp_path / "no_input.yaml")]) == 0
    out = capsys.readouterr().out
    assert "warning: " in out and "prompt.template: column input is in no placeholder" in out and "ok:" in out


def test_sample_config_names_its_command_and_finds_its_data_from_anywhere(tmp_path, monkeypatch):
    from studio.core.config import load_config

    path = sample_data_dir() / "sample_config.yaml"
    assert path.read_text().splitlines()[0] == "# studio train sample_data/sample_config.yaml"
    config = load_config(path)
    assert config.model.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (config.quantization.bits, config.quantization.quant_type, config.lora.r) == (4, "nf4", 16)
    monkeypatch.chdir(tmp_path)
    sampled = load_splits(config, base_dir=path.parent).counts()["train"]
    config.data.sample_ratio = 1.0  # the whole training split; the sample config trains a fifth of it
    whole = load_splits(config, base_dir=path.parent).counts()["train"]
    assert whole > 250
    assert sampled == round(whole * 0.2)
