"""`jaxpod runs`, `jaxpod tensorboard` and `jaxpod profile` on a URL, end to end.

The store is `dir://`: fsspec's `DirFileSystem` over a temporary folder, configured by
`FSSPEC_DIR`, which the CLI and the TensorBoard it starts see through fsspec alone; a URL
treated as a local path would make a `dir:` folder in the working directory, which stays empty.
Each output is compared with the same command on the folder behind the store.
"""

from __future__ import annotations

import gzip
import json
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
from helpers import free_port
from helpers.cli import assert_user_error, cli_cmd, cli_env, jaxpod
from helpers.records import TRACE, write_run

pytestmark = pytest.mark.cli
URL = "dir://bucket/runs"
RUNS = ["group/a-one", "b-pod"]  # oldest first: not the order of their names


@pytest.fixture
def store(tmp_path):
    """`(environment, the folder behind URL, an empty working directory)`; temporary folders
    (TensorBoard's mirror) in `tmp_path/tmp`."""
    folder = tmp_path / "store" / "bucket" / "runs"
    write_run(folder / "b-pod", "train.steps=4", losses=[5.5, 5.0, 4.5, 4.25], mtime=200)
    write_run(folder / "group" / "a-one", "devices=4", "mesh.replica=1", losses=[6.0], mtime=100)
    backing = {"path": str(tmp_path / "store"), "target_protocol": "file"}
    (tmp_path / "tmp").mkdir()
    (tmp_path / "work").mkdir()
    env = cli_env(FSSPEC_DIR=json.dumps(backing), TMPDIR=str(tmp_path / "tmp"))
    return env, folder, tmp_path / "work"


def test_runs_of_a_url_print_the_table_of_its_folder(store):
    env, folder, work = store
    stored, local = (jaxpod("runs", where, cwd=work, env=env) for where in (URL, str(folder)))
    assert stored.returncode == 0, stored.stderr[-2000:]
    assert stored.stdout == local.stdout
    assert [line.split()[0] for line in stored.stdout.splitlines()[1:]] == RUNS
    rows = json.loads(jaxpod("runs", URL, "--json", cwd=work, env=env).stdout)
    assert [row.pop("path") for row in rows] == [f"{URL}/{run}" for run in RUNS]
    local_rows = json.loads(jaxpod("runs", str(folder), "--json", cwd=work, env=env).stdout)
    assert rows == [{k: v for k, v in row.items() if k != "path"} for row in local_rows]
    assert_user_error(jaxpod("runs", "dir://bucket/none", cwd=work, env=env), "dir://bucket/none")
    assert not list(work.iterdir())  # no dir: folder


def _get(port: int, path: str):
    """The JSON TensorBoard answers at `path` (gunzipped if it came compressed)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        body = reply.read()
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def _loaded(port: int) -> dict:
    """The scalar tags of each run once TensorBoard has read both runs (waits up to 120 s)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            tags = _get(port, "/data/plugin/scalars/tags")
            if sorted(tags) == sorted(RUNS) and all("train/loss" in t for t in tags.values()):
                return tags
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"TensorBoard on port {port} did not load {RUNS}")


ASKED = [
    "/data/runs",
    "/data/plugin/scalars/scalars?run=b-pod&tag=train/loss",
    "/data/plugin/scalars/scalars?run=group/a-one&tag=val/val_loss",
    "/data/plugin/profile/runs",
    f"/data/plugin/profile/run_tools?run=b-pod/{TRACE.parent.name}",  # writes its tools cache
]


def test_tensorboard_serves_a_url_as_its_folder(store, tmp_path):
    """Runs, scalars and the profile tab's runs and tools equal those of a copy of the folder;
    the mirror is said in one line and removed when the command ends (SIGTERM); the
    `.cached_tools.json` TensorBoard writes next to a trace lands in the mirror, not the store."""
    env, folder, work = store
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    copy = shutil.copytree(folder, tmp_path / "copy")  # the folder TensorBoard may write to
    ports = free_port(), free_port()
    servers = [
        subprocess.Popen(
            cli_cmd("tensorboard", where, "--port", str(port)),
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for where, port in zip((URL, str(copy)), ports, strict=True)
    ]
    try:
        assert _loaded(ports[0]) == _loaded(ports[1])
        answers = [[_get(port, path) for path in ASKED] for port in ports]
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        err = servers[0].communicate(timeout=60)[1]
        servers[1].communicate(timeout=60)
    assert answers[0] == answers[1]
    assert len(answers[0][1]) == 4 and "b-pod" in json.dumps(answers[0][3])
    (line,) = [line for line in err.splitlines() if "local mirror" in line]
    assert line.startswith(f"jaxpod: LOGDIR {URL} is a URL: TensorBoard serves a local mirror")
    assert servers[0].returncode == 128 + signal.SIGTERM
    assert not list((tmp_path / "tmp").glob("jaxpod-tensorboard-*"))  # the mirror is removed
    assert list(copy.rglob(".cached_tools.json"))  # what TensorBoard writes to a folder...
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before  # ...not the store's
    assert not list(work.iterdir())  # no dir: folder


def test_profile_on_a_url_says_how_to_trace_a_url_run(store):
    env, _, work = store
    proc = jaxpod("profile", "tiny", "train.logdir=dir://bucket/p", cwd=work, env=env)
    assert_user_error(
        proc, "train.logdir=dir://bucket/p is a URL", "train.profile_steps=", "tensorboard dir://"
    )
    assert not list(work.iterdir())
