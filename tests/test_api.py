"""The Python API of docs/api.md: every exported name resolves, `import jaxpod` starts no jax,
and the page's example runs as written (in a subprocess that sets its own 8 virtual CPU
devices, its run directory moved to pytest's tmp dir)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.cli import cli_env

import jaxpod

API_DOC = ROOT / "docs" / "api.md"
EXAMPLE_LOGDIR = "runs/api-example"


def example_code() -> str:
    """The one python code block of docs/api.md."""
    blocks = re.findall(r"```python\n(.*?)```", API_DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/api.md should hold one python example, found {len(blocks)}"
    return blocks[0]


def test_every_export_resolves_and_is_documented() -> None:
    doc = API_DOC.read_text()
    for name in jaxpod.__all__:
        assert getattr(jaxpod, name) is not None, name
        assert f"`{name}" in doc or name == "__version__", f"docs/api.md does not name {name}"
    assert set(jaxpod.__all__) <= set(dir(jaxpod))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        jaxpod.nope  # noqa: B018


def test_import_jaxpod_starts_no_jax() -> None:
    """Neither the import nor the jax-free entry points import jax (a fresh interpreter)."""
    code = (
        "import sys, jaxpod\n"
        "assert 'jax' not in sys.modules\n"
        "cfg = jaxpod.load_config('tiny')\n"
        "jaxpod.format_plan(jaxpod.plan(cfg)); jaxpod.estimate_config(cfg, 'tpu-v5e')\n"
        "jaxpod.parse_target('tpu-v5e:2x4')\n"
        "assert 'jax' not in sys.modules, 'an entry point documented jax-free imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), check=True)


@pytest.mark.cli
def test_the_documented_example_runs(tmp_path: Path) -> None:
    code = example_code()
    assert EXAMPLE_LOGDIR in code
    code = code.replace(EXAMPLE_LOGDIR, str(tmp_path / "run"))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "losses" in done.stdout
    assert (tmp_path / "run" / "metrics.jsonl").exists()
