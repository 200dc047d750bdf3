"""A corpus of bad inputs (tests/bad_inputs/): each is refused by the real `studio` command line with
exit code 2 (1 for `studio estimate`), one line on stderr that names the file, the line or key, and what to do, no traceback,
and no file created or changed. A few good-but-unusual inputs (byte-order marks, PEFT key names)
must work.

Cases run through ``studio.cli.main`` in this process, so ``datasets`` is imported once; a handful
also run as real ``studio`` subprocesses to check the console script itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, TESTS
from helpers.cli import run_studio

from studio.cli import main as cli_main

CORPUS = TESTS / "bad_inputs"

# (argv, what the one line must contain). A `config dump` line must also name the config file; the
# other commands' first expected text is the file or folder at fault (the data file, the model folder).
CASES: list[tuple[list[str], list[str]]] = [
    # numbers out of range: the key and its line
    (["config", "dump", "neg_epochs.yaml"], ["line 2", "trainer.epochs", "greater than 0"]),
    (["config", "dump", "inf_epochs.yaml"], ["line 2", "trainer.epochs", "finite"]),
    (["config", "dump", "zero_accumulation.yaml"], ["line 2", "trainer.gradient_accumulation_steps"]),
    (["config", "dump", "neg_accumulation.yaml"], ["line 3", "trainer.gradient_accumulation_steps"]),
    (["config", "dump", "neg_effective_batch.yaml"], ["line 2", "trainer.effective_batch_size"]),
    (["config", "dump", "neg_eval_interval.yaml"], ["line 2", "trainer.eval_interval"]),
    (["config", "dump", "zero_log_interval.yaml"], ["line 2", "trainer.log_interval"]),
    (["config", "dump", "neg_checkpoint_interval.yaml"], ["line 2", "trainer.checkpoint_interval"]),
    (["config", "dump", "zero_keep_checkpoints.yaml"], ["line 2", "trainer.keep_checkpoints"]),
    (["config", "dump", "neg_temperature.yaml"], ["line 2", "generation.temperature"]),
    (["config", "dump", "top_p_over_one.yaml"], ["line 2", "generation.top_p", "(0, 1]"]),
    (["config", "dump", "zero_top_p.yaml"], ["line 2", "generation.top_p"]),
    (["config", "dump", "zero_max_new_tokens.yaml"], ["line 2", "generation.max_new_tokens"]),
    (["config", "dump", "zero_lr.yaml"], ["line 2", "trainer.learning_rate"]),
    (["config", "dump", "neg_lr.yaml"], ["line 2", "trainer.learning_rate"]),
    (["config", "dump", "nan_lr.yaml"], ["line 2", "trainer.learning_rate", "finite"]),
    (["config", "dump", "huge_lr.yaml"], ["line 2", "trainer.learning_rate", "typical"]),
    (["config", "dump", "zero_max_steps.yaml"], ["line 2", "trainer.max_steps"]),
    (["config", "dump", "zero_micro_batch.yaml"], ["line 2", "trainer.micro_batch_size"]),
    (["config", "dump", "tiny_max_seq_length.yaml"], ["line 2", "data.max_seq_length"]),
    (["config", "dump", "val_fraction_over_one.yaml"], ["line 2", "data.val_fraction"]),
    (["config", "dump", "neg_test_fraction.yaml"], ["line 3", "data.test_fraction"]),
    (["config", "dump", "fractions_sum_one.yaml"], ["line 2", "val_fraction", "test_fraction"]),
    (["config", "dump", "zero_sample_ratio.yaml"], ["line 2", "data.sample_ratio"]),
    (["config", "dump", "dropout_one.yaml"], ["line 2", "lora.dropout"]),
    (["config", "dump", "neg_rank.yaml"], ["line 2", "lora.r"]),
    (["config", "dump", "warmup_over_one.yaml"], ["line 2", "trainer.warmup_fraction"]),
    (["config", "dump", "neg_weight_decay.yaml"], ["line 2", "trainer.weight_decay"]),
    (["config", "dump", "neg_seed.yaml"], ["line 2", "trainer.seed"]),
    (["config", "dump", "bits_three.yaml"], ["line 2", "quantization.bits", "choose one of"]),
    (["config", "dump", "optimizer_sgd.yaml"], ["line 2", "trainer.optimizer", "paged_adamw"]),
    (["config", "dump", "on_cpu_maybe.yaml"], ["line 2", "quantization.on_cpu", "keep"]),
    # names and shapes
    (["config", "dump", "full_ft_4bit.yaml"], ["line 4", "'quantization.bits'", "quantization.bits: null"]),
    (["config", "dump", "alias_and_key.yaml"], ["line 3", "lora.lora_alpha", "lora.alpha", "keep one"]),
    (["config", "dump", "response_field_spaces.yaml"], ["line 2", "prompt.response_field", "data.columns"]),
    (["config", "dump", "empty_base_model.yaml"], ["line 2", "model.base_model", "empty"]),
    (["config", "dump", "columns_bad_field.yaml"], ["line 3", "data.columns"]),
    # YAML that must not hang, run code or be read half-way
    (["config", "dump", "billion_laughs.yaml"], ["line ", "aliases", "write the values out"]),
    (["config", "dump", "alias_loop.yaml"], ["line ", "alias refers to the value that contains it"]),
    (["config", "dump", "deep_nesting.yaml"], ["line 2", "nests more than 50 levels"]),
    (["config", "dump", "duplicate_section.yaml"], ["line 5", "'trainer' appears twice"]),
    (["config", "dump", "python_tag.yaml"], ["line 2", "plain values"]),
    (["config", "dump", "tab_indent.yaml"], ["line 2", "not valid YAML"]),
    (["config", "dump", "top_level_list.yaml"], ["mapping of keys to values"]),
    (["config", "dump", "latin1_config.yaml"], ["line 3", "not UTF-8", "save the file as UTF-8"]),
    (["config", "dump", "no_such_config.yaml"], ["no such config file"]),
    # templates
    (["config", "dump", "template_unclosed.yaml"], ["line 2", "prompt.template", "never closed", "{instruction}"]),
    (["config", "dump", "template_stray_close.yaml"], ["line 2", "prompt.template", "closes nothing"]),
    (["config", "dump", "template_spaced.yaml"], ["line 2", "prompt.template", "write {instruction}"]),
    (["config", "check", "template_unknown_field.yaml"], ["good.jsonl", "'question'", "data.columns"]),
    # data files: the data file, its line, what to do
    (["config", "check", "data_latin1_csv.yaml"], ["latin1.csv", "line 3", "not UTF-8", "save the file as UTF-8"]),
    (["config", "check", "data_latin1_jsonl.yaml"], ["latin1.jsonl", "line 2", "not UTF-8", "UTF-8"]),
    (["config", "check", "data_utf16_csv.yaml"], ["utf16.csv", "UTF-16", "save it as UTF-8"]),
    (["config", "check", "data_rows_are_arrays_jsonl.yaml"], ["rows_are_arrays.jsonl", "line 1", "JSON array",
                                                              "object per line"]),
    (["config", "check", "data_rows_are_strings_jsonl.yaml"], ["rows_are_strings.jsonl", "line 2", "JSON string"]),
    (["config", "check", "data_broken_line_jsonl.yaml"], ["broken_line.jsonl", "line 3", "not valid JSON"]),
    (["config", "check", "data_duplicate_header_csv.yaml"], ["duplicate_header.csv", "line 1", "'output' appears twice"]),
    (["config", "check", "data_blank_header_csv.yaml"], ["blank_header.csv", "line 1, column 2", "no name"]),
    (["config", "check", "data_empty_csv.yaml"], ["empty.csv", "empty"]),
    (["config", "check", "data_no_output_column_csv.yaml"], ["no_output_column.csv", "'output'",
                                                             "data.columns: {output: answer}"]),
    (["config", "check", "data_bad_split_jsonl.yaml"], ["bad_split.jsonl", "row 1", "'holdout'"]),
    (["config", "check", "data_rows_xlsx.yaml"], ["rows.xlsx", "unsupported file type"]),
    (["config", "check", "data_ragged_csv.yaml"], ["ragged.csv", "line 3 has 5 fields, the header has 3", "quotes"]),
    (["config", "check", "data_binary_jsonl.yaml"], ["binary.jsonl", "binary data"]),
    (["config", "check", "data_missing_jsonl.yaml"], ["missing.jsonl", "no such file", "data.path"]),
    # models and folders
    (["estimate", "missing_model.yaml"], ["./models/not-downloaded-yet", "no such model folder", "model.base_model"]),
    (["train", "output_under_file.yaml"], ["blocker", "is a file", "output_dir"]),
    # command-line numbers
    (["train", "neg_epochs.yaml", "--max-steps", "0"], ["--max-steps", "'0'", "1 or more"]),
    (["train", "neg_epochs.yaml", "--max-steps", "-3"], ["--max-steps", "'-3'"]),
    (["estimate", "missing_model.yaml", "--gpu-gb", "nan"], ["--gpu-gb", "'nan'"]),
    (["estimate", "missing_model.yaml", "--gpu-gb", "-24"], ["--gpu-gb", "'-24'"]),
    (["estimate", "missing_model.yaml", "--gpu-gb", "lots"], ["--gpu-gb", "not a number"]),
    (["eval", "--rows", "0"], ["--rows", "'0'"]),
]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with a hash of its content (folders: "dir")."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the corpus as the working directory (runs would go to ./runs)."""
    folder = tmp_path / "corpus"
    shutil.copytree(CORPUS, folder)
    monkeypatch.chdir(folder)
    return folder


