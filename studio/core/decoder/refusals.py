"""What Studio does not describe, and the one line that says so: :class:`Refusal`.

Mixture-of-experts models other than the families core/decoder/families.py describes (Qwen2-MoE,
DeepSeek, DBRX...), state-space / recurrent and encoder-decoder models, and any model_type
without an entry there. A model Studio cannot describe is never sized or run as if it
were a Llama.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

ENCODER_DECODER = {"t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "marian", "whisper", "led",
                   "blenderbot", "prophetnet", "switch_transformers", "encoder-decoder", "seamless_m4t",
                   "t5gemma", "t5gemma2"}
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "recurrent_gemma",
               "bamba", "falcon_h1", "nemotron_h", "lfm2", "xlstm", "qwen3_next", "granitemoehybrid"}
MIXTURE_OF_EXPERTS = {"mixtral", "dbrx", "deepseek_v2", "deepseek_v3", "arctic", "jetmoe"}
SPARSE_DETAILS = {"qwen2_moe": " with a shared expert", "deepseek_v3": " with shared experts and grouped routing"}
"""What an MoE family Studio does not describe has beyond the ones it does, for the refusal's line."""
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
STATE_KEYS = ("ssm_cfg", "state_size", "mamba_d_state", "ssm_state_size", "linear_num_value_heads")


@dataclass(frozen=True)
class Refusal:
    """Why a config.json is not a decoder Studio describes; ``str()`` is the one line a person reads."""

    model_type: str
    """The family refused (config.json's model_type; '' when it names none)."""

    reason: str
    """What it has that Studio does not describe, and what Studio does."""

    def __str__(self) -> str:
        return f"{self.model_type}: {self.reason}" if self.model_type else self.reason


def refusal(config: Mapping, text: Mapping, model_type: str, described: Collection[str],
            supported: str) -> Refusal | None:
    """The Refusal of a config.json (``text``: its text decoder's keys) whose model_type is not in
    ``described``, or that is an encoder-decoder, state-space or mixture-of-experts model; None when
    Studio describes it. ``supported`` names the families that are, for the message."""
    if config.get("is_encoder_decoder") or model_type in ENCODER_DECODER:
        return Refusal(model_type, f"an encoder-decoder model; Studio describes decoder-only causal LMs ({supported})")
    state = next((k for k in STATE_KEYS if text.get(k)), None)
    if model_type in STATE_SPACE or state:
        what = f" ({state}: {text[state]})" if state else ""
        return Refusal(model_type, f"state-space / recurrent layers{what} are not described; Studio describes "
                                   f"attention decoders ({supported})")
    experts = next((k for k in EXPERT_KEYS if text.get(k)), None)
    if (experts or "moe" in model_type or model_type in MIXTURE_OF_EXPERTS) and model_type not in described:
        what = f" ({experts}: {text[experts]})" if experts else ""
        what += SPARSE_DETAILS.get(model_type, "")
        return Refusal(model_type, f"mixture-of-experts layers{what} are not described; Studio describes "
                                   f"{supported}")
    if model_type not in described:
        return Refusal(model_type, f"model_type {model_type!r} has no entry in Studio's decoder description (its "
                                   f"layers may not be Llama's); it describes {supported}")
    return None
