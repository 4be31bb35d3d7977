"""Typed, frozen run configuration: a YAML preset plus KEY=VALUE overrides, validated and resolved.

The CLI loads the config *before* jax starts (``devices`` sets XLA_FLAGS), so this module imports
only the standard library and PyYAML. Every mistake raises ``ConfigError`` with one line that names
the field and says the fix.

A *resolved* config (what ``load_config``/``config_from_dict``/``with_overrides`` return) has
``mesh.replica`` filled in (never -1) and ``train.grad_accum``/``train.global_batch`` set to ints.
"""

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from jaxpod.config.rules import (
    BYTE_VOCAB,
    CHOICES,
    DTYPES,
    IMAGE_DATA,
    MAX_DEVICES,
    TEXT_DATA,
    parse_bytes,
    validate_and_resolve,
)
from jaxpod.config.rules import fail as _fail
from jaxpod.errors import ConfigError

__all__ = [  # the constants and parse_bytes live in config_rules; re-exported here
    "BYTE_VOCAB",
    "CHOICES",
    "DTYPES",
    "IMAGE_DATA",
    "MAX_DEVICES",
    "TEXT_DATA",
    "Config",
    "ConfigError",
    "config_from_dict",
    "config_to_dict",
    "dump_yaml",
    "load_config",
    "parse_bytes",
    "with_overrides",
]


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape (replica, pipeline, tensor); replica=-1 fills from the device count."""

    replica: int = -1
    pipeline: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(replica, pipeline, tensor)."""
        return (self.replica, self.pipeline, self.tensor)


@dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters: transformers (gpt, bert) use layers..tie_embeddings and norm;
    efficientnet uses variant..pipeline_splits (and remat)."""

    name: str = "gpt"
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    d_ff: int = 256
    seq_len: int = 64
    vocab: int = 256
    remat: str = "none"
    sequence_chunks: int = 1  # query blocks attended one at a time (divides seq_len)
    sequence_parallel: bool = False  # residual stream split over tensor along the sequence
    tie_embeddings: bool = True
    norm: str = "pre"  # bert: pre- or post-LayerNorm blocks
    variant: str = "b0"  # efficientnet compound-scaling preset
    g16: bool = False  # grouped (16 channels/group) instead of depthwise convs, expansion 4
    norm_groups: int = 4  # GroupNorm groups
    width_mult: float | None = None  # override the variant's width coefficient
    depth_mult: float | None = None  # override the variant's depth coefficient
    image_size: int = 32
    num_classes: int = 10
    pipeline_splits: tuple[str, ...] = ()  # block names where stages 1.. start, e.g. [4a]


@dataclass(frozen=True)
class TrainConfig:
    """Loop, batch and logging settings; global_batch = micro_batch * mesh.replica * grad_accum."""

    steps: int = 100
    micro_batch: int = 4
    grad_accum: int | None = None
    global_batch: int | None = None
    # micro-batches per GPipe pass (pipeline > 1): the step runs grad_accum / pipeline_group
    # pipeline passes and sums their gradients; null: one pass of all grad_accum
    pipeline_group: int | None = None
    seed: int = 0
    logdir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 50  # 0 disables periodic eval (a final eval always runs)
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0 saves only the final step (which is always saved)
    keep_checkpoints: int = 3  # newest checkpoints kept under <logdir>/checkpoints/
    profile_steps: tuple[int, ...] | None = None  # [start, stop): trace these steps


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; grad_clip is a global-norm clip (0 disables)."""

    name: str = "adamw"
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.9
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    power: float = 1.0  # polynomial schedule: lr * (1 - progress) ** power after warm-up
    end_lr: float = 0.0  # polynomial schedule's final learning rate
    trust_coefficient: float = 0.001  # lars


