"""The one config loader: a YAML preset plus KEY=VALUE overrides, coerced, validated, resolved.

Everything that reads a config file goes through here: `load_config` for the whole validated
`Config` (`config_maker` for many of one preset), `peek` for one value before the rest can be
checked (the CLI needs `devices` and `train.logdir` before jax starts or the process count is
known). An unknown key gets a one-line ``ConfigError`` with the closest key. `processes` is
not a key: the caller passes it, and dumps leave it out, so a dumped config.yaml loads back
as it was written.

A *resolved* config has ``mesh.replica`` filled in (never -1), ``train.grad_accum`` and
``train.global_batch`` set to ints, ``~`` in the path keys (`PATHS`) expanded. YAML is read by
a bounded loader (`safe_yaml`): no aliases (a few hundred bytes of nested aliases expand to
gigabytes), no key given twice in a mapping, at most `MAX_YAML` bytes. `allow_empty=False`
(what `jaxpod train` asks) refuses an empty config file, which would silently train defaults.
"""

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import yaml

from jaxpod.config.rules import MAX_DEVICES, fail, get, validate_and_resolve
from jaxpod.config.safe_yaml import safe_yaml
from jaxpod.config.schema import ARGUMENTS, SECTIONS, Config
from jaxpod.config.yaml_file import one_line as _one_line
from jaxpod.config.yaml_file import read_yaml_mapping


def _collect_field_types() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tp in typing.get_type_hints(Config).items():
        if name in SECTIONS:
            for sub, sub_tp in typing.get_type_hints(SECTIONS[name]).items():
                out[f"{name}.{sub}"] = sub_tp
        elif name not in ARGUMENTS:
            out[name] = tp
    return out


FIELD_TYPES: dict[str, Any] = _collect_field_types()  # dotted key -> annotated type
TOP_LEVEL: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Config) if f.name not in ARGUMENTS
)  # devices and the section names

_NUMBER_AS_TEXT = ("memory.device_budget",)  # text fields that may be given as a plain number
PATHS = ("train.logdir", "data.path", "data.tokenizer")  # keys whose leading ~ is expanded


