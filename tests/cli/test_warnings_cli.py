"""Warnings say what the run will actually do: the learning rate a cut warm-up stops at is
the one the last step logs."""

from __future__ import annotations

import json

import pytest
from helpers.cli import SMALL, TINY, jaxpod

pytestmark = pytest.mark.cli


def test_a_cut_warm_up_names_the_last_steps_learning_rate(tmp_path):
    run = tmp_path / "run"
    proc = jaxpod(
        "train",
        TINY,
        *[o for o in SMALL if not o.startswith("optim.warmup_steps=")],
        "train.steps=3",
        "optim.warmup_steps=5",
        "optim.lr=0.003",
        f"train.logdir={run}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (warning,) = [line for line in proc.stderr.splitlines() if "optim.warmup_steps=5" in line]
    said = float(warning.split(" from 0 to ")[1].split(" at the last step")[0])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in records if r["step"] == 3 and "lr" in r]
    assert f"{last['lr']:.3g}" == f"{said:.3g}", warning
