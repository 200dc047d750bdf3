"""Ludwig LLM configs, translated into Studio's layout.

Ludwig's `model_type: llm` configs (base_model, adapter, quantization, prompt, input/output features,
trainer, generation, preprocessing) are accepted as they are, including the full config Ludwig saves
beside a model (with ``ludwig_version`` and every default written out), so a config written for
Ludwig trains here unchanged. :func:`from_ludwig` only renames and reshapes keys, filling in Ludwig's
own defaults where Studio's differ (LoRA r 8, alpha 16, dropout 0.05); config.py then reads the
result like any Studio config, so types and ranges are checked in one place. As in Ludwig, a config
without ``adapter`` (or with ``adapter: null``) fine-tunes every weight (Studio's ``lora: null``).

Trainer keys a Ludwig config leaves out take Studio's defaults: Ludwig's fine-tune trainer inherits
its general trainer's (100 epochs at learning rate 0.001), which do not suit an LLM. The 4-bit
compute dtype also stays Studio's: ``auto`` (bf16 where the GPU has it)
rather than Ludwig's float16, which overflows more easily and gains nothing on current cards.

Three kinds of key: those Studio acts on (translated), those Ludwig has but Studio does not act on
(each named in a note, never dropped in silence: ``backend``, ``hyperopt``, an early-stopping
setting...), and anything else, refused with the nearest known key (a typo must not pass as
"ignored"). Every refusal is reported and reading goes on, so one run names them all.

Ludwig 0.16's preference trainers (``trainer.type: dpo`` with ``dpo_beta``, ``orpo`` with
``orpo_beta``, both with ``rejected_column``; the output feature is the chosen answer) become
Studio's ``trainer.method`` and ``beta`` and ``prompt.rejected_field``, each with a note;
``adapter.type: dora`` is LoRA with ``use_dora`` (Ludwig itself writes ``type: lora, use_dora: true``).
"""

from __future__ import annotations

from typing import Any

_METADATA = ["ludwig_version", "model_type"]
"""Top-level keys that describe the file rather than the run."""

_IGNORED_SECTIONS = {
    "backend": ("Studio does not use Ray, Horovod or DeepSpeed; it trains data-parallel on this machine's GPUs "
                "itself (torchrun, one process a GPU): set 'distributed: {gpus: N}' or run "
                "'studio train CONFIG --gpus N'"),
    "hyperopt": "Studio runs one configuration (compare runs with `studio runs`)",
    "defaults": "feature defaults do not apply to an LLM fine-tune here",
    "model_parameters": "Studio loads the model as saved (no RoPE scaling or neftune options)",
}
"""Ludwig sections Studio does not act on, with the reason shown in the note."""

_LUDWIG_TOP = [*_METADATA, "base_model", "adapter", "quantization", "prompt", "input_features", "output_features",
               "trainer", "generation", "preprocessing", *_IGNORED_SECTIONS]

_TRAINER = {"learning_rate": "learning_rate", "batch_size": "micro_batch_size",
            "gradient_accumulation_steps": "gradient_accumulation_steps", "epochs": "epochs",
            "train_steps": "max_steps", "enable_gradient_checkpointing": "gradient_checkpointing",
            "weight_decay": "weight_decay", "steps_per_checkpoint": "checkpoint_interval",
            "max_grad_norm": "max_grad_norm"}
"""Ludwig trainer key -> Studio trainer key."""

_TRAINER_IGNORED = [
    # Ludwig 0.16's general trainer keys (its fine-tune and preference trainers inherit them; a saved
    # config writes them out): multi-task loss balancing, contrastive pre-training, model soups.
    "eval_steps", "loss_balancing", "loss_balancing_alpha", "loss_balancing_lr", "loss_balancing_preference_vector",
    "loss_balancing_tchebycheff_weight", "contrastive_pretrain_epochs", "contrastive_pretrain_temperature",
    "contrastive_pretrain_projection_dim", "contrastive_pretrain_learnable_temperature", "modality_dropout",
    "model_soup", "model_soup_top_k",
    "eval_batch_size", "checkpoints_per_epoch", "early_stop", "evaluate_training_set", "validation_field",
    "validation_metric", "regularization_type", "regularization_lambda", "should_shuffle",
    "increase_batch_size_on_plateau", "increase_batch_size_on_plateau_patience",
    "increase_batch_size_on_plateau_rate", "increase_batch_size_eval_metric", "increase_batch_size_eval_split",
    "gradient_clipping", "learning_rate_scaling", "bucketing_field", "skip_all_evaluation", "enable_profiling",
    "profiler", "use_mixed_precision", "compile", "max_batch_size", "steps_per_epoch", "base_learning_rate",
    "effective_batch_size", "skip_save_model", "skip_save_progress", "skip_save_log", "seed",
    "increase_batch_size_on_plateau_max", "layers_to_freeze_regex", "learning_rate_warmup_epochs",
    "reduce_learning_rate_on_plateau", "reduce_learning_rate_on_plateau_patience",
    "reduce_learning_rate_on_plateau_rate", "reduce_learning_rate_eval_metric", "reduce_learning_rate_eval_split",
    "decay", "decay_steps", "decay_rate", "staircase",
]
"""Ludwig trainer keys Studio reads but does not act on (each named in a note)."""