@dataclass(frozen=True)
class DataConfig:
    """Dataset choice; path is required for text-files and must be None otherwise."""

    name: str = "stdlib-code"
    path: str | None = None
    val_fraction: float = 0.05
    prefetch: int = 3  # batches prepared ahead by a background thread (0: synchronous)


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: weight, compute and master dtypes; loss scaling.

    `master=same-as-params` with 16-bit params keeps no float32 copy: updates are applied
    with stochastic rounding. A dynamic loss scale grows x2 after `loss_scale_period` finite
    steps and halves on overflow (the step is skipped)."""

    params: str = "float32"
    compute: str = "float32"
    master: str = "float32"
    loss_scale: str = "none"
    loss_scale_init: float = 32768.0
    loss_scale_period: int = 2000


@dataclass(frozen=True)
class MemoryConfig:
    """Where bytes live: device profile, replicated tensor sharding, host offload, phases."""

    device: str = "cpu"
    rts: int = 1  # weights of each stage sharded over this many replicas
    rts_optimizer: int | None = None  # optimizer state sharded over this many (None: = rts)
    offload: tuple[str, ...] = ()  # of optimizer, params, activations
    phases: int = 1  # the layers of a stage run in this many phases, streamed from host
    stream: str = "layer"  # unit a weight is prepared (fetched/gathered) in: layer or matrix
    mlp_blocks: int = 1  # with stream=matrix: the MLP's matrices in this many blocks
    vocab_blocks: int = 1  # GPT: the token table used (and RTS-gathered) this many rows at a time
    device_budget: str | None = None  # e.g. 900MB, 16GiB: refuse mappings that exceed it


@dataclass(frozen=True)
class Config:
    """The whole run configuration."""

    devices: int = 8
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step (resolved configs only)."""
        if self.train.global_batch is None:
            raise ValueError("config is not resolved; build it with load_config/config_from_dict")
        return self.train.global_batch

    @property
    def pipeline_group(self) -> int:
        """Micro-batches per GPipe pass: `train.pipeline_group`, or all of `grad_accum`."""
        return self.train.pipeline_group or self.train.grad_accum

    @property
    def pipeline_passes(self) -> int:
        """GPipe passes per optimizer step: `grad_accum / pipeline_group` (pipeline > 1)."""
        return self.train.grad_accum // self.pipeline_group

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: global_batch * model.seq_len."""
        return self.global_batch * self.model.seq_len

    @property
    def is_vision(self) -> bool:
        """True for image classifiers (efficientnet), False for token models."""
        return self.model.name == "efficientnet"

    def warnings(self) -> list[str]:
        """Legal but risky settings, one line each (the CLI prints them)."""
        out = []
        if self.precision.params == "float16" and self.precision.loss_scale == "none":
            out.append(
                "precision.params=float16 with precision.loss_scale=none: small gradients "
                "underflow to zero in float16; set precision.loss_scale=dynamic"
            )
        if (
            self.precision.master == "same-as-params"
            and self.precision.params != "float32"
            and self.optim.name in ("adamw", "lamb")
        ):
            out.append(
                f"optim.name={self.optim.name} with 16-bit master weights keeps its second "
                f"moments (g^2) in {self.precision.params}, where small values underflow; "
                "prefer optim.name=lars or sgd, or precision.master=float32"
            )
        return out


SECTIONS: dict[str, type] = {
    f.name: f.type for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type)
}  # section name -> dataclass: mesh, model, train, optim, data, precision, memory


def _collect_field_types() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(Config).items():
        if name in SECTIONS:
            for sub, sub_tp in typing.get_type_hints(SECTIONS[name]).items():
                out[f"{name}.{sub}"] = sub_tp
        else:
            out[name] = tp
    return out


FIELD_TYPES: dict[str, Any] = _collect_field_types()  # dotted key -> annotated type
TOP_LEVEL: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Config))


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _unknown(key: str) -> typing.NoReturn:
    section, _, sub = key.partition(".")
    if section in SECTIONS and sub:  # compare field names only: the shared prefix is not evidence
        names = [k.split(".", 1)[1] for k in FIELD_TYPES if k.startswith(section + ".")]
        close = [f"{section}.{c}" for c in difflib.get_close_matches(sub, names, n=1)]
        valid = f"valid keys in {section}: " + ", ".join(names)
    else:
        candidates = [*TOP_LEVEL, *(k for k in FIELD_TYPES if "." in k)]
        close = difflib.get_close_matches(key, candidates, n=1)
        valid = "valid top-level keys: " + ", ".join(TOP_LEVEL)
    hint = f"did you mean '{close[0]}'?" if close else valid
    _fail(f"unknown config key '{key}'; {hint}")


def _coerce(key: str, value: object, tp: Any) -> object:
    """Check/convert one value against its annotated type."""
    if isinstance(tp, types.UnionType):
        if value is None:
            return None
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        nullable = " or null"
    else:
        nullable = ""
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, str | int) and not isinstance(value, bool):
            value = [value]  # a single item, e.g. memory.offload=optimizer
        if not isinstance(value, list | tuple):
            _fail(f"{key}={value!r} must be a list, e.g. {key}=[a,b]{nullable}")
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(f"{key}={value!r} must be true or false{nullable}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(f"{key}={value!r} must be an integer{nullable}")
    if tp is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads '3e-4' (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is None:
            _fail(f"{key}={value!r} must be a number (e.g. 3e-4){nullable}")
        if not math.isfinite(number):
            _fail(f"{key}={value!r} must be a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if (
            key in _NUMBER_AS_TEXT
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            return str(value)
        _fail(f"{key}={value!r} must be a string{nullable}; quote it in YAML")
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # pragma: no cover


_NUMBER_AS_TEXT = ("memory.device_budget",)  # text fields that may be given as a plain number


def _normalize(raw: object) -> dict[str, Any]:
    """Check the nested structure and keys; return {top-level scalar: value, section: {...}}."""
    if not isinstance(raw, Mapping):
        _fail(f"config top level must be a mapping of sections, not a {type(raw).__name__}")
    out: dict[str, Any] = {name: {} for name in SECTIONS}
    for key, value in raw.items():
        key = str(key)
        if key in SECTIONS:
            if value is None:  # an empty section, e.g. every key commented out
                continue
            if not isinstance(value, Mapping):
                _fail(
                    f"config section '{key}' must be a mapping (e.g. {key}: {{...}}), got {value!r}"
                )
            for sub, sub_value in value.items():
                dotted = f"{key}.{sub}"
                if dotted not in FIELD_TYPES:
                    _unknown(dotted)
                out[key][str(sub)] = sub_value
        elif key in FIELD_TYPES:
            out[key] = value
        else:
            _unknown(key)
    return out


def _check_key(key: str, shown: str) -> None:
    if key in SECTIONS:
        _fail(
            f"override '{shown}' sets section '{key}' to a value; set one of its fields instead, "
            f"e.g. {next(k for k in FIELD_TYPES if k.startswith(key + '.'))}=..."
        )
    if key not in FIELD_TYPES:
        _unknown(key)


def _parse_override(text: str) -> tuple[str, object]:
    """Parse 'dotted.key=VALUE'; VALUE is a YAML scalar."""
    if not isinstance(text, str) or "=" not in text or not text.partition("=")[0].strip():
        _fail(f"override {text!r} is not KEY=VALUE (e.g. mesh.tensor=2)")
    key, _, raw = text.partition("=")
    key = key.strip()
    _check_key(key, text)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        _fail(f"override '{text}' value does not parse as YAML: {_one_line(exc)}")
    is_str_field = str in (FIELD_TYPES[key], *typing.get_args(FIELD_TYPES[key]))
    if is_str_field and value is not None and not isinstance(value, str | list | dict):
        value = raw.strip()  # e.g. train.logdir=2024 or model.remat=off: keep the text
    return key, value


def _set(d: dict[str, Any], key: str, value: object) -> None:
    if "." in key:
        section, sub = key.split(".", 1)
        d[section][sub] = value
    else:
        d[key] = value


def _build(d: dict[str, Any]) -> Config:
    """Coerce a normalized dict into dataclasses, then validate and resolve."""
    sections = {
        name: cls(
            **{k: _coerce(f"{name}.{k}", v, FIELD_TYPES[f"{name}.{k}"]) for k, v in d[name].items()}
        )
        for name, cls in SECTIONS.items()
    }
    scalars = {k: _coerce(k, v, FIELD_TYPES[k]) for k, v in d.items() if k not in SECTIONS}
    return validate_and_resolve(Config(**scalars, **sections))


def _read_yaml(path: str | os.PathLike) -> object:
    shown = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        _fail(f"config file '{shown}' does not exist; pass a path like configs/tiny.yaml")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"config file '{shown}' cannot be read ({type(exc).__name__}); pass a YAML file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        _fail(f"config file '{shown}' does not parse: {_one_line(exc)}")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        _fail(
            f"config file '{shown}' top level must be a mapping of sections, "
            f"not a {type(raw).__name__}"
        )
    return raw


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML preset (None = defaults), apply KEY=VALUE overrides, validate and resolve."""
    d = _normalize({} if path is None else _read_yaml(path))
    for text in [overrides] if isinstance(overrides, str) else overrides:
        _set(d, *_parse_override(text))
    return _build(d)


