"""Disks that fill and directories that refuse writes: a failed write of the run record stops
training with a checkpoint of the step it is on (holding the records the files lack) and one
line naming the file and the operating system's reason; the same command then resumes with
every step recorded once. A full disk is called so, never an out-of-memory error; a
checkpoints directory that cannot be written is refused before anything starts.

A file-size limit (`ulimit -f`) makes the record's writes fail in the
child alone; a real full disk is a small tmpfs in a user namespace (`unshare`), where the host
allows one; the run's last file, eval.json, fails in a child that sets that limit to 0 just
before writing it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.cli import SMALL, TINY, assert_user_error, cli_cmd, cli_env, event_steps, without_jax

pytestmark = pytest.mark.cli


def no_cache_env(**extra: str) -> dict[str, str]:
    """`cli_env()` without the compilation cache: a limited child could not write its entries."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("JAX_COMPILATION_CACHE")}
    return env | {"JAX_ENABLE_COMPILATION_CACHE": "false"} | extra


def train_with_file_limit(logdir: Path, limit: int, *overrides: str):
    """`jaxpod train` in a child whose files may grow to `limit` bytes, then fail with EFBIG
    (bash's `ulimit -f`, in KiB, set before the exec: no Python code runs between fork and
    exec in this multithreaded process; Python ignores SIGXFSZ, so the write just fails)."""
    cmd = cli_cmd("train", TINY, *SMALL, f"train.logdir={logdir}", *overrides)
    limited = ["bash", "-c", f'ulimit -f {limit // 1024} && exec "$@"', "bash", *cmd]
    return subprocess.run(
        limited, cwd=ROOT, env=no_cache_env(), capture_output=True, text=True, timeout=600
    )


def train(logdir: Path, *overrides: str, env=None, prefix=()):
    cmd = [*prefix, *cli_cmd("train", TINY, *SMALL, f"train.logdir={logdir}", *overrides)]
    return subprocess.run(
        cmd, cwd=ROOT, env=env or cli_env(), capture_output=True, text=True, timeout=600
    )


def train_steps(logdir: Path) -> list[int]:
    lines = (logdir / "metrics.jsonl").read_text().splitlines()
    return sorted(r["step"] for r in map(json.loads, lines) if "loss" in r)


def leftovers(logdir: Path) -> list[Path]:
    return [p for p in logdir.rglob("*.tmp")]


def test_a_file_that_cannot_grow_stops_the_run_with_a_checkpoint_and_it_resumes(tmp_path):
    run = tmp_path / "run"
    # metrics.jsonl reaches 96 KiB after ~340 of 400 steps; a checkpoint's files stay under it
    proc = train_with_file_limit(run, 96 * 1024, "train.steps=400")
    assert_user_error(proc, f"cannot write {run}/metrics.jsonl (File too large) at step ")
    line = proc.stderr.strip()
    step = int(line.split(" at step ")[1].split(":")[0])
    assert f"saved {run}/checkpoints/{step} with the records the file lacks" in line
    assert "ulimit -f" in line and 100 < step < 400
    assert [p.name for p in (run / "checkpoints").iterdir()] == [str(step)]
    assert not leftovers(run)
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")  # the record that failed was cut off again: whole lines only
    written = train_steps(run)
    assert written == list(range(1, len(written) + 1)) and len(written) < step

    proc = train(run, "train.steps=400", env=no_cache_env())  # the same command, no limit
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed        from step {step}" in proc.stdout
    assert train_steps(run) == list(range(1, 401))  # the steps the file lacked came back
    assert event_steps(run) == list(range(1, 401))
    assert json.loads((run / "eval.json").read_text())["steps_trained"] == 400


# `jaxpod train` in a child whose files may not grow once the steps are done and eval.json, the
# record's last file, is written (the limit of `ulimit -f`, set to 0 there: no write that
# grows a file succeeds; Python ignores SIGXFSZ, so the write just fails).
LAST_FILE_LIMITED = """
import resource, sys
import jaxpod.run.loop as loop
write_eval_record = loop.write_eval_record
def limited(*args, **kwargs):
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return write_eval_record(*args, **kwargs)
loop.write_eval_record = limited
from jaxpod.cli import main
main(sys.argv[1:])
"""


def test_a_last_file_that_cannot_be_written_is_one_line_and_the_run_writes_it_again(tmp_path):
    run = tmp_path / "run"
    args = ["train", TINY, *SMALL, "train.steps=2", f"train.logdir={run}"]
    proc = subprocess.run(
        [sys.executable, "-c", LAST_FILE_LIMITED, *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert_user_error(proc, f"cannot write {run}/eval.json (File too large) at the end of the run")
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("events")) == [
        "checkpoints",
        "config.yaml",
        "mapping.json",
        "metrics.jsonl",
    ]  # no eval.json.tmp left
    proc = train(run, "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "eval.json").read_text())["steps_trained"] == 2


def small_tmpfs_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not small_tmpfs_available(), reason="no user namespaces for a small tmpfs")
def test_a_full_disk_during_a_save_is_called_disk_full(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    # 96 KiB: the record fits, the first checkpoint (~130 KB) does not
    mount = f'mount -t tmpfs -o size=96k tmpfs {disk} && exec "$@"'
    prefix = ["unshare", "-rm", "sh", "-c", mount, "sh"]
    proc = train(run, "train.steps=3", prefix=prefix, env=no_cache_env())
    assert_user_error(proc, "checkpoint could not be saved under", "(disk full: ")
    assert "out of memory" not in proc.stderr


def unprivileged() -> list[str]:
    """A command prefix under which permissions apply to this user (root: without the
    capabilities that override them)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: permissions would not apply")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_a_checkpoints_directory_that_cannot_be_written_is_refused_first(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints").chmod(0o555)
    proc = train(run, "train.steps=3", prefix=unprivileged(), env=without_jax(tmp_path))
    assert_user_error(proc, f"{run}/checkpoints is not writable (permission denied)")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # nothing written
