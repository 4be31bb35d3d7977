"""The parts of a URL run directory of several processes (`jaxpod.run.remote`), each process
played here by its own `RemoteLogdir`; the whole run is tests/cli/test_multihost_url.py.

The store is `dir://` (fsspec's `DirFileSystem`) over a temporary folder, one store for every
`RemoteLogdir` as for the processes of a pod."""

from __future__ import annotations

import json

import pytest

URL = "dir://bucket/runs/a"
STEP = "tmp-step.orbax-checkpoint-tmp"  # orbax's temporary directory of a save


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The folder behind `dir://`, the local copies in `tmp_path/xdg`."""
    import fsspec

    folder = tmp_path / "store"
    config = {"path": str(folder), "target_protocol": "file"}
    config["target_options"] = {"auto_mkdir": True}
    monkeypatch.setitem(fsspec.config.conf, "dir", config)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return folder / "bucket" / "runs" / "a"


def _process(index: int):
    from jaxpod.run.remote import RemoteLogdir

    return RemoteLogdir(URL, keep=2, process=index, processes=3)


def _written(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_process_0_gathers_what_the_others_shared_under_orbaxs_names(store, tmp_path):
    """Each other process uploads what it wrote in orbax's temporary directory under the
    committed names; process 0 downloads exactly those files into its own temporary
    directory, under the temporary names, and removes the lists."""
    theirs = {1: b"one", 2: b"two"}
    for index, data in theirs.items():
        shard = f"state.orbax-checkpoint-tmp/ocdbt.process_{index}/d/x"
        _process(index).share("4", _written(tmp_path / f"p{index}", {shard: data}))
    (store / "checkpoints" / "4" / "stray").write_bytes(b"listed by nobody")
    assert json.loads((store / "checkpoints" / "4" / ".shared-2.json").read_text()) == [
        "state/ocdbt.process_2/d/x"
    ]
    main = _process(0)
    written = _written(tmp_path / "p0", {"state.orbax-checkpoint-tmp/ocdbt.process_0/d/y": b"0"})
    main.gather("4", written)
    for index, data in theirs.items():
        got = written / f"state.orbax-checkpoint-tmp/ocdbt.process_{index}/d/x"
        assert got.read_bytes() == data
    assert not (written / "stray").exists()
    assert sorted(p.name for p in (store / "checkpoints" / "4").iterdir()) == ["state", "stray"]


def test_a_process_whose_shards_are_missing_is_named(store, tmp_path):
    from jaxpod.errors import UserError

    _process(1).share("4", _written(tmp_path / "p1", {"state/ocdbt.process_1/d/x": b"1"}))
    with pytest.raises(UserError, match="process 2's shards of checkpoint 4 are not in") as exc:
        _process(0).gather("4", tmp_path / "p0")
    assert f"train.logdir={URL}" in str(exc.value) and "\n" not in str(exc.value)


def test_a_store_in_each_process_memory_is_refused_for_several(tmp_path, monkeypatch):
    """`memory://` is one store per process: several processes could not meet in it."""
    from helpers import TINY_YAML

    from jaxpod.config import load_config
    from jaxpod.errors import UserError
    from jaxpod.run.preflight import preflight

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cfg = load_config(TINY_YAML, ["train.logdir=memory://bucket/run"])
    with pytest.raises(UserError, match="memory:// is held in each process's memory") as exc:
        preflight(cfg, processes=2, agree=lambda step: step)
    assert "train.logdir=memory://bucket/run" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "xdg").exists()
