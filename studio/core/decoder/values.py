"""Reading a family's facts off config.json the way transformers' config classes do: shared by every
family entry of core/decoder/families.py.

A config.json holds what its checkpoint set; the config class fills in the rest (its defaults and
its ``__post_init__``). Both spellings are read: the Hub's older keys (``rope_theta`` and
``rope_scaling``, no ``layer_types``) and what ``PreTrainedConfig.to_dict()`` writes in
transformers 5.x (``rope_parameters``, nested per layer type for Gemma 3; ``layer_types`` spelled
out), which is what the engine passes for a loaded model.

Plain Python: the UI imports this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from studio.core.decoder.spec import ATTENTION_PROJECTIONS, MLP_PROJECTIONS, LayerSpec, RopeSpec

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""The sizes Studio will not guess: a config.json without them is refused (unless its family's
checkpoints leave one to the config class, as Gemma 3's text_config does)."""


class Values:
    """One family's view of a config.json: the text decoder's keys over its config class's defaults."""

    def __init__(self, config: Mapping, text: Mapping, defaults: Mapping[str, object], model_type: str,
                 family: str, config_path: tuple[str, ...]) -> None:
        self.config = config
        """The whole config.json (a multimodal checkpoint's outer one)."""
        self.text = text
        """The text decoder's keys (``config`` itself, or its ``text_config``)."""
        self.defaults = defaults
        self.model_type = model_type
        self.family = family
        self.config_path = config_path

    def get(self, key: str) -> object:
        """The value transformers' config class would hold: config.json's (an explicit null
        included: Mistral-7B-v0.3's ``sliding_window: null`` is no window, not the default 4096),
        else the class's default (None when it has none)."""
        return self.text[key] if key in self.text else self.defaults.get(key)

    def int(self, key: str) -> int:
        """An integer value (:meth:`get`)."""
        return int(self.get(key))  # type: ignore[arg-type]

    def float(self, key: str) -> float:
        """A float value (:meth:`get`)."""
        return float(self.get(key))  # type: ignore[arg-type]

    def flag(self, key: str) -> bool:
        """A boolean value (:meth:`get`; null is False)."""
        return bool(self.get(key))

    def optional_float(self, key: str) -> float | None:
        """A float, or None where config.json or the class says null (soft-caps)."""
        value = self.get(key)
        return None if value is None else float(value)  # type: ignore[arg-type]

    def missing(self, implied: tuple[str, ...] = ()) -> list[str]:
        """:data:`REQUIRED_KEYS` config.json lacks (or nulls), but for those the family's checkpoints
        leave to the class's defaults (``implied``)."""
        return [key for key in REQUIRED_KEYS if self.text.get(key) is None and key not in implied]

    def kv_heads(self) -> int:
        """``num_key_value_heads``; null means one per query head (every family's ``__post_init__``)."""
        value = self.get("num_key_value_heads")
        return self.int("num_attention_heads") if value is None else int(value)  # type: ignore[arg-type]

    def head_dim(self) -> int:
        """``head_dim`` where given (or a class default: Qwen3 128, Gemma 256), else hidden / heads."""
        value = self.get("head_dim")
        if value:
            return int(value)  # type: ignore[call-overload]
        return self.int("hidden_size") // self.int("num_attention_heads")

    def biases(self, attention: tuple[str, ...] = ATTENTION_PROJECTIONS,
               mlp: tuple[str, ...] = MLP_PROJECTIONS) -> tuple[str, ...]:
        """The modules ``attention_bias`` and ``mlp_bias`` put a bias on (q/k/v/o and gate/up/down
        where the family's modules read them: Llama, SmolLM3, Granite; pass () for a flag the family
        ignores: Qwen3, Gemma and OLMo 2 read only attention_bias)."""
        return (attention if self.flag("attention_bias") else ()) + (mlp if self.flag("mlp_bias") else ())

    def layer_types(self, default: Callable[[int], str]) -> list[str]:
        """``layer_types`` as given, else the pattern the class's ``__post_init__`` fills in."""
        n = self.int("num_hidden_layers")
        given = self.get("layer_types")
        if isinstance(given, list) and len(given) >= n:
            return [str(t) for t in given[:n]]
        return [default(i) for i in range(n)]


def _rope(params: Mapping, theta: object, rotary_dim: int, renames: Mapping[str, str]) -> RopeSpec:
    kind = str(params.get("rope_type", params.get("type", "default")))
    return RopeSpec(renames.get(kind, kind), float(params.get("rope_theta", theta)), rotary_dim)  # type: ignore[arg-type]


def rope_table(v: Values, head_dim: int, partial: bool = False, renames: Mapping[str, str] | None = None) -> RopeSpec:
    """The one RoPE table of a family whose rotary module computes one. ``partial``: the family
    rotates only ``partial_rotary_factor`` of each head (Phi-3); the others rotate all of it
    whatever the config says. ``renames``: rope types the class renames (Phi-3's su / yarn are longrope)."""
    params = v.get("rope_parameters")
    if not isinstance(params, Mapping) or not params:
        scaling = v.get("rope_scaling")
        params = scaling if isinstance(scaling, Mapping) else {}
    theta = v.get("rope_theta")
    factor = params.get("partial_rotary_factor", v.get("partial_rotary_factor")) if partial else None
    rotary_dim = int(head_dim * float(factor)) if factor is not None else head_dim  # type: ignore[arg-type]
    return _rope(params, theta, rotary_dim, renames or {})


def layer_type_tables(v: Values, head_dim: int, scaled: str, local_theta_key: str) -> dict[str, RopeSpec]:
    """RoPE tables by layer type (Gemma 3): transformers 5.x nests ``rope_parameters`` under each
    layer type; an older config.json gives the global table as ``rope_theta`` and ``rope_scaling``
    (applied to the ``scaled`` type: full_attention) and the local base as ``local_theta_key``."""
    params = v.get("rope_parameters")
    types = ("full_attention", "sliding_attention")
    if isinstance(params, Mapping) and any(isinstance(params.get(t), Mapping) for t in types):
        return {t: _rope(params.get(t) or {}, v.get("rope_theta" if t == scaled else local_theta_key), head_dim, {})
                for t in types}
    scaling = v.get("rope_scaling")
    full = {"rope_type": "default", **(scaling if isinstance(scaling, Mapping) else {})}
    return {t: _rope(full, v.get("rope_theta"), head_dim, {}) if t == scaled
            else _rope({}, v.get(local_theta_key), head_dim, {}) for t in types}


def uniform_layers(v: Values, rope: RopeSpec, window: int | None = None) -> tuple[LayerSpec, ...]:
    """Every layer alike: full attention, or ``window`` on each (Mistral, Phi-3), one RoPE table."""
    attention = "full_attention" if window is None else "sliding_attention"
    return tuple(LayerSpec(attention, window, rope, None) for _ in range(v.int("num_hidden_layers")))


def typed_layers(types: list[str], window: int | None, rope: Callable[[int, str], RopeSpec | None],
                 rope_key: bool = False) -> tuple[LayerSpec, ...]:
    """Layers by ``layer_types``: sliding ones attend within ``window``; ``rope(i, type)`` is the
    layer's table (None: no RoPE); ``rope_key`` passes the type to the rotary module (Gemma 3)."""
    return tuple(LayerSpec(t, window if t == "sliding_attention" else None, rope(i, t), t if rope_key else None)
                 for i, t in enumerate(types))
