"""Presets found by name: `jaxpod train tiny` reads the file `configs/tiny.yaml` names, an
existing file wins over a name, and a name that is neither gets one line with the closest."""

from __future__ import annotations

import pytest
from helpers import CONFIGS, ROOT

from jaxpod.config import ConfigError, load_config
from jaxpod.config.presets import PRESETS, preset_names, resolve_config


def test_the_repository_configs_are_the_package_presets():
    """One source: `configs/` in the checkout is the package's `jaxpod/configs/`."""
    assert CONFIGS.resolve() == PRESETS == ROOT / "jaxpod" / "configs"
    assert preset_names() == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert {"tiny", "demo", "efficientnet_digits"} <= set(preset_names())


@pytest.mark.parametrize("name", ["tiny", "tiny.yaml", "demo"])
def test_a_name_loads_its_preset_from_anywhere(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    stem = name.removesuffix(".yaml")
    assert load_config(name) == load_config(CONFIGS / f"{stem}.yaml")
    assert resolve_config(name) == PRESETS / f"{stem}.yaml"


def test_an_existing_file_wins_over_a_preset_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").write_text("devices: 2\nmesh: {replica: 2, pipeline: 1, tensor: 1}\n")
    assert load_config("tiny").devices == 2
    assert load_config(CONFIGS / "tiny.yaml").devices == 8


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("tinyy", "config file 'tinyy' does not exist and names no preset; did you mean 'tiny'?"),
        # a path is a path: outside a checkout `configs/tiny.yaml` is missing, and said so
        (
            "elsewhere/tiny.yaml",
            "config file 'elsewhere/tiny.yaml' does not exist and names no preset; "
            "did you mean 'tiny'?",
        ),
        ("zzz", "names no preset; presets: bert_large_pod16, "),
    ],
)
def test_neither_file_nor_preset_is_one_line(given, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        load_config(given)
    message = str(exc.value)
    assert expected in message and "\n" not in message


def test_a_directory_is_refused_unless_it_is_a_preset_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "mine").mkdir()
    assert load_config("tiny") == load_config(CONFIGS / "tiny.yaml")
    with pytest.raises(ConfigError, match="'mine' is a directory; pass a YAML file or a preset"):
        load_config("mine")
