"""The run configuration: typed dataclasses <-> YAML, with other tools' key names accepted.

- ``sections``: :class:`RunConfig` and its sections, every field with its docstring (the config's
  reference);
- ``load``: a config file or YAML text -> a checked :class:`RunConfig` (choices, ranges, the rules
  between keys), Ludwig's layout detected;
- ``reader``: nested YAML data -> the dataclasses by type hints; every problem with file, line and
  key, all reported in one :class:`ConfigError`;
- ``aliases``: PEFT / transformers key names read as Studio's (each with a :class:`ConfigNote`);
- ``ludwig``: Ludwig LLM configs translated;
- ``safe_yaml``: YAML with alias expansion bounded, duplicate keys refused, key lines kept.

Callers import the config's public names from here. Plain Python and PyYAML only: the UI imports this.
"""

from studio.core.config.load import default_config, load_config, parse_config, validate
from studio.core.config.reader import ConfigError, ConfigNote
from studio.core.config.sections import (
    AUTO,
    DEFAULT_MODEL,
    DataConfig,
    DistributedConfig,
    FastPathConfig,
    GenerationConfig,
    GrpoConfig,
    LoraConfig,
    ModelConfig,
    PromptConfig,
    QuantizationConfig,
    RewardConfig,
    RunConfig,
    TrainerConfig,
    effective_batch,
)

__all__ = [
    "AUTO", "DEFAULT_MODEL", "ConfigError", "ConfigNote", "DataConfig", "DistributedConfig", "FastPathConfig",
    "GenerationConfig", "GrpoConfig", "LoraConfig", "ModelConfig", "PromptConfig", "QuantizationConfig",
    "RewardConfig", "RunConfig", "TrainerConfig", "default_config", "effective_batch", "load_config",
    "parse_config", "validate",
]
