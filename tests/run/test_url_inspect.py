"""`jaxpod runs` and `jaxpod tensorboard`'s mirror on a URL, in an in-memory object store
(`testbucket://`): the rows equal those of the same runs in a local folder, only the small
record files are read, and the URL never becomes a local path (no `testbucket:` folder in the
working directory, which the `bucket` fixture puts in `tmp_path`)."""

from __future__ import annotations

import json
import logging
import re

import pytest
from helpers.bucket import BucketFileSystem, upload
from helpers.records import TRACE, write_run

from jaxpod.errors import UserError
from jaxpod.inspect.mirror import open_mirror, wanted
from jaxpod.inspect.runs import format_runs, list_runs, runs_json

URL = "testbucket://b/runs"


@pytest.fixture
def runs(tmp_path, bucket):
    """Three runs in `tmp_path/local/runs`, oldest first, and the same in the store."""
    root = tmp_path / "local" / "runs"
    write_run(root / "b-pod", "train.steps=4", losses=[5.5, 5.0, 4.5, 4.25], mtime=100)
    write_run(root / "group" / "a-one", "devices=4", "mesh.replica=1", losses=[6.0], mtime=200)
    write_run(root / "c-empty", mtime=300)
    for run in ("b-pod", "group/a-one", "c-empty"):  # the store's times in the same order
        upload(bucket, root / run, f"{URL}/{run}")
    return root


def _without_path(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "path"} for row in rows]


def test_runs_of_a_url_are_those_of_the_same_folder(runs, tmp_path, monkeypatch):
    read = []
    cat_file = BucketFileSystem.cat_file
    monkeypatch.setattr(
        BucketFileSystem,
        "cat_file",
        lambda fs, path, *a, **k: read.append(path) or cat_file(fs, path, *a, **k),
    )
    local, stored = list_runs(runs), list_runs(URL)
    assert [r["name"] for r in stored] == ["b-pod", "group/a-one", "c-empty"]
    assert format_runs(stored) == format_runs(local)
    assert json.loads(runs_json(_without_path(stored))) == json.loads(
        runs_json(_without_path(local))
    )
    assert [r["path"] for r in stored] == [f"{URL}/{r['name']}" for r in stored]
    assert stored[0]["loss"] == 4.25 and stored[0]["val_loss"] == 4.75  # read, not dashes
    assert {p.rpartition("/")[2] for p in read} == {"config.yaml", "metrics.jsonl", "eval.json"}
    assert not [p for p in read if "checkpoints" in p]  # no checkpoint is downloaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]  # no testbucket:


def test_a_url_run_directory_is_one_row_named_as_its_folder(runs):
    (row,) = list_runs(f"{URL}/b-pod")
    assert _without_path([row]) == _without_path(list_runs(runs / "b-pod"))
    assert row["path"] == f"{URL}/b-pod"


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        (f"{URL}/nothing", "does not exist (nothing there)"),
        (f"{URL}/b-pod/config.yaml", "is a file; pass the prefix of runs"),
        ("nosuchfs://b/runs", "no fsspec filesystem knows nosuchfs://"),
    ],
)
def test_a_url_without_runs_is_one_line(runs, url, needle):
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        list_runs(url)
    assert url in str(err.value) and "\n" not in str(err.value)


def test_a_filesystem_that_cannot_open_is_one_line(monkeypatch):
    """fsspec's `dir://` needs its folder (`FSSPEC_DIR`); without it fsspec fails inside."""
    import fsspec.config

    monkeypatch.delitem(fsspec.config.conf, "dir", raising=False)
    with pytest.raises(UserError, match=re.escape("DIR=dir://b/runs: its dir:// filesystem")):
        list_runs("dir://b/runs")


@pytest.mark.parametrize("command", [list_runs, open_mirror], ids=["runs", "tensorboard"])
def test_the_store_s_own_log_is_muted_while_it_is_read(bucket, monkeypatch, caplog, command):
    """A store that logs a traceback for each failed try (gcsfs does), then fails: the command
    fails in one line, the store's log muted meanwhile and as it was after."""
    log = logging.getLogger("helpers.bucket")  # a logger of the test store's package

    def find(fs, path, **kwargs):
        log.error("a try failed", exc_info=True)
        raise OSError("no route to the store")

    monkeypatch.setattr(BucketFileSystem, "find", find)
    with caplog.at_level(logging.INFO):
        with pytest.raises(UserError, match=re.escape("cannot be listed (no route to the store)")):
            command(URL)
        log.error("after the command")
    assert [r.getMessage() for r in caplog.records] == ["after the command"]


def test_the_mirror_holds_the_event_and_profile_files_only(runs, bucket):
    mirror = open_mirror(URL)
    try:
        local = {p.relative_to(runs).as_posix() for p in runs.rglob("*") if p.is_file()}
        want = {rel for rel in local if wanted(rel)}
        assert {rel for rel in want if rel.endswith("xplane.pb")} == {
            f"{run}/{TRACE.as_posix()}" for run in ("b-pod", "group/a-one", "c-empty")
        }
        assert len([rel for rel in want if "tfevents" in rel]) == 3
        got = {p.relative_to(mirror.local).as_posix() for p in mirror.local.rglob("*")}
        assert {rel for rel in got if (mirror.local / rel).is_file()} == want
        assert all((mirror.local / rel).read_bytes() == (runs / rel).read_bytes() for rel in want)
    finally:
        mirror.remove()
    assert not mirror.local.exists()


def test_a_refresh_appends_grown_event_files_and_drops_removed_files(runs, bucket):
    (events,) = (p.relative_to(runs).as_posix() for p in runs.glob("b-pod/events.out*"))
    whole = (runs / events).read_bytes()
    bucket.pipe_file(f"{URL}/{events}", whole[:100])  # the store's copy before the run went on
    mirror = open_mirror(URL)
    try:
        copy = mirror.local / events
        inode = copy.stat().st_ino
        assert copy.read_bytes() == whole[:100]
        bucket.pipe_file(f"{URL}/{events}", whole)
        bucket.rm(f"{URL}/c-empty", recursive=True)
        assert mirror.refresh() == 3  # the grown event file, c-empty's events and trace
        assert copy.read_bytes() == whole
        assert copy.stat().st_ino == inode  # appended: a reader of the file reads on
        assert not (mirror.local / "c-empty").exists()  # a run gone from the store is gone
        bucket.pipe_file(f"{URL}/{events}", b"rewritten")  # not a continuation: replaced
        assert mirror.refresh() == 1 and copy.read_bytes() == b"rewritten"
        assert mirror.refresh() == 0  # nothing changed, nothing downloaded
    finally:
        mirror.remove()


def test_a_mirror_of_nothing_is_one_line_and_leaves_no_folder(bucket, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(UserError, match=re.escape(f"LOGDIR {URL}/none does not exist")):
        open_mirror(f"{URL}/none")
    assert not list((tmp_path / "tmp").iterdir())
