"""Other tools' names: PEFT / transformers keys as aliases, Ludwig's saved configs, defaults and sections."""

from __future__ import annotations

import textwrap
import warnings

import pytest

from studio.core.config import ConfigError, ConfigNote, parse_config


def _parse(text: str, source: str = "x.yaml"):
    """The config and the notes it produced."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(textwrap.dedent(text), source)
    return config, [str(w.message) for w in caught if issubclass(w.category, ConfigNote)]


def test_peft_names_inside_their_sections_are_read_with_a_note():
    config, notes = _parse("""\
        lora:
          r: 8
          lora_alpha: 16
          lora_dropout: 0.1
        trainer:
          per_device_train_batch_size: 2
          num_train_epochs: 2
          warmup_ratio: 0.05
          lr_scheduler_type: linear
          optim: adamw_bnb_8bit
        """)
    assert (config.lora.alpha, config.lora.dropout) == (16, 0.1)
    assert (config.trainer.micro_batch_size, config.trainer.epochs) == (2, 2.0)
    assert (config.trainer.warmup_fraction, config.trainer.scheduler) == (0.05, "linear")
    assert config.trainer.optimizer == "adamw_8bit"
    assert "x.yaml: line 3: 'lora.lora_alpha' is read as Studio's 'lora.alpha'" in notes
    assert "x.yaml: line 6: 'trainer.per_device_train_batch_size' is read as Studio's 'trainer.micro_batch_size'" in notes
    assert any("line 10" in n and "adamw_8bit" in n for n in notes)


def test_flat_training_arguments_at_the_top_level_find_their_sections():
    config, notes = _parse("gradient_accumulation_steps: 4\ntarget_modules: [q_proj, v_proj]\nlearning_rate: 1e-4\n")
    assert config.trainer.accumulation_steps() == 4
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.trainer.learning_rate == pytest.approx(1e-4)
    assert len(notes) == 3


def test_an_alias_range_error_points_at_the_line_it_was_written_on():
    with pytest.raises(ConfigError, match=r"^x.yaml: line 2: 'trainer.epochs' must be greater than 0"):
        _parse("lora: {}\nnum_train_epochs: -1\n")


def test_studio_keys_alone_make_no_notes():
    _config, notes = _parse("lora:\n  alpha: 8\ntrainer:\n  epochs: 2\n")
    assert notes == []


SAVED_BY_LUDWIG = """\
    ludwig_version: 0.10.4
    model_type: llm
    base_model: HuggingFaceTB/SmolLM2-135M-Instruct
    adapter:
      type: lora
    quantization:
      bits: 4
    input_features:
      - name: instruction
        type: text
    output_features:
      - name: output
        type: text
    trainer:
      type: finetune
      batch_size: 1
      eval_batch_size: 2
      gradient_accumulation_steps: auto
      early_stop: 5
      optimizer:
        type: paged_adam
        betas: [0.9, 0.999]
    generation:
      max_new_tokens: 32
      num_beams: 1
    backend:
      type: local
    hyperopt: null
    """


def test_a_config_saved_by_ludwig_loads_with_ludwig_defaults_and_notes():
    config, notes = _parse(SAVED_BY_LUDWIG)
    assert (config.lora.r, config.lora.alpha, config.lora.dropout) == (8, 16, 0.05)
    assert config.trainer.optimizer == "paged_adamw"
    assert config.trainer.micro_batch_size == 1
    assert config.quantization.bits == 4
    joined = "\n".join(notes)
    for key in ("'backend'", "trainer.eval_batch_size", "trainer.early_stop", "trainer.optimizer.betas",
                "generation.num_beams"):
        assert key in joined, key
    assert "hyperopt" not in joined  # null: nothing was dropped
    assert any(n.startswith("x.yaml: line 26:") and "backend" in n for n in notes)


def test_ludwig_without_an_adapter_says_it_trains_a_lora():
    text = SAVED_BY_LUDWIG.replace("    adapter:\n      type: lora\n", "")
    config, notes = _parse(text)
    assert config.lora.r == 8
    assert any("no 'adapter' section" in n for n in notes)


def test_a_ludwig_optimizer_without_a_counterpart_is_refused():
    with pytest.raises(ConfigError, match="Ludwig optimizer 'sgd' has no Studio counterpart"):
        _parse(SAVED_BY_LUDWIG.replace("type: paged_adam", "type: sgd"))


def test_lora_null_is_refused_not_silently_r16():
    with pytest.raises(ConfigError, match=r"line 1: 'lora' is empty \(null\)"):
        _parse("lora: null\n")


def test_a_range_error_in_a_ludwig_config_names_the_line_of_ludwigs_key():
    text = SAVED_BY_LUDWIG.replace("      batch_size: 1\n", "      batch_size: 0\n")
    with pytest.raises(ConfigError, match=r"^x.yaml: line 16: 'trainer.micro_batch_size' must be greater than 0"):
        _parse(text)
    text = SAVED_BY_LUDWIG.replace("      type: lora\n", "      type: lora\n      dropout: 1.5\n")
    with pytest.raises(ConfigError, match=r"^x.yaml: line 6: 'lora.dropout' must be in \[0, 1\)"):
        _parse(text)