def _shown(value: object) -> str:
    """`repr(value)`, cut to a readable length (a message never prints an unbounded value)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:45] + "..." + text[-12:]


KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,59}")


def _unknown(key: str) -> typing.NoReturn:
    if key == "processes":
        fail(
            "unknown config key 'processes'; the process count comes from --num-processes (or "
            "the cluster), and devices counts the devices of each process"
        )
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
    if not KEY_NAME.fullmatch(key):  # not a key name: a file that is no config, never shown
        fail(f"a config key that is not a key name (not shown); {valid}: is this a jaxpod config?")
    fail(f"unknown config key '{key}'; {hint}")


NAME_MAX, PATH_MAX = 255, 4095  # bytes of one name in a path, and of a whole path (Linux)


def _check_path(key: str, path: str) -> None:
    """One-line `ConfigError` for a path no filesystem takes: a NUL byte, a name over 255
    bytes, a path over 4095. A URL (`gs://...`) is read through fsspec, checked where it is
    read (`jaxpod.data.store`, `jaxpod.run.remote`)."""
    if "\0" in path:
        fail(f"{key}={_shown(path)} holds a NUL byte, which no path can; remove it")
    if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", path):
        return
    names = path.encode("utf-8", "surrogateescape").split(b"/")
    if max(map(len, names)) > NAME_MAX or len(path.encode("utf-8", "surrogateescape")) > PATH_MAX:
        fail(
            f"{key}={_shown(path)} is too long (a name in a path holds at most {NAME_MAX} "
            f"bytes, a path {PATH_MAX}); use a shorter name"
        )


def _is_text(tp: Any) -> bool:
    """A str field, or a Literal of strings (a choice, checked by the rules)."""
    return tp is str or typing.get_origin(tp) is Literal


def _coerce(key: str, value: object, tp: Any) -> object:
    """Check/convert one value against its annotated type."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
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
            fail(f"{key}={_shown(value)} must be a list, e.g. {key}=[a,b]{nullable}")
        return tuple(_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail(f"{key}={_shown(value)} must be true or false{nullable}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        fail(f"{key}={_shown(value)} must be an integer{nullable}")
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
            fail(f"{key}={_shown(value)} must be a number (e.g. 3e-4){nullable}")
        if not math.isfinite(number):
            fail(f"{key}={_shown(value)} must be a finite number")
        return number
    if _is_text(tp):
        if isinstance(value, str):
            return value
        if (
            key in _NUMBER_AS_TEXT
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            return str(value)
        fail(f"{key}={_shown(value)} must be a string{nullable}; quote it in YAML")
    raise TypeError(f"unsupported config field type {tp!r} for {key}")  # pragma: no cover


def _normalize(raw: object) -> dict[str, Any]:
    """Check the nested structure and keys; return {top-level scalar: value, section: {...}}."""
    if not isinstance(raw, Mapping):
        fail(f"config top level must be a mapping of sections, not a {type(raw).__name__}")
    out: dict[str, Any] = {name: {} for name in SECTIONS}
    for key, value in raw.items():
        key = str(key)
        if key in SECTIONS:
            if value is None:  # an empty section, e.g. every key commented out
                continue
            if not isinstance(value, Mapping):
                fail(
                    f"config section '{key}' must be a mapping (e.g. {key}: {{...}}), "
                    f"got {_shown(value)}"
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
        fail(
            f"override '{shown}' sets section '{key}' to a value; set one of its fields instead, "
            f"e.g. {next(k for k in FIELD_TYPES if k.startswith(key + '.'))}=..."
        )
    if key not in FIELD_TYPES:
        _unknown(key)


def _parse_override(text: str) -> tuple[str, object]:
    """Parse 'dotted.key=VALUE'; VALUE is a YAML scalar."""
    if not isinstance(text, str) or "=" not in text or not text.partition("=")[0].strip():
        fail(f"override {_shown(text)} is not KEY=VALUE (e.g. mesh.tensor=2)")
    key, _, raw = text.partition("=")
    key = key.strip()
    _check_key(key, _shown(text)[1:-1])
    try:
        value = safe_yaml(raw)
    except yaml.YAMLError as exc:
        fail(f"override {_shown(text)} value does not parse as YAML: {_one_line(exc)}")
    tp = FIELD_TYPES[key]
    is_text_field = _is_text(tp) or any(_is_text(a) for a in typing.get_args(tp))
    if is_text_field and value is not None and not isinstance(value, str | list | dict):
        value = raw.strip()  # e.g. train.logdir=2024 or model.remat=off: keep the text
    return key, value


def _set(d: dict[str, Any], key: str, value: object) -> None:
    if "." in key:
        section, sub = key.split(".", 1)
        d[section][sub] = value
    else:
        d[key] = value


def _typed(d: dict[str, Any], processes: int) -> Config:
    """Coerce a normalized dict into the dataclasses (types checked, rules not yet)."""
    for key in PATHS:
        section, sub = key.split(".")
        if isinstance(d[section].get(sub), str):
            _check_path(key, d[section][sub])
            if d[section][sub].startswith("~"):  # never a URL's
                d[section][sub] = os.path.expanduser(d[section][sub])
    sections = {
        name: cls(
            **{k: _coerce(f"{name}.{k}", v, FIELD_TYPES[f"{name}.{k}"]) for k, v in d[name].items()}
        )
        for name, cls in SECTIONS.items()
    }
    scalars = {k: _coerce(k, v, FIELD_TYPES[k]) for k, v in d.items() if k not in SECTIONS}
    return Config(**scalars, **sections, processes=processes)


def _build(d: dict[str, Any], processes: int, max_devices: int = MAX_DEVICES) -> Config:
    """Coerce a normalized dict into dataclasses, then validate and resolve."""
    return validate_and_resolve(_typed(d, processes), max_devices)


def _read(
    path: str | os.PathLike | None, overrides: Sequence[str] | str, allow_empty: bool = True
) -> dict[str, Any]:
    """The normalized dict of a YAML preset (None = defaults) with the overrides applied."""
    d = _normalize({} if path is None else read_yaml_mapping(path, allow_empty=allow_empty))
    for text in [overrides] if isinstance(overrides, str) else overrides:
        _set(d, *_parse_override(text))
    return d


def load_config(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    *,
    processes: int = 1,
    allow_empty: bool = True,
    max_devices: int = MAX_DEVICES,
) -> Config:
    """Read a YAML preset (None = defaults), apply KEY=VALUE overrides, validate and resolve.

    `processes`: how many processes share the mesh, each with `devices` devices;
    `allow_empty=False` refuses an empty file; `max_devices`: `MAX_DEVICES` for what runs
    here, `MAX_PLANNED_DEVICES` for the commands that only plan."""
    return config_maker(path, overrides, processes, allow_empty, max_devices)(())


def config_maker(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    processes: int = 1,
    allow_empty: bool = True,
    max_devices: int = MAX_DEVICES,
) -> Callable[[Sequence[str]], Config]:
    """`make(more)`: `load_config(path, [*overrides, *more], ...)`, the YAML read once."""
    raw = _read(path, overrides, allow_empty)
    parsed = functools.lru_cache(maxsize=4096)(_parse_override)  # many mappings share values

    def make(more: Sequence[str]) -> Config:
        d = copy.deepcopy(raw)
        for text in more:
            key, value = parsed(text)
            _set(d, key, copy.deepcopy(value))
        return _build(d, processes, max_devices)

    return make


def check_allowed(keys: Sequence[str]) -> None:
    """One-line `ConfigError` for a key of `--allow-changes` that is no config key, section or
    `all` (it would allow nothing, silently)."""
    for key in keys:
        if key == "all" or key in SECTIONS or key in FIELD_TYPES:
            continue
        close = difflib.get_close_matches(key, [*SECTIONS, *FIELD_TYPES], n=1)
        hint = f"did you mean '{close[0]}'?" if close else "name keys (train.steps), sections"
        fail(f"--allow-changes {_shown(key)[1:-1]} is no config key; {hint} (or all)")


def peek(path: str | os.PathLike | None, overrides: Sequence[str], key: str) -> Any:
    """The value `load_config(path, overrides)` gives the dotted `key` (the last override,
    else the YAML's, else the default), before the rules that relate fields (or need the
    process count) run: a file, key or value of the wrong type is refused as by `load_config`."""
    if key not in FIELD_TYPES:
        raise KeyError(key)
    return get(_typed(_read(path, overrides), processes=1), key)


def config_from_dict(d: Mapping[str, Any], *, processes: int = 1) -> Config:
    """Build a validated, resolved Config from a nested dict (as from ``config_to_dict``)."""
    return _build(_normalize(d), processes)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Nested plain dict of every key (lists for tuples; not `processes`, which is no key);
    round-trips through ``config_from_dict`` and ``yaml.safe_dump``."""
    out = dataclasses.asdict(cfg, dict_factory=lambda kv: {k: _plain(v) for k, v in kv})
    return {k: v for k, v in out.items() if k not in ARGUMENTS}


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def with_overrides(cfg: Config, overrides: Sequence[str] | Mapping[str, object]) -> Config:
    """Return a new validated config with dotted overrides applied (same `processes`).

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
    return _build(d, cfg.processes)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML text (loads back to an equal config, given the same `processes`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
