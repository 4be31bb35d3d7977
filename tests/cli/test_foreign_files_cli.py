"""jaxpod writes only files it owns: a `train.logdir` holding files that are not a jaxpod run
is refused before jax starts, nothing touched; with `--logdir-exists ok` the run is added among
them and leaves every one of them as it was."""

from __future__ import annotations

import json

import pytest
from helpers.cli import SMALL, TINY, assert_user_error, jaxpod, without_jax

pytestmark = pytest.mark.cli
THEIRS = {
    "eval.json": '{"mine": true}\n',
    "plugins/profile/2026_01_01/trace.pb": "a trace\n",
    "events.out.tfevents.1.theirs": "their events\n",
    "notes.txt": "notes\n",
}


def put(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def contents(root, names) -> dict[str, str]:
    return {name: (root / name).read_text() for name in names}


def test_a_directory_of_other_files_is_refused_then_shared_when_asked(tmp_path):
    folder, theirs = tmp_path / "project", dict(THEIRS)
    put(folder, theirs)
    train = ["train", TINY, *SMALL, "train.steps=2", f"train.logdir={folder}"]
    proc = jaxpod(*train, env=without_jax(tmp_path))  # refused before jax starts
    assert_user_error(
        proc, f"train.logdir={folder} holds files that are not a jaxpod run", "--logdir-exists ok"
    )
    assert contents(folder, theirs) == theirs
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["eval.json", "plugins", "events.out.tfevents.1.theirs", "notes.txt"]
    )

    proc = jaxpod(*train, "--logdir-exists", "ok", env=without_jax(tmp_path))
    assert_user_error(proc, "already holds eval.json, which jaxpod did not write")

    (folder / "eval.json").rename(tmp_path / "eval.json")
    del theirs["eval.json"]
    proc = jaxpod(*train, "--logdir-exists", "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert contents(folder, theirs) == theirs
    assert json.loads((folder / "mapping.json").read_text())["shared_directory"] is True
    (folder / "checkpoints" / "2").rename(tmp_path / "2")  # a fresh start there next
    proc = jaxpod(*train)  # a jaxpod run now: no option needed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert contents(folder, theirs) == theirs