_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "paged_adam": "paged_adamw", "paged_adamw": "paged_adamw",
               "paged_adam_8bit": "paged_adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
               "adam8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "adam_8bit": "adamw_8bit",
               "adamw8bit": "adamw_8bit"}
"""Ludwig optimizer type -> Studio's. Ludwig's paged_adam is bitsandbytes' 32-bit paged optimizer, so it
maps to paged AdamW (32-bit), not the 8-bit one."""

_GENERATION_IGNORED = [
    "top_k", "num_beams", "repetition_penalty", "max_length", "min_length", "min_new_tokens", "penalty_alpha",
    "pad_token_id", "eos_token_id", "bos_token_id", "use_cache", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "diversity_penalty", "length_penalty", "no_repeat_ngram_size", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "early_stopping", "num_beam_groups", "renormalize_logits", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
    "forced_eos_token_id", "guidance_scale", "prompt_lookup_num_tokens", "max_time", "encoder_repetition_penalty",
    "bad_words_ids", "force_words_ids", "sequence_bias", "constraints", "decoder_start_token_id",
]

LORA_DEFAULTS = {"r": 8, "dropout": 0.05}
"""Ludwig's LoRA defaults, used where a Ludwig config's adapter leaves a key out (alpha: twice r)."""

_ADAPTER_IGNORED = ["bias_type", "pretrained_adapter_weights", "postprocessor", "loraplus_lr_ratio",
                    "init_lora_weights", "loftq_config", "eva_config", "rank_pattern", "alpha_pattern",
                    "layer_replication"]
"""Ludwig LoRA keys Studio reads but does not act on (each named in a note when set)."""

_PREFERENCE_KEYS = {"dpo": {"dpo_beta": "beta", "rejected_column": "rejected_field"},
                    "orpo": {"orpo_beta": "beta", "rejected_column": "rejected_field"}}
"""Ludwig 0.16's preference trainer keys -> Studio's (``beta`` in trainer, ``rejected_field`` in prompt)."""

_TRAINER_TYPES = ("finetune", "dpo", "orpo")
"""Ludwig LLM trainer types Studio trains (``kto`` and ``grpo`` are Ludwig's too; Studio has neither)."""


def from_ludwig(raw: dict[str, Any], reader: Any) -> dict[str, Any]:
    """Translate a Ludwig LLM config into Studio's layout (then read as usual).

    ``reader`` is config_reader's Reader: ``reader.report(path, message)`` records a problem naming
    the file, line and key (reading goes on; ``reader.unknown(path, known_keys)`` words an unknown
    key), ``reader.note(path, message)`` tells the person about a key Studio does not act on.
    """
    out: dict[str, Any] = {"model": {}, "quantization": {}, "lora": {}, "prompt": {}, "data": {},
                           "trainer": {}, "generation": {}}
    for key in raw:
        if key not in _LUDWIG_TOP:
            reader.report((key,), reader.unknown((key,), _LUDWIG_TOP))
        elif key in _IGNORED_SECTIONS and raw[key] is not None:
            reader.note((key,), f"Ludwig's '{key}' section is ignored: {_IGNORED_SECTIONS[key]}")
    _note_strategy(raw.get("backend"), reader)
    if raw.get("model_type") != "llm":
        reader.report(("model_type",), "only 'model_type: llm' is supported")
    if "base_model" in raw:
        out["model"]["base_model"] = raw["base_model"]
        _moved(reader, ("base_model",), ("model", "base_model"))
    _quantization(raw, out, reader)
    _adapter(raw, out, reader)
    max_len = _features_and_prompt(raw, out, reader)
    _preprocessing(raw, out, reader, max_len)
    _trainer(raw, out, reader)
    _generation(raw, out, reader)
    return out


