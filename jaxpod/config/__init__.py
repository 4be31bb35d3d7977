"""The run configuration, jax-free: `schema` (the typed, frozen sections), `rules` (validation,
section by section) and `load` (the one loader: YAML, KEY=VALUE overrides, coercion).

Import from here; the submodules are an implementation detail (`load` -> `rules` -> `schema`).
"""

from jaxpod.config.command_line import check_once
from jaxpod.config.load import (
    check_allowed,
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    peek,
    with_overrides,
)
from jaxpod.config.rules import (
    BYTE_VOCAB,
    MAX_DEVICES,
    MAX_PLANNED_DEVICES,
    PATH_DATA,
    parse_bytes,
)
from jaxpod.config.schema import (
    CHOICES,
    DTYPES,
    IMAGE_DATA,
    LIST_CHOICES,
    TEXT_DATA,
    Config,
    DataConfig,
    MemoryConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    TrainConfig,
)
from jaxpod.errors import ConfigError

__all__ = [
    "BYTE_VOCAB",
    "CHOICES",
    "DTYPES",
    "IMAGE_DATA",
    "LIST_CHOICES",
    "MAX_DEVICES",
    "MAX_PLANNED_DEVICES",
    "PATH_DATA",
    "TEXT_DATA",
    "Config",
    "ConfigError",
    "DataConfig",
    "MemoryConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "TrainConfig",
    "check_allowed",
    "check_once",
    "config_from_dict",
    "config_to_dict",
    "dump_yaml",
    "load_config",
    "parse_bytes",
    "peek",
    "with_overrides",
]
