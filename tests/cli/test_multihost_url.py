"""A URL run directory written by 2 processes, each through its own local copy
(`jaxpod.run.remote`, `jaxpod.run.shardsync`), as the hosts of a pod that share no filesystem.

The store is `dir://`: fsspec's `DirFileSystem` over a temporary folder, configured for the
subprocesses by `FSSPEC_DIR`, a filesystem both processes see through fsspec alone (a path
treated as local would make a `dir:` folder where the CLI runs). 2 processes x 1 device train
a 2-replica mesh, so each process writes part of every array (orbax's replica-parallel save).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest
from helpers import ROOT
from helpers.cli import (
    SMALL,
    TINY,
    TWO_PROCESSES,
    assert_user_error,
    cli_env,
    finish,
    later_wins,
    start,
    start_two_processes,
)

from jaxpod.run.metrics import read_metrics

pytestmark = [pytest.mark.cli, pytest.mark.xdist_group(TWO_PROCESSES)]
URL = "dir://bucket/runs/a"
RUN = later_wins(
    "train", TINY, *SMALL, "mesh.replica=2", "train.steps=4", "train.checkpoint_every=2"
)


def _store(tmp_path):
    """`(environment of the subprocesses, the folder that holds URL)`: the store in
    `tmp_path/store`, the local copies under `tmp_path/xdg`."""
    store = {"path": str(tmp_path / "store"), "target_protocol": "file"}
    store["target_options"] = {"auto_mkdir": True}
    env = cli_env(FSSPEC_DIR=json.dumps(store), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    return env, tmp_path / "store" / "bucket" / "runs" / "a"


def _losses(run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def _cut_upload(run) -> None:
    """Leave the store as a kill during the upload of step 4 does: process 1's shards of it,
    nothing else, and the lock of the killed process 0 (on this host, its pid gone)."""
    for path in sorted((run / "checkpoints" / "4").rglob("*"), reverse=True):
        if "ocdbt.process_1" not in path.as_posix() and path.is_file():
            path.unlink()
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    holder = {"pid": int(ended.stdout), "host": socket.gethostname()}
    (run / ".jaxpod.lock").write_text(json.dumps(holder))


def test_two_processes_write_a_url_and_resume_from_it_alone(tmp_path):
    """The record and the checkpoints (every process's shards, one commit mark) land in the
    store; the losses are those of one process on 2 devices; a run killed while it uploaded
    step 4, its local copies gone, resumes from the store alone with the uninterrupted run's
    losses, on 2 processes and on one."""
    env, run = _store(tmp_path)
    one = later_wins(*RUN, "devices=2")  # the reference: 1 process x 2 devices
    finish([start(*one, f"train.logdir={tmp_path / 'one'}")], timeout=300)
    finish(start_two_processes(*RUN, f"train.logdir={URL}", env=env), timeout=300)
    want = _losses(run)
    assert [step for step, _ in want] == [1, 2, 3, 4]
    # 2 replicas: each gradient sum has two terms, the same in any order, so one process's
    # all-reduce and gloo's between the processes give the same bits
    assert want == _losses(tmp_path / "one")
    assert not (ROOT / "dir:").exists() and not (run / ".jaxpod.lock").exists()
    assert any(p.name.startswith("events.out.tfevents.") for p in run.iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    for step in ("2", "4"):
        saved = run / "checkpoints" / step
        assert (saved / "commit_success.txt").is_file()
        assert {p.name for p in (saved / "state").glob("ocdbt.process_*")} == {
            "ocdbt.process_0",
            "ocdbt.process_1",
        }
    copies = tmp_path / "xdg" / "jaxpod" / "logdirs"
    assert sorted(p.name[-3:] for p in copies.iterdir()) == ["-p0", "-p1"]

    _cut_upload(run)
    shutil.rmtree(copies)
    out, _ = finish(start_two_processes(*RUN, f"train.logdir={URL}", env=env), timeout=300)
    assert "resumed        from step 2" in out
    assert _losses(run) == want
    assert (run / "checkpoints" / "4" / "commit_success.txt").is_file()
    assert not (run / ".jaxpod.lock").exists()

    _cut_upload(run)  # the 2 processes' checkpoint, read by one
    (out,) = finish([start(*one, f"train.logdir={URL}", env=env)], timeout=300)
    assert "resumed        from step 2" in out
    assert _losses(run) == want


def test_a_lock_in_the_store_stops_every_process_in_one_line(tmp_path):
    """Process 0 cannot claim the store: it names the holder, process 1 names process 0."""
    env, run = _store(tmp_path)
    run.mkdir(parents=True)
    holder = {"pid": 7, "host": "elsewhere", "started": "2026-12-06 10:00:00"}
    (run / ".jaxpod.lock").write_text(json.dumps(holder))
    procs = start_two_processes(*RUN, f"train.logdir={URL}", env=env)
    outs = [p.communicate(timeout=300) for p in procs]
    main, other = (
        subprocess.CompletedProcess(p.args, p.returncode, *out)
        for p, out in zip(procs, outs, strict=True)
    )
    assert_user_error(main, f"train.logdir={URL} is in use", "pid 7 on host elsewhere")
    assert_user_error(other, f"train.logdir={URL}: process 0 could not claim it")
    assert json.loads((run / ".jaxpod.lock").read_text()) == holder