def _moved(reader: Any, old: tuple[str, ...], new: tuple[str, ...]) -> None:
    """Errors about Studio's ``new`` key point at the line of Ludwig's ``old`` one."""
    lines = getattr(reader, "lines", None)
    if hasattr(lines, "rename"):
        lines.rename(old, new)


def _section(raw: dict[str, Any], name: str, reader: Any) -> dict[str, Any]:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        reader.report((name,), f"'{name}' must be a mapping of keys to values")
        return {}
    return value


def _note_strategy(backend: Any, reader: Any) -> None:
    """Ludwig's ``backend.trainer.strategy`` (ddp, fsdp, deepspeed, horovod) gets its own note: what
    Studio does instead, and the ``distributed.gpus`` that matches ``num_workers``."""
    trainer = backend.get("trainer") if isinstance(backend, dict) else None
    if not isinstance(trainer, dict) or "strategy" not in trainer:
        return
    workers = trainer.get("num_workers")
    gpus = workers if isinstance(workers, int) and workers > 0 else "N"
    reader.note(("backend", "trainer", "strategy"), (
        f"Ludwig's 'backend.trainer.strategy: {trainer['strategy']}' is not used: Studio copies the model to "
        f"each GPU and sums the LoRA gradients across them (as DDP does; the 4-bit base is small enough not "
        f"to shard); set 'distributed: {{gpus: {gpus}}}' or run 'studio train CONFIG --gpus {gpus}'"))


def _check_keys(section: dict[str, Any], path: tuple[str, ...], acted: list[str], ignored: list[str],
                reader: Any) -> None:
    """Report unknown keys (suggesting the nearest); note the known ones Studio does not act on."""
    for key in section:
        if key in acted:
            continue
        if key in ignored:
            if section[key] is not None:
                reader.note((*path, key), f"Ludwig's '{'.'.join((*path, key))}' is not acted on by Studio; ignored")
            continue
        reader.report((*path, key), reader.unknown((*path, key), acted))


def _quantization(raw: dict[str, Any], out: dict[str, Any], reader: Any) -> None:
    if raw.get("quantization") is None:
        out["quantization"]["bits"] = None
        return
    quant = _section(raw, "quantization", reader)
    _check_keys(quant, ("quantization",), ["bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                                           "bnb_4bit_compute_dtype"], ["llm_int8_threshold",
                                                                       "llm_int8_has_fp16_weight"], reader)
    out["quantization"]["bits"] = quant.get("bits", 4)
    for src, dst in (("bnb_4bit_quant_type", "quant_type"), ("bnb_4bit_use_double_quant", "double_quant"),
                     ("bnb_4bit_compute_dtype", "compute_dtype")):
        if src in quant:
            out["quantization"][dst] = quant[src]
            _moved(reader, ("quantization", src), ("quantization", dst))


def _adapter(raw: dict[str, Any], out: dict[str, Any], reader: Any) -> None:
    if "adapter" not in raw or raw["adapter"] is None:
        # Ludwig's meaning: no adapter fine-tunes every weight. Its quantization needs an adapter
        # (quantized weights take no gradients), so a config with both is refused as Ludwig refuses it.
        if raw.get("quantization") is not None:
            lines = getattr(reader, "lines", None)
            if hasattr(lines, "point"):
                lines.point(("adapter",), ("quantization",))  # no adapter line: point at the quantization
            reader.report(("adapter",), (
                "a Ludwig config without 'adapter' fine-tunes every weight, which quantized weights cannot "
                "do; add 'adapter: {type: lora}' (QLoRA), or remove the quantization section"))
        out["lora"] = None
        return
    adapter = _section(raw, "adapter", reader)
    _check_keys(adapter, ("adapter",), ["type", "r", "alpha", "dropout", "target_modules", "use_dora",
                                        "use_rslora"], _ADAPTER_IGNORED, reader)
    kind = adapter.get("type", "lora")
    if kind == "dora":
        _moved(reader, ("adapter", "type"), ("lora", "use_dora"))
        reader.note(("adapter", "type"), "Ludwig's 'adapter.type: dora' is read as Studio's 'lora.use_dora: "
                    "true' (LoRA with DoRA's magnitude vector; Ludwig writes it 'type: lora, use_dora: true')")
    elif kind != "lora":
        reader.report(("adapter", "type"), f"'adapter.type' is {kind!r}; Studio trains 'lora' and 'dora' "
                      "adapters (or none: every weight)")
    for key, default in LORA_DEFAULTS.items():
        out["lora"][key] = adapter.get(key, default)
    for key in adapter:
        _moved(reader, ("adapter", key), ("lora", key))
    # Ludwig's alpha defaults to twice the rank (its adapter schema, since 0.9); a saved config writes null.
    alpha = adapter.get("alpha")
    out["lora"]["alpha"] = alpha if alpha is not None else 2 * out["lora"]["r"] if isinstance(
        out["lora"]["r"], int) else 16
    for key in ("use_dora", "use_rslora"):
        if key in adapter:
            out["lora"][key] = adapter[key]
    if kind == "dora":
        out["lora"]["use_dora"] = True
    # Ludwig's LoRA default targets the attention query and value projections.
    out["lora"]["target_modules"] = adapter.get("target_modules") or ["q_proj", "v_proj"]


