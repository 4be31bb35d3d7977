"""`jaxpod runs`: the table of run directories, from hand-written run records (no jax); and
`jaxpod tensorboard` serving them (the run-record writers: tests/run/test_metrics.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY_YAML, free_port
from helpers.cli import jaxpod as run_cli

from jaxpod.config import dump_yaml
from jaxpod.run.metrics import write_json_atomic

pytestmark = pytest.mark.cli
TINY = TINY_YAML


def jaxpod(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=120)


def fake_run(logdir: Path, *overrides: str, losses=(), vals=(), eval_json=True, mtime=0) -> None:
    """A run directory as `jaxpod train` leaves it (config.yaml, metrics.jsonl, eval.json)."""
    from jaxpod.config import load_config

    logdir.mkdir(parents=True)
    (logdir / "config.yaml").write_text(dump_yaml(load_config(TINY, list(overrides))))
    lines = [{"step": s, "val_loss": v} for s, v in vals]
    lines += [
        {"step": i + 1, "loss": v, "tokens_per_s": 1000.0 * (i + 1)} for i, v in enumerate(losses)
    ]
    if lines:
        (logdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if eval_json and vals:
        write_json_atomic(logdir / "eval.json", {"final_val_loss": vals[-1][1], "evals": []})
    os.utime(logdir, (mtime, mtime))


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    fake_run(
        root / "b-pod",
        "train.steps=4",
        losses=[5.5, 5.0, 4.5, 4.25],
        vals=[(0, 5.6), (4, 4.3)],
        mtime=200,
    )
    fake_run(
        root / "group" / "a-single",
        "devices=1",
        "mesh.replica=1",
        "mesh.pipeline=1",
        "mesh.tensor=1",
        "model.layers=2",
        losses=[5.0, 4.0],
        vals=[(0, 5.1)],
        eval_json=False,  # an unfinished run: the val loss comes from metrics.jsonl
        mtime=100,
    )
    fake_run(root / "c-empty", mtime=300)  # started, no metrics yet
    (root / "not-a-run").mkdir()
    return root


def test_runs_table(runs_dir):
    proc = jaxpod("runs", str(runs_dir))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split() == [
        "run",
        "config",
        "mesh",
        "RxPxT",
        "steps",
        "loss",
        "val",
        "loss",
        "speed",
    ]
    # Sorted by directory modification time (oldest first).
    assert [ln.split()[0] for ln in lines[1:]] == ["group/a-single", "b-pod", "c-empty"]
    assert lines[1].split() == [
        "group/a-single",
        "gpt",
        "2x64",
        "1x1x1",
        "2/20",
        "4.0000",
        "5.1000",
        "1,500",
        "tok/s",
    ]
    assert lines[2].split() == [
        "b-pod",
        "gpt",
        "4x64",
        "2x2x2",
        "4/4",
        "4.2500",
        "4.3000",
        "2,500",
        "tok/s",
    ]
    assert lines[3].split() == ["c-empty", "gpt", "4x64", "2x2x2", "-/20", "-", "-", "-"]


def test_runs_json(runs_dir):
    proc = jaxpod("runs", str(runs_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"group/a-single", "b-pod", "c-empty"}
    pod = rows["b-pod"]
    assert pod["config"] == "gpt 4x64" and pod["mesh"] == "2x2x2"
    assert (pod["steps_done"], pod["steps_total"]) == (4, 4)
    assert (pod["loss"], pod["val_loss"], pod["tokens_per_s"]) == (4.25, 4.3, 2500.0)
    assert rows["c-empty"]["loss"] is None and rows["c-empty"]["steps_done"] is None


def test_runs_of_a_missing_dir_is_one_line_error(tmp_path):
    proc = jaxpod("runs", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"jaxpod: error: runs directory {tmp_path / 'nope'} does not exist; pass one, "
        "e.g. jaxpod runs runs"
    ]
    empty = jaxpod("runs", str(tmp_path))
    assert empty.returncode == 0 and "no runs" in empty.stdout


def _serve(tmp_path: Path, *flags: str) -> subprocess.Popen:
    (tmp_path / "runs").mkdir(exist_ok=True)  # a LOGDIR that does not exist is refused
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpod.cli", "tensorboard", str(tmp_path / "runs"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_tensorboard_serves_loopback_only_by_default(tmp_path):
    """`jaxpod tensorboard` (and so `make tensorboard`) binds 127.0.0.1 without a warning; any
    other interface is an opt-in that warns about the missing authentication."""
    import socket
    import time

    make = subprocess.run(["make", "-n", "tensorboard"], capture_output=True, text=True, cwd=ROOT)
    assert "jaxpod tensorboard runs --host 127.0.0.1 --port 6006" in make.stdout, make.stdout

    port = free_port()
    proc = _serve(tmp_path, "--port", str(port))
    try:
        deadline, served = time.monotonic() + 90, False
        while not served and time.monotonic() < deadline and proc.poll() is None:
            with socket.socket() as s:
                served = s.connect_ex(("127.0.0.1", port)) == 0
            time.sleep(0.5)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert served, f"TensorBoard did not start listening on 127.0.0.1: {err[-2000:]}"
    assert f"TensorBoard on http://127.0.0.1:{port}/" in out
    assert "no authentication" not in err

    proc = _serve(tmp_path, "--host", "0.0.0.0", "--port", str(free_port()))
    try:
        line = proc.stderr.readline()  # the warning comes before TensorBoard starts
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert line.startswith("jaxpod: warning: serving TensorBoard on 0.0.0.0")
    assert "no authentication" in line


def test_runs_never_blocks_guesses_pads_or_writes_nan(tmp_path):
    """A FIFO metrics.jsonl is not opened (it would block); an unreadable config shows as
    `-`, not a guessed model; a 5,000-character name is cut; `--json` holds no NaN."""
    fifo, broken, long, diverged = (tmp_path / n for n in ("fifo", "broken", "long", "nan"))
    fake_run(fifo, mtime=1)
    os.mkfifo(fifo / "metrics.jsonl")
    fake_run(broken, mtime=2)
    (broken / "config.yaml").write_text("model: [unclosed\n")
    long.mkdir()
    (long / "config.yaml").write_text(f"model: {{name: {'m' * 5000}}}\n")
    fake_run(diverged, losses=[2.0, float("nan")], mtime=3)

    table = jaxpod("runs", str(tmp_path))
    assert table.returncode == 0, table.stderr[-3000:]
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert rows["broken"].split()[1] == "-"
    assert max(len(line) for line in table.stdout.splitlines()) < 200

    listed = jaxpod("runs", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    runs = json.loads(listed.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert {r["name"]: r["loss"] for r in runs}["nan"] == "nan"
    assert {r["name"]: r["config"] for r in runs}["broken"] is None
