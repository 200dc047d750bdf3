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


def test_ludwig_without_an_adapter_fine_tunes_every_weight_as_ludwig_does():
    text = SAVED_BY_LUDWIG.replace("    adapter:\n      type: lora\n", "").replace("    quantization:\n      bits: 4\n", "")
    config, _notes = _parse(text)
    assert config.lora is None and config.full_finetune
    assert config.quantization.bits is None
    config, _notes = _parse(text.replace("model_type: llm\n", "model_type: llm\n    adapter: null\n"))
    assert config.full_finetune


def test_ludwig_quantization_without_an_adapter_is_refused_in_one_line():
    text = SAVED_BY_LUDWIG.replace("    adapter:\n      type: lora\n", "")
    with pytest.raises(ConfigError, match=r"^x.yaml: line \d+: a Ludwig config without 'adapter' fine-tunes every "
                       r"weight.*add 'adapter: \{type: lora\}'") as caught:
        _parse(text)
    assert "\n" not in str(caught.value)


def test_a_ludwig_optimizer_without_a_counterpart_is_refused():
    with pytest.raises(ConfigError, match="Ludwig optimizer 'sgd' has no Studio counterpart"):
        _parse(SAVED_BY_LUDWIG.replace("type: paged_adam", "type: sgd"))


@pytest.mark.parametrize("spelling", ["null", "false", "none", "~"])
def test_lora_null_asks_for_full_fine_tuning_and_drops_the_4bit_default(spelling):
    config, notes = _parse(f"lora: {spelling}\n")
    assert config.lora is None and config.full_finetune
    assert config.quantization.bits is None  # 4 is QLoRA's default; a full fine-tune trains unquantized
    assert notes == []
    # config dump writes it back as lora: null, and that reads back the same
    assert "\nlora: null\n" in config.to_yaml()
    assert parse_config(config.to_yaml()) == config


def test_full_fine_tuning_with_explicit_quantization_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^x.yaml: line 2: 'quantization.bits' is 8 but 'lora' is null \(full "
                       r"fine-tuning\).*set quantization.bits: null") as caught:
        _parse("lora: null\nquantization: {bits: 8}\n")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("text", "key"), [
    ("lora: null\nuse_dora: true\n", "line 2: 'use_dora' sets a LoRA option"),
    ("lora: null\nlora_alpha: 8\n", "line 2: 'lora_alpha' sets a LoRA option"),
    ("lora: null\ntrainer: {method: dpo}\n", "line 2: 'trainer.method' is dpo"),
    ("lora: null\ndistributed: {gpus: 2}\n", "line 2: 'distributed.gpus' is 2"),
])
def test_options_that_need_an_adapter_are_refused_with_full_fine_tuning(text, key):
    with pytest.raises(ConfigError, match=r"^x.yaml: " + key.replace("(", r"\(")) as caught:
        _parse(text)
    assert "\n" not in str(caught.value)


def test_a_range_error_in_a_ludwig_config_names_the_line_of_ludwigs_key():
    text = SAVED_BY_LUDWIG.replace("      batch_size: 1\n", "      batch_size: 0\n")
    with pytest.raises(ConfigError, match=r"^x.yaml: line 16: 'trainer.micro_batch_size' must be greater than 0"):
        _parse(text)
    text = SAVED_BY_LUDWIG.replace("      type: lora\n", "      type: lora\n      dropout: 1.5\n")
    with pytest.raises(ConfigError, match=r"^x.yaml: line 6: 'lora.dropout' must be in \[0, 1\)"):
        _parse(text)


LUDWIG_DPO = """\
    ludwig_version: 0.16.0
    model_type: llm
    base_model: HuggingFaceTB/SmolLM2-135M-Instruct
    adapter:
      type: dora
      r: 16
    input_features:
      - name: prompt
        type: text
    output_features:
      - name: chosen
        type: text
    trainer:
      type: dpo
      dpo_beta: 0.25
      dpo_loss_type: sigmoid
      dpo_label_smoothing: 0.0
      rejected_column: worse
      learning_rate: 0.00005
      model_soup: null
    """


def test_ludwig_016_dpo_and_dora_map_to_studios_keys_with_a_note_each():
    """Key names from Ludwig 0.16's schema (ludwig/schema/trainer.py: DPOTrainerConfig, ORPOTrainerConfig)."""
    config, notes = _parse(LUDWIG_DPO)
    assert (config.trainer.method, config.trainer.beta) == ("dpo", 0.25)
    assert (config.prompt.response_field, config.prompt.rejected_field) == ("chosen", "worse")
    assert config.prompt.template == "{prompt}\n{chosen}"
    assert config.lora.use_dora and (config.lora.r, config.lora.alpha) == (16, 32)  # Ludwig's alpha: 2 r
    assert "x.yaml: line 5: Ludwig's 'adapter.type: dora' is read as Studio's 'lora.use_dora: true'" in notes[0]
    expected = {"line 14": "'trainer.type: dpo' is read as Studio's 'trainer.method: dpo'",
                "line 15": "'trainer.dpo_beta' is read as Studio's 'trainer.beta'",
                "line 18": "'trainer.rejected_column' is read as Studio's 'prompt.rejected_field'"}
    for line, text in expected.items():
        assert any(n.startswith(f"x.yaml: {line}: ") and text in n for n in notes), (line, notes)


def test_ludwig_016_orpo_maps_its_beta():
    text = LUDWIG_DPO.replace("type: dpo", "type: orpo").replace("dpo_beta", "orpo_beta")
    text = text.replace("      dpo_loss_type: sigmoid\n      dpo_label_smoothing: 0.0\n", "")
    config, notes = _parse(text)
    assert (config.trainer.method, config.trainer.beta, config.prompt.rejected_field) == ("orpo", 0.25, "worse")
    assert any("'trainer.orpo_beta' is read as Studio's 'trainer.beta'" in n for n in notes)


def test_ludwig_dpo_variants_studio_does_not_train_are_refused_all_at_once():
    text = LUDWIG_DPO.replace("dpo_loss_type: sigmoid", "dpo_loss_type: ipo").replace(
        "dpo_label_smoothing: 0.0", "dpo_label_smoothing: 0.1")
    with pytest.raises(ConfigError) as caught:
        _parse(text.replace("dpo_beta: 0.25", "orpo_beta: 0.25"))
    problems = caught.value.problems
    assert [p.split(":")[1].strip() for p in problems] == ["line 15", "line 16", "line 17"], problems
    assert "unknown key 'trainer.orpo_beta': did you mean 'dpo_beta'?" in problems[0]
    assert "'trainer.dpo_loss_type' is 'ipo'" in problems[1] and "sigmoid" in problems[1]
    assert "'trainer.dpo_label_smoothing' is 0.1" in problems[2]
    with pytest.raises(ConfigError, match=r"line 14: 'trainer.type' is 'kto'; Studio trains Ludwig's finetune, dpo"):
        _parse(LUDWIG_DPO.replace("type: dpo", "type: kto").replace("      dpo_loss_type: sigmoid\n", "")
               .replace("      dpo_label_smoothing: 0.0\n", "").replace("      dpo_beta: 0.25\n", ""))