def _features_and_prompt(raw: dict[str, Any], out: dict[str, Any], reader: Any) -> int | None:
    """Prompt template and response field from ``prompt`` and the features; the summed per-feature
    max_sequence_length (None when no feature sets one)."""
    prompt = _section(raw, "prompt", reader)
    _check_keys(prompt, ("prompt",), ["template"], ["task", "retrieval"], reader)
    if "template" in prompt:
        out["prompt"]["template"] = prompt["template"]
    max_len = None
    inputs = raw.get("input_features") or []
    outputs = raw.get("output_features") or []
    for kind, feats in (("input_features", inputs), ("output_features", outputs)):
        if not isinstance(feats, list):
            reader.report((kind,), f"'{kind}' must be a list of {{name, type}} entries")
            continue
        for i, feat in enumerate(feats):
            if not isinstance(feat, dict) or "name" not in feat:
                reader.report((kind, str(i)), f"'{kind}[{i}]' needs a 'name' (the column)")
                continue
            length = (feat.get("preprocessing") or {}).get("max_sequence_length")
            if length:
                max_len = (max_len or 0) + int(length)
    inputs = [f for f in inputs if isinstance(f, dict) and "name" in f] if isinstance(inputs, list) else []
    outputs = [f for f in outputs if isinstance(f, dict) and "name" in f] if isinstance(outputs, list) else []
    if outputs:
        out["prompt"]["response_field"] = outputs[0]["name"]
    if inputs and "template" not in prompt:
        # No template: the input columns are the prompt, the output follows a newline.
        fields = "\n".join("{" + f["name"] + "}" for f in inputs)
        out["prompt"]["template"] = fields + "\n{" + out["prompt"].get("response_field", "output") + "}"
    return max_len


def _preprocessing(raw: dict[str, Any], out: dict[str, Any], reader: Any, max_len: int | None) -> None:
    pre = _section(raw, "preprocessing", reader)
    _check_keys(pre, ("preprocessing",), ["global_max_sequence_length", "sample_ratio", "split"],
                ["sample_size", "oversample_minority", "undersample_majority", "cache_encoder_embeddings"], reader)
    if pre.get("global_max_sequence_length"):
        max_len = int(pre["global_max_sequence_length"])
        _moved(reader, ("preprocessing", "global_max_sequence_length"), ("data", "max_seq_length"))
    if max_len:
        out["data"]["max_seq_length"] = max_len
    if "sample_ratio" in pre:
        out["data"]["sample_ratio"] = pre["sample_ratio"]
        _moved(reader, ("preprocessing", "sample_ratio"), ("data", "sample_ratio"))
    split = pre.get("split") or {}
    if split.get("type") == "fixed":
        out["data"]["split_column"] = split.get("column", "split")
    elif split.get("probabilities"):
        probs = split["probabilities"]
        out["data"]["split_column"] = None
        out["data"]["val_fraction"] = probs[1]
        out["data"]["test_fraction"] = probs[2] if len(probs) > 2 else 0.0