def config_from_dict(d: Mapping[str, Any]) -> Config:
    """Build a validated, resolved Config from a nested dict (as from ``config_to_dict``)."""
    return _build(_normalize(d))


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain dict of every field (lists for tuples); round-trips through
    ``config_from_dict`` and ``yaml.safe_dump``."""
    return dataclasses.asdict(cfg, dict_factory=lambda kv: {k: _plain(v) for k, v in kv})


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def with_overrides(cfg: Config, overrides: Sequence[str] | Mapping[str, object]) -> Config:
    """Return a new validated config with dotted overrides applied.

    Strings are parsed like CLI overrides (``"mesh.tensor=2"``); mapping values are used as is
    (``{"mesh.tensor": 2}``). A resolved config no longer knows which batch/mesh sizes were
    derived, so ``mesh.replica`` is re-filled from devices and ``train.global_batch`` re-derived
    from ``grad_accum`` unless the overrides set them (setting only ``train.global_batch``
    re-derives ``train.grad_accum`` instead).
    """
    if isinstance(overrides, Mapping):
        pairs = [(str(k), v) for k, v in overrides.items()]
        for key, _ in pairs:
            _check_key(key, f"{key}=...")
    else:
        pairs = [
            _parse_override(t) for t in ([overrides] if isinstance(overrides, str) else overrides)
        ]
    d = _normalize(config_to_dict(cfg))
    keys = {k for k, _ in pairs}
    if "mesh.replica" not in keys:
        d["mesh"]["replica"] = -1
    if "train.global_batch" not in keys:
        d["train"]["global_batch"] = None
    elif "train.grad_accum" not in keys:
        d["train"]["grad_accum"] = None
    for key, value in pairs:
        _set(d, key, value)
    return _build(d)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML text (loads back to an equal config)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
