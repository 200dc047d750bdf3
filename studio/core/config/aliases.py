"""Other tools' names for Studio's config keys: PEFT's LoraConfig and transformers' TrainingArguments.

People paste what they already know (``lora_alpha``, ``per_device_train_batch_size``); refusing it
teaches nothing, silently accepting it hides that Studio's own key differs. So an alias is read as
Studio's key, with a note naming that key, and ``studio config dump`` writes Studio's names back.
An alias is accepted inside its section (``lora: {lora_alpha: 32}``) and at the top level (a flat
dict of PEFT or TrainingArguments keys).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ALIASES: dict[str, tuple[str, str]] = {
    "lora_alpha": ("lora", "alpha"),
    "lora_dropout": ("lora", "dropout"),
    "lora_r": ("lora", "r"),
    "target_modules": ("lora", "target_modules"),
    "use_dora": ("lora", "use_dora"),
    "use_rslora": ("lora", "use_rslora"),
    "per_device_train_batch_size": ("trainer", "micro_batch_size"),
    "gradient_accumulation_steps": ("trainer", "gradient_accumulation_steps"),
    "num_train_epochs": ("trainer", "epochs"),
    "lr_scheduler_type": ("trainer", "scheduler"),
    "warmup_ratio": ("trainer", "warmup_fraction"),
    "optim": ("trainer", "optimizer"),
    "learning_rate": ("trainer", "learning_rate"),
    "max_steps": ("trainer", "max_steps"),
    "weight_decay": ("trainer", "weight_decay"),
    "max_grad_norm": ("trainer", "max_grad_norm"),
    "seed": ("trainer", "seed"),
    "max_seq_length": ("data", "max_seq_length"),
}
"""PEFT / transformers key -> (Studio section, Studio key)."""

VALUES: dict[tuple[str, str], dict[str, str]] = {
    ("trainer", "scheduler"): {"constant_with_warmup": "constant", "cosine_with_min_lr": "cosine"},
    ("trainer", "optimizer"): {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                               "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_32bit": "paged_adamw",
                               "paged_adam": "paged_adamw"},
}
"""Other tools' value names -> Studio's, for keys whose values are names."""

Note = Callable[[tuple[str, ...], tuple[str, ...], str], None]
"""note(where the key was written, where Studio reads it, message)."""


Report = Callable[[tuple[str, ...], str], None]
"""report(where the key was written, message): a problem, recorded while reading goes on."""


def apply(raw: dict[str, Any], sections: set[str], note: Note, report: Report) -> dict[str, Any]:
    """``raw`` (Studio layout) with aliased keys renamed to Studio's; ``note`` hears each rename.

    ``report(path, message)`` hears a key given under both names (Studio's is kept).
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for key in list(out):
        if key in ALIASES and key not in sections:
            section, name = ALIASES[key]
            target = out.setdefault(section, {})
            if target is None:
                target = out[section] = {}
            if not isinstance(target, dict):
                continue  # config.py reports the section that is not a mapping
            _move(target, name, out.pop(key), (key,), (section, name), note, report)
    for section in sections:
        body = out.get(section)
        if not isinstance(body, dict):
            continue
        for key in list(body):
            if key in ALIASES and ALIASES[key][0] == section and ALIASES[key][1] != key:
                name = ALIASES[key][1]
                _move(body, name, body.pop(key), (section, key), (section, name), note, report)
        for (vsection, vkey), names in VALUES.items():
            value = body.get(vkey) if vsection == section else None
            if isinstance(value, str) and value in names:
                body[vkey] = names[value]
                note((section, vkey), (section, vkey),
                     f"'{section}.{vkey}: {value}' is read as Studio's '{names[value]}'")
    return out


def _move(target: dict[str, Any], name: str, value: Any, old: tuple[str, ...], new: tuple[str, ...],
          note: Note, report: Report) -> None:
    dotted_old, dotted_new = ".".join(old), ".".join(new)
    if name in target:
        report(old, f"'{dotted_old}' and '{dotted_new}' are the same setting; keep one ('{dotted_new}')")
        return
    target[name] = value
    note(old, new, f"'{dotted_old}' is read as Studio's '{dotted_new}'")