def _trainer(raw: dict[str, Any], out: dict[str, Any], reader: Any) -> None:
    trainer = _section(raw, "trainer", reader)
    kind = trainer.get("type", "finetune")
    preference = _PREFERENCE_KEYS.get(kind, {}) if isinstance(kind, str) else {}
    preference_only = [k for k in ("dpo_loss_type", "dpo_label_smoothing") if kind == "dpo"]
    _check_keys(trainer, ("trainer",), ["type", *_TRAINER, "learning_rate_scheduler", "optimizer", *preference,
                                        *preference_only], _TRAINER_IGNORED, reader)
    if kind not in _TRAINER_TYPES:
        reader.report(("trainer", "type"), f"'trainer.type' is {kind!r}; Studio trains Ludwig's "
                      f"{', '.join(_TRAINER_TYPES)} trainers")
    t = out["trainer"]
    if kind in _PREFERENCE_KEYS:
        _preference_trainer(kind, trainer, preference, out, reader)
    for src, dst in _TRAINER.items():
        if src in trainer and trainer[src] != "auto":
            t[dst] = trainer[src]
            _moved(reader, ("trainer", src), ("trainer", dst))
    if isinstance(trainer.get("gradient_accumulation_steps"), int):
        t["effective_batch_size"] = None
    elif isinstance(trainer.get("batch_size"), int):
        t["effective_batch_size"] = trainer["batch_size"]
        _moved(reader, ("trainer", "batch_size"), ("trainer", "effective_batch_size"))
    sched = trainer.get("learning_rate_scheduler") or {}
    _check_keys(sched, ("trainer", "learning_rate_scheduler"), ["warmup_fraction", "decay"],
                ["warmup_evaluations", "decay_rate", "decay_steps", "staircase", "reduce_on_plateau",
                 "reduce_on_plateau_patience", "reduce_on_plateau_rate", "reduce_eval_metric", "reduce_eval_split",
                 "t_0", "t_mult", "eta_min"], reader)
    if "warmup_fraction" in sched:
        t["warmup_fraction"] = sched["warmup_fraction"]
        _moved(reader, ("trainer", "learning_rate_scheduler", "warmup_fraction"), ("trainer", "warmup_fraction"))
    if sched.get("decay"):
        t["scheduler"] = {"cosine": "cosine", "linear": "linear"}.get(sched["decay"], "constant")
    optimizer = trainer.get("optimizer") or {}
    _check_keys(optimizer, ("trainer", "optimizer"), ["type"], ["betas", "eps", "weight_decay", "amsgrad",
                                                                "block_wise", "percentile_clipping"], reader)
    if optimizer.get("type"):
        name = str(optimizer["type"])
        if name not in _OPTIMIZERS:
            reader.report(("trainer", "optimizer", "type"), f"Ludwig optimizer '{name}' has no Studio "
                          f"counterpart; use one of {', '.join(sorted(_OPTIMIZERS))}")
        else:
            t["optimizer"] = _OPTIMIZERS[name]


def _preference_trainer(kind: str, trainer: dict[str, Any], keys: dict[str, str], out: dict[str, Any],
                        reader: Any) -> None:
    """Ludwig 0.16's ``trainer.type: dpo | orpo`` as Studio's ``trainer.method`` with its ``beta`` and
    ``prompt.rejected_field``, one note each. DPO variants Studio's loss is not (IPO, label smoothing)
    are refused rather than trained as plain DPO."""
    out["trainer"]["method"] = kind
    _moved(reader, ("trainer", "type"), ("trainer", "method"))
    reader.note(("trainer", "type"), f"Ludwig's 'trainer.type: {kind}' is read as Studio's 'trainer.method: {kind}'")
    for key, studio in keys.items():
        if key not in trainer:
            continue
        section = "prompt" if studio == "rejected_field" else "trainer"
        out[section][studio] = trainer[key]
        _moved(reader, ("trainer", key), (section, studio))
        reader.note(("trainer", key), f"Ludwig's 'trainer.{key}' is read as Studio's '{section}.{studio}'"
                    + (" (the column of the rejected answers; the output feature is the chosen one)"
                       if studio == "rejected_field" else ""))
    if trainer.get("dpo_loss_type", "sigmoid") != "sigmoid":
        reader.report(("trainer", "dpo_loss_type"), f"'trainer.dpo_loss_type' is {trainer['dpo_loss_type']!r}; "
                      "Studio's DPO is the sigmoid loss: write sigmoid (or remove the key)")
    smoothing = trainer.get("dpo_label_smoothing", 0)
    if smoothing not in (0, 0.0, None):
        reader.report(("trainer", "dpo_label_smoothing"), f"'trainer.dpo_label_smoothing' is {smoothing!r}; "
                      "Studio's DPO has no label smoothing: write 0 (or remove the key)")


def _generation(raw: dict[str, Any], out: dict[str, Any], reader: Any) -> None:
    gen = _section(raw, "generation", reader)
    _check_keys(gen, ("generation",), ["max_new_tokens", "temperature", "top_p", "do_sample"],
                _GENERATION_IGNORED, reader)
    for key in ("max_new_tokens", "temperature", "top_p"):
        if key in gen:
            out["generation"][key] = gen[key]
    if gen.get("do_sample") is False:
        out["generation"]["temperature"] = 0.0
