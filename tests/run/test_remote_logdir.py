"""A run directory behind a URL (`jaxpod.run.remote`): a run writes its record and checkpoints
into an fsspec filesystem that is not the local disk, and resumes from it.

The store is `testbucket://`, an in-memory fsspec filesystem registered for these tests (no
network): a path treated as local would make a `testbucket:` folder where the test runs, or
leave the store empty."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.cli import SMALL

URL = "testbucket://bucket/runs/a"
RUN = [*SMALL, "train.steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=3"]


def _train(*overrides: str):
    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.run.loop import run_training

    return run_training(load_config(TINY_YAML, [*RUN, *overrides]), quiet=True)


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def _remote_losses(fs) -> list[tuple[int, float]]:
    text = fs.cat_file(f"{URL}/metrics.jsonl").decode()
    return _losses([json.loads(line) for line in text.splitlines()])


def test_a_run_and_its_resume_go_through_the_store(bucket, tmp_path):
    """The record and checkpoints land in the store (nothing under the working directory, no
    lock left); the losses are those of the same run in a local directory; a run killed after
    its step-2 checkpoint (step 4 never pushed) resumes from the store alone, the local copy
    gone, with the same losses as the run that was not interrupted."""
    from jaxpod.run.metrics import read_metrics
    from jaxpod.run.remote import local_copy

    local = _train(f"train.logdir={tmp_path / 'local'}")
    remote = _train(f"train.logdir={URL}")
    assert remote.losses == local.losses and len(local.losses) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local", "xdg"]
    names = {p.rsplit("/", 1)[-1] for p in bucket.ls(URL, detail=False)}
    assert {"metrics.jsonl", "eval.json", "config.yaml", "mapping.json", "checkpoints"} <= names
    assert any(n.startswith("events.out.tfevents.") for n in names)
    assert ".jaxpod.lock" not in names
    steps = sorted(p.rsplit("/", 1)[-1] for p in bucket.ls(f"{URL}/checkpoints", detail=False))
    assert steps == ["2", "4"]
    assert bucket.exists(f"{URL}/checkpoints/4/commit_success.txt")
    want = _losses(read_metrics(tmp_path / "local"))
    assert [step for step, _ in want] == [1, 2, 3, 4]
    assert _remote_losses(bucket) == want

    bucket.rm(f"{URL}/checkpoints/4", recursive=True)  # killed before step 4 was pushed
    shutil.rmtree(local_copy(URL))
    resumed = _train(f"train.logdir={URL}")
    assert resumed.losses == local.losses[2:]
    assert _remote_losses(bucket) == want
    assert bucket.exists(f"{URL}/checkpoints/4/commit_success.txt")


def test_a_cut_upload_is_never_a_checkpoint(bucket, monkeypatch):
    """An upload of step 4 that fails at its first array file leaves no commit mark (orbax's
    own `commit_success.txt` files go up with the rest, the store's mark last); the next run
    removes what was cut, resumes from step 2 and ends with the same losses."""
    from jaxpod.errors import UserError

    full = _train(f"train.logdir={URL}")
    want = _remote_losses(bucket)
    bucket.rm(URL, recursive=True)
    real = type(bucket).put_file

    def cut(self, lpath, rpath, **kwargs):
        if "/checkpoints/4/state/" in str(rpath):
            raise OSError("connection reset")
        return real(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(type(bucket), "put_file", cut)
    with pytest.raises(UserError, match="cannot upload the run record"):
        _train(f"train.logdir={URL}")
    assert bucket.exists(f"{URL}/checkpoints/4/_CHECKPOINT_METADATA")  # cut after it
    assert not bucket.exists(f"{URL}/checkpoints/4/commit_success.txt")
    monkeypatch.setattr(type(bucket), "put_file", real)
    resumed = _train(f"train.logdir={URL}")
    assert resumed.losses == full.losses[2:]
    assert _remote_losses(bucket) == want


def test_the_store_keeps_the_newest_checkpoints(bucket):
    """Rotation (`train.keep_checkpoints`) removes the older checkpoints from the store too."""
    _train(f"train.logdir={URL}", "train.checkpoint_every=1", "train.keep_checkpoints=2")
    steps = sorted(p.rsplit("/", 1)[-1] for p in bucket.ls(f"{URL}/checkpoints", detail=False))
    assert steps == ["3", "4"]


def _lock(bucket, holder: dict) -> None:
    bucket.pipe_file(f"{URL}/.jaxpod.lock", json.dumps(holder).encode())


def test_a_lock_in_the_store_is_refused_naming_its_holder(bucket):
    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.errors import UserError
    from jaxpod.run.preflight import preflight

    _lock(bucket, {"pid": 7, "host": "elsewhere", "started": "2026-12-06 10:00:00"})
    cfg = load_config(TINY_YAML, [*RUN, f"train.logdir={URL}"])
    with pytest.raises(UserError, match="pid 7 on host elsewhere") as exc:
        preflight(cfg)
    assert f"delete {URL}/.jaxpod.lock" in str(exc.value) and "\n" not in str(exc.value)
    assert json.loads(bucket.cat_file(f"{URL}/.jaxpod.lock"))["host"] == "elsewhere"


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(bucket):
    import socket
    import subprocess
    import sys

    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.run.preflight import preflight

    dead = subprocess.run(  # a process that has ended: its pid is no process's
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    _lock(bucket, {"pid": int(dead.stdout), "host": socket.gethostname()})
    cfg = load_config(TINY_YAML, [*RUN, f"train.logdir={URL}"])
    with preflight(cfg):
        holder = json.loads(bucket.cat_file(f"{URL}/.jaxpod.lock"))
        assert holder["pid"] != int(dead.stdout) and holder["host"] == socket.gethostname()
    assert not bucket.exists(f"{URL}/.jaxpod.lock")


@pytest.mark.parametrize(
    ("url", "needle"),
    [("nosuchfs://bucket/run", "no fsspec filesystem knows nosuchfs://"), ("s3://b/run", "s3fs")],
)
def test_a_url_without_a_filesystem_is_one_line(tmp_path, monkeypatch, url, needle):
    """A protocol no installed fsspec implementation serves: refused naming the field and what
    to install, and nothing made where the command runs."""
    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.errors import UserError
    from jaxpod.run.preflight import preflight

    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY_YAML, [*RUN, f"train.logdir={url}"])
    with pytest.raises(UserError, match=f"train.logdir={url}") as exc:
        preflight(cfg)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert list(tmp_path.iterdir()) == []