def test_the_corpus_has_at_least_forty_bad_inputs():
    assert len(CASES) >= 40
    assert len({tuple(argv) for argv, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_naming_the_cause_and_changes_nothing(corpus, capsys, argv, expected):
    before = _snapshot(corpus)
    try:
        code = cli_main(argv)
    except SystemExit as exc:  # argparse's own errors (a flag's value) exit from inside parse_args
        code = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    flag_error = any(a.startswith("--") for a in argv)
    # `studio estimate` has always answered a config it cannot use with 1; usage errors are 2.
    assert code == (1 if argv[0] == "estimate" and not flag_error else 2), (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    if argv[:2] == ["config", "dump"]:
        assert lines[0].startswith(f"error: {argv[2]}"), lines[0]
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert out == ""
    assert _snapshot(corpus) == before


@pytest.mark.parametrize("name", ["data_bom_csv.yaml", "data_bom_jsonl.yaml"])
def test_a_byte_order_mark_in_data_is_not_part_of_the_first_column(corpus, capsys, name):
    assert cli_main(["config", "check", name]) == 0
    out = capsys.readouterr().out
    assert "3 training" in out or "2 training" in out
    assert "instruction, input, output" in out


# Several mistakes in one config: each is its own line (file, line, key), all in one run.
MANY_MISTAKES = {
    "four_mistakes.yaml": [["line 2", "'quantization.bits' is 3", "choose one of"],
                           ["line 4", "'trainer.learning_rate'", "it is -1.0"],
                           ["line 5", "'trainer.micro_batch_size'", "it is 0"],
                           ["line 6", "unknown key 'trainer.epocs'", "did you mean 'epochs'"]],
    # issue 41's Ludwig config: bits 3, learning rate -1, batch size 0 and no adapter
    "ludwig_four_mistakes.yaml": [["line 3", "without 'adapter'", "add 'adapter: {type: lora}'"],
                                  ["line 4", "'quantization.bits' is 3"],
                                  ["line 7", "'trainer.learning_rate'", "it is -1.0"],
                                  ["line 8", "it is 0", "'trainer.batch_size'"]],
}


@pytest.mark.parametrize("command", ["config dump", "config check", "train"])
@pytest.mark.parametrize("name", sorted(MANY_MISTAKES))
def test_every_mistake_in_a_config_is_its_own_line_in_one_run(corpus, capsys, command, name):
    before = _snapshot(corpus)
    assert cli_main([*command.split(), name]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    expected = MANY_MISTAKES[name]
    assert len(lines) == len(expected), err
    for line, texts in zip(lines, expected, strict=True):
        assert line.startswith(f"error: {name}: line "), line
        for text in texts:
            assert text in line, (text, line)
    assert out == ""
    assert _snapshot(corpus) == before


def test_a_byte_order_mark_in_a_config_is_accepted(corpus, capsys):
    assert cli_main(["config", "dump", "bom_config.yaml"]) == 0
    assert "epochs: 2.0" in capsys.readouterr().out


def _studio(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # This checkout first; the caller's PYTHONPATH kept (on the GPU box the packages travel on it).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return run_studio(*args, cwd=cwd, env=env, timeout=60)


def test_peft_and_transformers_names_are_read_as_studio_keys_with_a_note(corpus):
    result = _studio(["config", "dump", "peft_names.yaml"], corpus)
    assert result.returncode == 0, result.stderr
    notes = result.stderr.strip().splitlines()
    assert "note: peft_names.yaml: line 1: 'lora_alpha' is read as Studio's 'lora.alpha'" in notes
    assert "note: peft_names.yaml: line 5: 'lora.lora_dropout' is read as Studio's 'lora.dropout'" in notes
    assert any("line 3" in n and "trainer.epochs" in n for n in notes)
    dumped = result.stdout
    assert "  alpha: 64\n" in dumped and "  dropout: 0.1\n" in dumped
    assert "  micro_batch_size: 2\n" in dumped and "  epochs: 3.0\n" in dumped
    assert "  scheduler: constant\n" in dumped and "  warmup_fraction: 0.1\n" in dumped
    assert "lora_alpha" not in dumped and "num_train_epochs" not in dumped


@pytest.mark.parametrize("argv", [["config", "dump", "billion_laughs.yaml"], ["train", "x.yaml", "--max-steps", "0"],
                                  ["config", "check", "data_latin1_jsonl.yaml"]])
def test_the_console_script_answers_in_one_line(corpus, argv):
    before = _snapshot(corpus)
    result = _studio(argv, corpus)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert _snapshot(corpus) == before


def test_a_template_edited_in_memory_is_checked_when_the_data_is_split(corpus):
    """The TUI edits app.config without parsing YAML: the split (train time) still refuses a brace
    that is no placeholder instead of dropping the field from every example."""
    from studio.core.config import RunConfig
    from studio.core.data import DataError, load_splits

    config = RunConfig()
    config.data.path = "good.jsonl"
    config.prompt.template = "Q: {instruction\nA: {output}"
    with pytest.raises(DataError, match=r"prompt.template: the placeholder '\{instruction' .* never closed"):
        load_splits(config)


def test_nesting_deep_enough_to_overflow_libyaml_is_refused_not_a_crash(tmp_path):
    """Unchecked, libyaml's recursive composer overflows the C stack on this: a segfault."""
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 200_000 + "]" * 200_000 + "\n")
    result = _studio(["config", "dump", "deep.yaml"], tmp_path)
    assert result.returncode == 2, result.stderr[-500:]
    assert result.stderr.strip() == "error: deep.yaml: line 1: the YAML nests more than 50 levels deep here; a config needs a few"


def test_a_dataset_given_as_the_config_is_refused_unread(corpus, capsys):
    (corpus / "reverse.jsonl").write_text('{"instruction": "reverse abc", "output": "cba"}\n' * 30_000)
    assert cli_main(["config", "dump", "reverse.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: reverse.jsonl: the file is 1.4 MB, and a config is a few KB")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need a POSIX system")
@pytest.mark.parametrize("what", ["config", "data"])
def test_a_named_pipe_is_refused_instead_of_blocking_the_read(corpus, capsys, what):
    os.mkfifo(corpus / "pipe.yaml" if what == "config" else corpus / "pipe.jsonl")
    if what == "data":
        (corpus / "pipe_data.yaml").write_text("data:\n  path: pipe.jsonl\n")
    code = cli_main(["config", "check", "pipe.yaml" if what == "config" else "pipe_data.yaml"])
    assert code == 2
    assert "not a regular file" in capsys.readouterr().err
