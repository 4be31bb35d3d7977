"""What `pip install jaxpod` promises, read from pyproject.toml, constraints.txt and the
Makefile (no build, no jax; tests/cli/test_wheel_cli.py builds and installs the wheel): one
version, compatible ranges for a user's install, the tested versions locked for `make`."""

from __future__ import annotations

import re
import tomllib

import pytest
from helpers import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import jaxpod
from jaxpod.cli import main

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCK = ROOT / "constraints.txt"


def _locked() -> dict[str, Version]:
    out = {}
    for line in LOCK.read_text().splitlines():
        text = line.split("#")[0].strip()
        if text:
            name, _, version = text.partition("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = PROJECT["project"]
    texts = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(t) for t in texts]


def test_one_version_source(capsys, in_process_cli):
    assert "version" not in PROJECT["project"] and PROJECT["project"]["dynamic"] == ["version"]
    dynamic = PROJECT["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "jaxpod.__version__"}
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"jaxpod {jaxpod.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", jaxpod.__version__)


def test_apache_licence():
    assert PROJECT["project"]["license"] == "Apache-2.0"
    assert PROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


@pytest.mark.parametrize("extra", [None, "tpu", "cuda", "gpu-target", "data", "notebooks"])
def test_a_users_install_takes_ranges(extra):
    """Each runtime (or user extra's) requirement has a lower and an upper bound, no pin."""
    for req in _requirements(extra):
        ops = {s.operator for s in req.specifier}
        assert ops == {">=", "<"}, f"{req}: give a compatible range (>=, <), not {ops}"


def test_the_lock_pins_every_requirement_inside_its_range():
    """`make` installs constraints.txt: every package the ranges name is locked there, at a
    version the range allows (a lock that falls outside a range would never be installed)."""
    locked = _locked()
    extras = ["tpu", "cuda", "gpu-target", "data", "notebooks", "dev"]
    for req in [*_requirements(), *(r for e in extras for r in _requirements(e))]:
        name = canonicalize_name(req.name)
        if name == "jaxpod" or (req.extras and name == "jax"):
            continue  # the dev extra's own extras; jax[tpu]/[cuda12] lock jax itself
        assert name in locked, f"{req.name} is missing from constraints.txt: run make lock"
        assert req.specifier.contains(locked[name], prereleases=True), (req, locked[name])


def test_make_installs_the_locked_versions():
    recipe = (ROOT / "Makefile").read_text().replace("\\\n", " ")  # one line per command
    commands = [c for line in recipe.splitlines() for c in line.split("||")]
    installs = [c for c in commands if "pip install" in c and "$(UV)" not in c]
    assert len(installs) == 4, installs  # uv and pip: the package, XLA:GPU's compiler
    for install in installs:
        assert "-c $(LOCK)" in install, install
    assert "LOCK := constraints.txt" in recipe
