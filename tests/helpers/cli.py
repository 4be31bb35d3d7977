"""Running the `jaxpod` CLI in a subprocess, and checking its one-line user errors.

Each subprocess sets its own virtual device count, so `XLA_FLAGS` (8 devices, set for the
pytest process by `tests/conftest.py`) is not passed on; everything else in the environment
is, the session's shared jax compilation cache (`JAX_COMPILATION_CACHE_DIR`) included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, TINY_YAML

TINY = str(TINY_YAML)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this one's without `XLA_FLAGS`, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | extra


def cli_cmd(*args: str) -> list[str]:
    """`python -m jaxpod.cli ARGS` with this interpreter (the venv's)."""
    return [sys.executable, "-m", "jaxpod.cli", *args]


def jaxpod(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run `jaxpod ARGS` to completion (from the repository root unless `cwd`)."""
    return subprocess.run(
        cli_cmd(*args),
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=cli_env() if env is None else env,
        timeout=timeout,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, exactly one line on stderr naming the field, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("jaxpod: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
