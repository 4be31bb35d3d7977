"""Readers that go away: a run whose stdout and stderr are pipes nobody reads any more (`jaxpod
train ... | head -8`, a dying `tee`) trains to the end and records everything; the read-only
commands end quietly, exit 0, when the reader of their output has gone (`jaxpod runs | head -1`).

Each pipe's read end is closed before the child starts, so its first write already fails:
what `head` does after its lines, without depending on when it does it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import ROOT
from helpers.cli import SMALL, TINY, cli_cmd, cli_env

pytestmark = pytest.mark.cli


def with_closed_pipes(*args: str, stderr_too: bool) -> subprocess.CompletedProcess:
    """`jaxpod ARGS`, its stdout (and stderr if `stderr_too`) a pipe that nobody reads."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            cli_cmd(*args),
            cwd=ROOT,
            env=cli_env(),
            stdout=write,
            stderr=write if stderr_too else subprocess.PIPE,
            text=True,
            timeout=600,
        )
    finally:
        os.close(write)


def test_a_run_whose_readers_went_away_trains_on_and_records_everything(tmp_path):
    run = tmp_path / "run"
    args = ["train", TINY, *SMALL, "train.steps=4", f"train.logdir={run}"]
    proc = with_closed_pipes(*args, stderr_too=True)
    assert proc.returncode == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in map(json.loads, lines) if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((run / "eval.json").read_text())["steps_trained"] == 4
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["4"]
    assert not (run / ".jaxpod.lock").exists()


def test_runs_and_plan_end_quietly_when_the_reader_has_gone(tmp_path):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {name: gpt}\n")
    for args in (["runs", str(tmp_path / "runs")], ["plan", TINY, "--json"]):
        proc = with_closed_pipes(*args, stderr_too=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]
