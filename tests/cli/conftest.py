"""Fixtures of the CLI modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import TINY, TINY4, finish, start


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory) -> Path:
    """The logdir of the tiny 4-step run on 1 process x 8 devices (`TINY4`): the reference the
    multi-process runs of tests/cli/test_multihost*.py are compared with (their xdist group,
    `TWO_PROCESSES`, runs it once)."""
    logdir = tmp_path_factory.mktemp("one-process") / "run"
    finish([start("train", TINY, *TINY4, "devices=8", f"train.logdir={logdir}")], timeout=300)
    return logdir
