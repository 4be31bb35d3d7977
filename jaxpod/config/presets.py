"""The presets shipped with the package (`jaxpod/configs/*.yaml`), found by name.

`jaxpod train tiny` and `jaxpod train configs/tiny.yaml` read the same file: an argument that
names an existing file is that file; one without a directory part that names a preset (`tiny`,
`tiny.yaml`) is the preset. The repository's `configs/` is a link to `jaxpod/configs/`, so the
README's paths work in a checkout and the names work wherever the package is installed.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from jaxpod.config.fields import fail

PRESETS = Path(__file__).resolve().parents[1] / "configs"
# The full-size TPU presets and the slice each is meant for (their comments say the same):
# `--target` for `jaxpod compile`, the figures and benchmarks/bench_tpu.py.
TPU_SLICES = {
    "bert_large_tpu_v5p": "tpu-v5p:2x2x4",
    "efficientnet_b4_g16_tpu_v5e16": "tpu-v5e:4x4",
    "efficientnet_b4_g16_tpu_v5e256": "tpu-v5e:16x16",
    "gpt3_175b_tpu_v5p": "tpu-v5p:8x8x4",
    "llama3_8b_tpu_v5p": "tpu-v5p:4x4x4",
}
_SUFFIXES = (".yaml", ".yml")


def preset_names() -> list[str]:
    """The names of the shipped presets, sorted (`["bert_large_pod16", ..., "tiny"]`)."""
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _stem(name: str) -> str:
    """`tiny.yaml` -> `tiny`."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def preset_path(name: str) -> Path | None:
    """The shipped preset called `name` (with or without `.yaml`), or None."""
    stem = _stem(name)
    return PRESETS / f"{stem}.yaml" if stem in preset_names() else None


def resolve_config(path: str | os.PathLike) -> Path:
    """The file a CONFIG argument means: an existing path as given, else the preset it names.

    One-line `ConfigError` when it is neither, naming the closest preset (or listing them)."""
    given = Path(path)
    if given.is_file():
        return given
    text = os.fspath(path)
    bare = given.name == text  # no directory part: a name, not a path
    if bare and (found := preset_path(text)) is not None:
        return found
    if given.is_dir():
        fail(f"config file '{text}' is a directory; pass a YAML file or a preset name like tiny")
    names = preset_names()
    close = difflib.get_close_matches(_stem(given.name), names, n=1)
    hint = f"did you mean '{close[0]}'?" if close else "presets: " + ", ".join(names)
    fail(f"config file '{text}' does not exist and names no preset; {hint}")
