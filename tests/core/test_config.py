"""The config: Studio layout round-trips, Ludwig layout translates, bad keys name line and fix."""

from __future__ import annotations

import textwrap

import pytest
from helpers.cli import run_studio

from studio.cli import main as cli_main
from studio.core.config import ConfigError, RunConfig, load_config, parse_config

LUDWIG = textwrap.dedent(
    """\
    model_type: llm
    base_model: meta-llama/Llama-2-7b-hf
    quantization:
      bits: 4
    adapter:
      type: lora
      r: 8
      alpha: 16
      dropout: 0.1
    prompt:
      template: |
        ### Instruction: {instruction}
        ### Input: {input}
        ### Response:
    input_features:
      - name: instruction
        type: text
    output_features:
      - name: output
        type: text
    trainer:
      type: finetune
      learning_rate: 0.0001
      batch_size: 2
      gradient_accumulation_steps: 8
      epochs: 3
      enable_gradient_checkpointing: true
      learning_rate_scheduler:
        warmup_fraction: 0.01
    generation:
      max_new_tokens: 64
      temperature: 0.1
    preprocessing:
      global_max_sequence_length: 384
      sample_ratio: 0.5
    backend:
      type: local
    """
)


def test_defaults_round_trip_through_yaml():
    config = RunConfig()
    assert parse_config(config.to_yaml()) == config


def test_saved_config_loads_unchanged(tmp_path):
    config = RunConfig()
    config.trainer.learning_rate = 3e-4
    config.lora.target_modules = ["q_proj", "v_proj"]
    path = tmp_path / "run.yaml"
    config.save(path)
    assert load_config(path) == config


def test_ludwig_config_translates_every_key():
    config = parse_config(LUDWIG, "ludwig.yaml")
    assert config.model.base_model == "meta-llama/Llama-2-7b-hf"
    assert config.quantization.bits == 4
    assert (config.lora.r, config.lora.alpha, config.lora.dropout) == (8, 16, 0.1)
    assert config.prompt.template.startswith("### Instruction: {instruction}")
    assert config.prompt.response_field == "output"
    assert config.trainer.learning_rate == pytest.approx(1e-4)
    assert config.trainer.micro_batch_size == 2
    assert config.trainer.accumulation_steps() == 8
    assert config.trainer.epochs == 3
    assert config.trainer.gradient_checkpointing is True
    assert config.trainer.warmup_fraction == pytest.approx(0.01)
    assert config.generation.max_new_tokens == 64
    assert config.generation.temperature == pytest.approx(0.1)
    assert config.data.max_seq_length == 384
    assert config.data.sample_ratio == 0.5


def test_ludwig_without_quantization_means_full_precision():
    text = LUDWIG.replace("quantization:\n  bits: 4\n", "")
    assert parse_config(text).quantization.bits is None


def test_the_fast_path_settings_are_read_from_yaml():
    """trainer.fast_path: each part of the fast path a person may turn off, all on unless written."""
    config = parse_config("trainer:\n  fast_path:\n    cuda_graphs: false\n    host_offload: false\n")
    fast = config.trainer.fast_path
    assert (fast.kernels, fast.cuda_graphs, fast.host_offload) == (True, False, False)
    assert parse_config(config.to_yaml()).trainer.fast_path == fast
    assert RunConfig().trainer.fast_path.kernels and RunConfig().trainer.fast_path.cuda_graphs


def test_effective_batch_derives_accumulation():
    config = parse_config("trainer:\n  micro_batch_size: 4\n  effective_batch_size: 32\n")
    assert config.trainer.accumulation_steps() == 8


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer:\n  learnin_rate: 0.1\n", "x.yaml: line 2: unknown key 'trainer.learnin_rate': did you mean 'learning_rate'?"),
        ("lora:\n  r: 8\n  alpah: 16\n", "x.yaml: line 3: unknown key 'lora.alpah': did you mean 'alpha'?"),
        ("trainner:\n  epochs: 1\n", "x.yaml: line 1: unknown key 'trainner': did you mean 'trainer'?"),
        ("trainer:\n  fast_path:\n    graphs: false\n",
         "x.yaml: line 3: unknown key 'trainer.fast_path.graphs': did you mean 'cuda_graphs'?"),
        ("trainer:\n  fast_path:\n    kernels: maybe\n", "x.yaml: line 3: 'trainer.fast_path.kernels' should be"),
        ("trainer:\n  epochs: many\n", "x.yaml: line 2: 'trainer.epochs' should be a number, got 'many'"),
        ("trainer:\n  optimizer: sgd\n", "x.yaml: line 2: 'trainer.optimizer' is 'sgd'; choose one of adamw"),
        ("quantization:\n  bits: 3\n", "x.yaml: line 2: 'quantization.bits' is 3; choose one of 4, 8, null"),
        ("lora:\n  r: 0\n", "x.yaml: line 2: 'lora.r' must be greater than 0"),
        ("trainer: [1, 2]\n", "x.yaml: line 1: 'trainer' must be a mapping"),
        ("trainer:\n  epochs: 1\n bad indent: 2\n", "x.yaml: line 3: not valid YAML"),
    ],
)
def test_bad_config_names_line_key_and_fix(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "x.yaml")
    assert str(info.value).startswith(expected)


def test_ludwig_unknown_key_suggests_nearest():
    text = LUDWIG.replace("  learning_rate: 0.0001", "  learning_rat: 0.0001")
    with pytest.raises(ConfigError, match=r"line 23: unknown key 'trainer.learning_rat': did you mean 'learning_rate'\?"):
        parse_config(text, "x.yaml")


def test_missing_config_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_config_dump_prints_resolved_config(tmp_path, capsys):
    path = tmp_path / "ludwig.yaml"
    path.write_text(LUDWIG)
    assert cli_main(["config", "dump", str(path)]) == 0
    dumped = parse_config(capsys.readouterr().out)
    assert dumped == load_config(path)
    assert dumped.trainer.scheduler == "cosine"  # a default, filled in


def test_config_dump_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: 8\n")
    proc = run_studio("config", "dump", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "line 2: unknown key 'lora.rank'" in proc.stderr


def test_the_effective_batch_is_what_trains_and_counts_every_gpu() -> None:
    from studio.cli.estimate import batch_line

    config = RunConfig()
    t = config.trainer
    t.micro_batch_size, t.effective_batch_size = 5, 16  # 5 does not divide 16: accumulation rounds up to 4
    config.distributed.gpus = 2
    assert (t.accumulation_steps(), t.effective_batch(), t.effective_batch(2)) == (4, 20, 40)
    assert batch_line(config).startswith("effective batch 40 = micro-batch 5 x 4 accumulation x 2 GPUs")
