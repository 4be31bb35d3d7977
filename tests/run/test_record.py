"""The run record's files: a full disk called so, links replaced (never written through),
FIFOs and other non-files refused (never opened to block), no temporary file left."""

from __future__ import annotations

import errno
import os

import pytest

from jaxpod.errors import UserError
from jaxpod.run.record import AppendFile, RecordWriteError, write_atomic


def test_a_full_disk_is_called_so(tmp_path):
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(OSError) as caught:
        full.write(b"x")
    assert caught.value.errno == errno.ENOSPC
    error = RecordWriteError(tmp_path / "metrics.jsonl", caught.value)
    assert str(error) == (
        f"cannot write {tmp_path}/metrics.jsonl (disk full: No space left on device)"
    )
    assert error.fix == "free space on that disk"


def test_write_atomic_replaces_a_link_and_leaves_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's\n")
    (tmp_path / "config.yaml").symlink_to(victim)
    (tmp_path / "config.yaml.tmp").symlink_to(victim)  # even the temporary name
    write_atomic(tmp_path / "config.yaml", "model: {}\n")
    assert victim.read_text() == "the user's\n"
    assert not (tmp_path / "config.yaml").is_symlink()
    assert (tmp_path / "config.yaml").read_text() == "model: {}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "victim.txt"]


def test_write_atomic_that_fails_leaves_no_temporary_file(tmp_path):
    (tmp_path / "eval.json").mkdir()  # the rename fails: a directory is in the way
    with pytest.raises(RecordWriteError, match=r"cannot write .*eval.json \(Is a directory\)"):
        write_atomic(tmp_path / "eval.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_an_appended_file_must_be_a_file(tmp_path, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's\n")
    path = tmp_path / "metrics.jsonl"
    if kind == "link":
        path.symlink_to(victim)
    else:
        os.mkfifo(path)  # opened for writing without a reader, it would block
    what = "a symbolic link" if kind == "link" else "not a regular file"
    with pytest.raises(UserError, match=f"metrics.jsonl is {what}, where jaxpod keeps"):
        AppendFile(path)
    assert victim.read_text() == "the user's\n"


def test_an_append_that_fills_the_disk_is_cut_off_again(tmp_path, monkeypatch):
    record = AppendFile(tmp_path / "metrics.jsonl")
    record.append(b'{"step": 1}\n')
    write, writes = os.write, []

    def short_then_full(fd, data):  # what a filling disk does: part of it, then ENOSPC
        writes.append(len(data))
        if len(writes) == 1:
            return write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(RecordWriteError, match="disk full"):
        record.append(b'{"step": 2}\n')
    monkeypatch.undo()
    record.close()
    assert writes == [12, 7]
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
