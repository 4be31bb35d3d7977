"""Resumes and failures through the CLI: a changed schedule is refused, a record lost by a kill
right after a commit comes back, TensorBoard shows each step once, a diverging run stops before
saving, and a checkpoint that cannot be written ends the run promptly in one line.

One uninterrupted reference run (4 steps, a checkpoint and an evaluation every 2) is shared by
the module; each test copies it and removes checkpoint 4, which leaves what a run killed before
that commit leaves behind (the records of steps 3 and 4 included).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.cli import TINY, assert_user_error, cli_cmd, cli_env, later_wins

from jaxpod.run.metrics import read_metrics

pytestmark = pytest.mark.cli
COMMON = [
    "train.steps=4",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=5",
    "optim.warmup_steps=0",
]
TIMING = ("step_time_s", "tokens_per_s")
READ_ONLY_CACHE_SECS = 10**9  # jax writes a cache entry only for compiles at least this long


def user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The one `jaxpod: error:` line (exit 2, no traceback) holding every needle, without the
    prefix."""
    assert_user_error(proc, *needles)
    return proc.stderr.strip().removeprefix("jaxpod: error: ")


def train(logdir: Path, *overrides: str, limit_file_bytes: int | None = None):
    """`jaxpod train` of the tiny config; with `limit_file_bytes`, on a full disk: its writes
    past that size fail with EFBIG (bash's `ulimit -f`, in KiB, set before the exec: no Python
    code runs between fork and exec in this multithreaded process)."""
    cmd = cli_cmd("train", TINY, *later_wins(*COMMON, f"train.logdir={logdir}", *overrides))
    env = cli_env()
    if limit_file_bytes:
        cmd = ["bash", "-c", f'ulimit -f {limit_file_bytes // 1024} && exec "$@"', "bash", *cmd]
        # a write to the session's compilation cache would leave a truncated entry that other
        # processes then fail to read: this run only reads it (no compile is slow enough to be
        # written), so the programs the reference run compiled are loaded, not compiled again
        env = cli_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(READ_ONLY_CACHE_SECS))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def before_checkpoint_4(reference: Path, dest: Path) -> Path:
    shutil.copytree(reference, dest)
    shutil.rmtree(dest / "checkpoints" / "4")
    return dest


def snapshot(logdir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(logdir)): p.read_bytes() for p in logdir.rglob("*") if p.is_file()}


def records(logdir: Path) -> list[tuple[int, str, dict]]:
    """(step, kind, record without timings) in file order."""
    return [
        (
            r["step"],
            "val" if "val_loss" in r else "train",
            {k: v for k, v in r.items() if k not in TIMING},
        )
        for r in read_metrics(logdir)
    ]


def test_a_changed_schedule_is_refused_in_one_line_without_damage(reference, tmp_path):
    run = before_checkpoint_4(reference, tmp_path / "run")
    before = snapshot(run)
    proc = train(run, "optim.lr=0.001", "train.steps=6")
    line = user_error(proc, "(checkpoint 2) was trained to step 2 with another config (")
    assert "optim.lr 0.003 -> 0.001, train.steps 4 -> 6)" in line
    assert "--allow-changes optim.lr,train.steps" in line
    assert snapshot(run) == before


def test_a_lost_record_comes_back(reference, tmp_path):
    from jaxpod.run.resume import keep_records_upto, trim_events

    run = before_checkpoint_4(reference, tmp_path / "run")
    keep_records_upto(run, 1)  # the record lost step 2, which checkpoint 2 keeps: a kill
    trim_events(run, 1)  # between the checkpoint's commit and the record's write
    proc = train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed        from step 2" in proc.stdout
    got, want = records(run), records(reference)
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in want]
    assert [r for s, _, r in got if s <= 2] == [r for s, _, r in want if s <= 2]  # step 2 back
    assert event_steps(run) == [1, 2, 3, 4]


def test_tensorboard_shows_each_step_once_after_a_resume(reference, tmp_path):
    run = before_checkpoint_4(reference, tmp_path / "run")  # events of steps 1-4 stay
    proc = train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2
    assert event_steps(run) == [1, 2, 3, 4]


def event_steps(run: Path) -> list[int]:
    """The steps of every `train/loss` scalar in the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for path in sorted(run.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        steps += [e.step for e in acc.Scalars("train/loss")]
    return sorted(steps)


def test_a_diverging_run_stops_before_saving_and_keeps_the_good_checkpoints(tmp_path):
    run = tmp_path / "run"
    sgd = ["optim.name=sgd", "optim.lr=1000", "optim.grad_clip=0", "optim.lr_schedule=constant"]
    proc = train(run, *sgd, "train.steps=8", "train.checkpoint_every=1", "train.keep_checkpoints=2")
    line = user_error(proc, "training diverged at step 4: loss nan, so the run stopped")
    assert "the newest checkpoint, step 3, is intact" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]
    assert [s for s, k, _ in records(run) if k == "train"] == [1, 2, 3, 4]


def test_a_run_diverging_after_a_resume_names_the_checkpoint_it_resumed_from(tmp_path):
    run = tmp_path / "run"
    sgd = ["optim.name=sgd", "optim.lr=1000", "optim.grad_clip=0", "optim.lr_schedule=constant"]
    assert train(run, *sgd, "train.steps=3").returncode == 0  # diverges at step 4 (above)
    proc = train(run, *sgd, "train.steps=8", "--allow-changes", "train.steps")
    line = user_error(proc, "training diverged at step 4: loss nan, so the run stopped")
    assert "the newest checkpoint, step 3, is intact" in line


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(tmp_path):
    run = tmp_path / "run"
    proc = train(run, "train.eval_every=0", limit_file_bytes=256 * 1024)
    line = user_error(proc, f"checkpoint could not be saved under {run}/checkpoints (")
    assert "File too large" in line and "has free space" in line, line
    assert not list((run / "checkpoints").glob("[0-9]")), "no checkpoint is listed as complete"
