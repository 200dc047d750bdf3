"""Ludwig LLM configs, translated into Studio's layout.

Ludwig's `model_type: llm` configs (base_model, adapter, quantization, prompt, input/output features,
trainer, generation, preprocessing) are accepted as they are, so a config written for Ludwig trains
here unchanged. :func:`from_ludwig` only renames and reshapes keys; config.py then reads the result
like any Studio config, so types and ranges are checked in one place.
"""

from __future__ import annotations

from typing import Any

_LUDWIG_TOP = [
    "model_type", "base_model", "adapter", "quantization", "prompt", "input_features",
    "output_features", "trainer", "generation", "preprocessing", "backend", "model_parameters",
]
_LUDWIG_TRAINER = [
    "type", "learning_rate", "batch_size", "gradient_accumulation_steps", "epochs", "train_steps",
    "learning_rate_scheduler", "enable_gradient_checkpointing", "optimizer", "weight_decay",
    "eval_batch_size", "steps_per_checkpoint", "checkpoints_per_epoch", "max_grad_norm",
]


def from_ludwig(raw: dict[str, Any], reader: Any) -> dict[str, Any]:
    """Translate a Ludwig LLM config into Studio's layout (then read as usual).

    ``reader`` is config.py's error builder: ``reader.fail(path, message)`` and
    ``reader.unknown(path, known_keys)`` return a ConfigError naming the file, line and key.
    """
    out: dict[str, Any] = {"model": {}, "quantization": {}, "lora": {}, "prompt": {}, "data": {},
                           "trainer": {}, "generation": {}}
    for key in raw:
        if key not in _LUDWIG_TOP:
            raise reader.unknown((key,), _LUDWIG_TOP)
    if raw.get("model_type") != "llm":
        raise reader.fail(("model_type",), "only 'model_type: llm' is supported")
    if "base_model" in raw:
        out["model"]["base_model"] = raw["base_model"]

    quant = raw.get("quantization")
    if quant is None:
        out["quantization"]["bits"] = None
    else:
        for key in quant:
            if key not in ("bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                           "bnb_4bit_compute_dtype", "llm_int8_threshold"):
                raise reader.unknown(("quantization", key), ["bits", "bnb_4bit_quant_type",
                                                             "bnb_4bit_use_double_quant",
                                                             "bnb_4bit_compute_dtype"])
        out["quantization"]["bits"] = quant.get("bits", 4)
        if "bnb_4bit_quant_type" in quant:
            out["quantization"]["quant_type"] = quant["bnb_4bit_quant_type"]
        if "bnb_4bit_use_double_quant" in quant:
            out["quantization"]["double_quant"] = quant["bnb_4bit_use_double_quant"]
        if "bnb_4bit_compute_dtype" in quant:
            out["quantization"]["compute_dtype"] = quant["bnb_4bit_compute_dtype"]

    adapter = raw.get("adapter") or {}
    for key in adapter:
        if key not in ("type", "r", "alpha", "dropout", "target_modules", "bias_type"):
            raise reader.unknown(("adapter", key), ["type", "r", "alpha", "dropout", "target_modules"])
    if adapter.get("type", "lora") != "lora":
        raise reader.fail(("adapter", "type"), "only 'adapter: {type: lora}' is supported")
    for key in ("r", "alpha", "dropout", "target_modules"):
        if key in adapter:
            out["lora"][key] = adapter[key]
    if "target_modules" not in adapter and adapter:
        # Ludwig's LoRA default targets the attention query and value projections.
        out["lora"]["target_modules"] = ["q_proj", "v_proj"]

    prompt = raw.get("prompt") or {}
    for key in prompt:
        if key not in ("template", "task"):
            raise reader.unknown(("prompt", key), ["template"])
    if "template" in prompt:
        out["prompt"]["template"] = prompt["template"]

    max_len = None
    inputs = raw.get("input_features") or []
    outputs = raw.get("output_features") or []
    for kind, feats in (("input_features", inputs), ("output_features", outputs)):
        if not isinstance(feats, list):
            raise reader.fail((kind,), f"'{kind}' must be a list of {{name, type}} entries")
        for i, feat in enumerate(feats):
            if not isinstance(feat, dict) or "name" not in feat:
                raise reader.fail((kind, str(i)), f"'{kind}[{i}]' needs a 'name' (the column)")
            length = (feat.get("preprocessing") or {}).get("max_sequence_length")
            if length:
                max_len = (max_len or 0) + int(length)
    if outputs:
        column = outputs[0]["name"]
        out["prompt"]["response_field"] = column
    if inputs and "template" not in prompt:
        # No template: the single input column is the prompt, the output follows a newline.
        fields = "\n".join("{" + f["name"] + "}" for f in inputs)
        out["prompt"]["template"] = fields + "\n{" + out["prompt"].get("response_field", "output") + "}"

    pre = raw.get("preprocessing") or {}
    for key in pre:
        if key not in ("global_max_sequence_length", "sample_ratio", "split"):
            raise reader.unknown(("preprocessing", key),
                                 ["global_max_sequence_length", "sample_ratio", "split"])
    if pre.get("global_max_sequence_length"):
        max_len = int(pre["global_max_sequence_length"])
    if max_len:
        out["data"]["max_seq_length"] = max_len
    if "sample_ratio" in pre:
        out["data"]["sample_ratio"] = pre["sample_ratio"]
    split = pre.get("split") or {}
    if split.get("type") == "fixed":
        out["data"]["split_column"] = split.get("column", "split")
    elif split.get("probabilities"):
        probs = split["probabilities"]
        out["data"]["split_column"] = None
        out["data"]["val_fraction"] = probs[1]
        out["data"]["test_fraction"] = probs[2] if len(probs) > 2 else 0.0

    trainer = raw.get("trainer") or {}
    for key in trainer:
        if key not in _LUDWIG_TRAINER:
            raise reader.unknown(("trainer", key), _LUDWIG_TRAINER)
    if trainer.get("type", "finetune") != "finetune":
        raise reader.fail(("trainer", "type"), "only 'trainer: {type: finetune}' is supported")
    t = out["trainer"]
    mapping = {"learning_rate": "learning_rate", "batch_size": "micro_batch_size",
               "gradient_accumulation_steps": "gradient_accumulation_steps", "epochs": "epochs",
               "train_steps": "max_steps", "enable_gradient_checkpointing": "gradient_checkpointing",
               "weight_decay": "weight_decay", "steps_per_checkpoint": "checkpoint_interval",
               "max_grad_norm": "max_grad_norm"}
    for src, dst in mapping.items():
        if src in trainer:
            t[dst] = trainer[src]
    if "gradient_accumulation_steps" in trainer:
        t["effective_batch_size"] = None
    elif "batch_size" in trainer:
        t["effective_batch_size"] = trainer["batch_size"]
    sched = trainer.get("learning_rate_scheduler") or {}
    for key in sched:
        if key not in ("warmup_fraction", "decay", "warmup_evaluations"):
            raise reader.unknown(("trainer", "learning_rate_scheduler", key), ["warmup_fraction", "decay"])
    if "warmup_fraction" in sched:
        t["warmup_fraction"] = sched["warmup_fraction"]
    if sched.get("decay"):
        t["scheduler"] = {"cosine": "cosine", "linear": "linear"}.get(sched["decay"], "constant")
    optimizer = trainer.get("optimizer") or {}
    if optimizer.get("type"):
        t["optimizer"] = {"adamw": "adamw", "paged_adam": "paged_adamw_8bit",
                          "paged_adamw_8bit": "paged_adamw_8bit",
                          "adam8bit": "adamw_8bit"}.get(optimizer["type"], optimizer["type"])

    gen = raw.get("generation") or {}
    for key in gen:
        if key not in ("max_new_tokens", "temperature", "top_p", "do_sample", "top_k"):
            raise reader.unknown(("generation", key), ["max_new_tokens", "temperature", "top_p"])
    for key in ("max_new_tokens", "temperature", "top_p"):
        if key in gen:
            out["generation"][key] = gen[key]
    if gen.get("do_sample") is False:
        out["generation"]["temperature"] = 0.0
    return out
