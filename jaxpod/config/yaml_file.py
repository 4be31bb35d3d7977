"""A config file's top-level mapping, read with the bounded YAML loader (`safe_yaml`), every
problem one line that quotes nothing of the file."""

from __future__ import annotations

import os
from collections.abc import Mapping

import yaml

from jaxpod.config.fields import fail
from jaxpod.config.presets import resolve_config
from jaxpod.config.safe_yaml import MAX_YAML, DuplicateKeyError, safe_yaml


def one_line(text: object) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 300 else text[:297] + "..."


def read_yaml_mapping(path: str | os.PathLike, *, allow_empty: bool = True) -> dict:
    """The mapping at the top of a YAML config file or shipped preset (`tiny`), read with the
    bounded loader ({} for an empty file, if `allow_empty`); one-line `ConfigError` if it is
    missing, unreadable, too large, not YAML, uses aliases, gives a key twice, is empty (unless
    allowed) or not a mapping."""
    shown = os.fspath(path)
    path = resolve_config(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_YAML + 1)
    except FileNotFoundError:
        fail(f"config file '{shown}' does not exist; pass a YAML file or a preset name like tiny")
    except IsADirectoryError:
        fail(f"config file '{shown}' is a directory; pass a YAML file or a preset name like tiny")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"config file '{shown}' cannot be read ({type(exc).__name__}); pass a YAML file")
    try:
        raw = safe_yaml(text)
    except DuplicateKeyError as exc:
        fail(f"config file '{shown}': {one_line(exc)}")
    except yaml.YAMLError as exc:
        fail(f"config file '{shown}' does not parse: {_yaml_problem(exc)}")
    if raw is None and allow_empty:
        return {}
    if raw is None:
        fail(
            f"config file '{shown}' is empty (or only comments), which would train every "
            "default; start from a preset such as tiny"
        )
    if not isinstance(raw, Mapping):
        fail(
            f"config file '{shown}' top level must be a mapping of sections, "
            f"not a {type(raw).__name__}"
        )
    return raw


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What the YAML parser says is wrong, and where, without the snippet of the file it
    quotes (a file that is no config, a secret's first line, is never printed)."""
    if not isinstance(exc, yaml.MarkedYAMLError):  # our loader's own words: no snippet
        return one_line(exc)
    mark, problem = exc.problem_mark, exc.problem or exc.context or "not YAML"
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{one_line(problem)}{at}"
