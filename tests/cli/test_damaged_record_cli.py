"""A damaged `metrics.jsonl` and resume: a damaged last line (cut short, or no record with a
step) is left out, saying so, and the run resumes with every step recorded once; a damaged
line before it is refused in one line before anything on disk changes (the config is not
renamed, the run stays listed by `jaxpod runs`)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import SMALL, TINY, assert_user_error, jaxpod

pytestmark = pytest.mark.cli


def train(run, steps: int, *flags: str):
    return jaxpod(
        "train",
        TINY,
        *SMALL,
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        f"train.logdir={run}",
        *flags,
    )


def snapshot(run) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_resume_trims_a_damaged_last_line_and_refuses_one_before_it(tmp_path):
    run = tmp_path / "run"
    assert train(run, 4).returncode == 0
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good.replace('{"step": 2,', '{"step": "x",', 1))  # line 3 of 6
    before = snapshot(run)
    proc = train(run, 6, "--allow-changes", "train.steps")
    assert_user_error(proc, f"{metrics} line 3 is damaged (")
    assert snapshot(run) == before  # config.yaml not renamed, nothing trimmed

    metrics.write_text(good + '{"step": "x"}\n')
    proc = train(run, 6, "--allow-changes", "train.steps")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trimmed        the last line of {metrics} is damaged (" in proc.stdout
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (run / "config.until-4.yaml").is_file()
