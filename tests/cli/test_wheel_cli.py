"""The wheel, built from the checkout and installed into a fresh virtualenv, works outside it.

No network: the wheel is built by this environment's setuptools (its PEP 517 backend, called
directly) from a copy of the sources, and installed without its dependencies; the virtualenv
reaches them through a `.pth` line naming this environment's site-packages. A `.pth` line
adds a path only (the `.pth` files there are not run), so the checkout's editable install is
not seen: `import jaxpod` finds the wheel's copy, and the presets must have come with it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import CONFIGS, ROOT
from helpers.cli import cli_env

import jaxpod

pytestmark = pytest.mark.cli

SOURCES = ("pyproject.toml", "README.md", "LICENSE")


def _build_wheel(src: Path, out: Path) -> Path:
    for name in SOURCES:
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "jaxpod", src / "jaxpod", ignore=ignore)
    build = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=src, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1]


def _clean_env() -> dict[str, str]:
    """`cli_env()` without a path to the checkout (pytest's `PYTHONPATH`) or a virtualenv."""
    return {k: v for k, v in cli_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _install(wheel: Path, venv: Path) -> Path:
    """A virtualenv with `wheel` installed, its dependencies this environment's; its bin/."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    run = {"capture_output": True, "text": True, "env": _clean_env()}
    proc = subprocess.run([*pip, "--no-deps", str(wheel)], **run)
    assert proc.returncode == 0 and "Successfully installed" in proc.stdout, proc
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([python, "-c", purelib], check=True, **run).stdout.strip()
    ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(site) / "tested-dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return venv / "bin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the bin/ of a fresh virtualenv it is installed in)."""
    root = tmp_path_factory.mktemp("wheel")
    (root / "src").mkdir()
    (root / "dist").mkdir()
    wheel = _build_wheel(root / "src", root / "dist")
    return wheel, _install(wheel, root / "venv")


def _outside(bin_: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run bin_/ARGS from `cwd`, without the checkout on any path."""
    return subprocess.run(
        [str(bin_ / args[0]), *args[1:]], cwd=cwd, env=_clean_env(), capture_output=True, text=True
    )


def test_the_wheel_holds_every_preset_the_licence_and_the_version(installed):
    wheel, _ = installed
    assert wheel.name == f"jaxpod-{jaxpod.__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    presets = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {n.rpartition("/")[2] for n in names if n.startswith("jaxpod/configs/")} == presets
    assert f"jaxpod-{jaxpod.__version__}.dist-info/licenses/LICENSE" in names
    assert "jaxpod/__main__.py" in names and "jaxpod/target/specs/h100_sxm.txtpb" in names


def test_the_installed_command_runs_outside_the_checkout(installed, tmp_path):
    _, bin_ = installed
    where = _outside(bin_, "python", "-c", "import jaxpod; print(jaxpod.__file__)", cwd=tmp_path)
    assert where.stdout.startswith(str(bin_.parent)), where.stdout + where.stderr
    for command in (["jaxpod"], ["python", "-m", "jaxpod"]):
        proc = _outside(bin_, *command, "--version", cwd=tmp_path)
        assert (proc.returncode, proc.stdout) == (0, f"jaxpod {jaxpod.__version__}\n"), proc.stderr
    plan = _outside(bin_, "jaxpod", "plan", "tiny", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "8 = replica 2 x pipeline 2 x tensor 2" in plan.stdout
    # the README's path is the checkout's; outside it the name is offered
    missing = _outside(bin_, "jaxpod", "plan", "configs/tiny.yaml", cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "did you mean 'tiny'?" in missing.stderr


def test_the_installed_command_trains_tiny(installed, tmp_path):
    _, bin_ = installed
    args = ("train.steps=2", "train.eval_every=0", "optim.warmup_steps=0", "train.log_every=1")
    proc = _outside(bin_, "jaxpod", "train", "tiny", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step      2/2" in proc.stdout, proc.stdout
    assert (tmp_path / "runs" / "tiny" / "metrics.jsonl").is_file()
