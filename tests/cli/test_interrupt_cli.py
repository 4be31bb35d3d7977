"""Signals and second processes: a second run on a locked logdir is refused naming the first;
Ctrl-C saves the step it is on (also with the default `checkpoint_every=0`), writes every record
up to it and exits 130, also while checkpoints are being saved; the run then resumes; a closing
terminal (SIGHUP) saves like SIGTERM and exits 129, its lock released; and the
documented profile command, options before overrides, runs as printed."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from helpers.cli import TINY, assert_user_error, cli_cmd, cli_env, jaxpod, without_jax

from jaxpod.run.metrics import read_metrics

pytestmark = pytest.mark.cli
COMMON = ["train.steps=400", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1"]
# A constant learning rate after the preset's 5 warm-up steps: the step does not depend on
# train.steps, so the resumed run (another train.steps) loads the interrupted run's compiled
# step from the session's compilation cache instead of compiling its own.
COMMON += ["optim.lr_schedule=constant"]


def start(logdir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        cli_cmd("train", TINY, *COMMON, f"train.logdir={logdir}", *overrides),
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_steps(proc: subprocess.Popen, logdir: Path, steps: int, timeout: float = 300) -> None:
    """Until `metrics.jsonl` holds `steps` training records."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = logdir / "metrics.jsonl"
        if path.exists() and path.read_text().count('"loss"') >= steps:
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {steps} steps within {timeout} s: {proc.communicate()[1][-2000:]}")


def interrupt(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return out, err


def train_steps(logdir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(logdir) if "loss" in r]


def checkpoints(logdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (logdir / "checkpoints").iterdir() if p.name.isdigit())


def test_lock_then_ctrl_c_saves_the_step_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    first = start(run)  # train.checkpoint_every=0: only the last step would be saved
    wait_for_steps(first, run, 3)
    # refused before jax starts: importing it would fail the second run
    second = jaxpod("train", TINY, *COMMON, f"train.logdir={run}", env=without_jax(tmp_path))
    assert_user_error(
        second,
        f"train.logdir={run} is in use by another jaxpod run (pid "
        f"{first.pid} on host {socket.gethostname()}, since ",
    )

    _, err = interrupt(first)
    step = checkpoints(run)[-1]
    assert checkpoints(run) == [step] and step >= 3
    assert err.strip().splitlines()[-1] == (
        f"jaxpod: interrupted at step {step}: saved {run}/checkpoints/{step} and the record up "
        "to it; run the same command to resume"
    )
    assert train_steps(run) == list(range(1, step + 1))
    assert not (run / ".jaxpod.lock").exists()

    common = [o for o in COMMON if not o.startswith("train.steps=")]  # each key once
    resumed = jaxpod(
        "train",
        TINY,
        *common,
        f"train.logdir={run}",
        f"train.steps={step + 2}",
        "--allow-changes",
        "train.steps",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed        from step {step}" in resumed.stdout
    assert train_steps(run) == list(range(1, step + 3))
    old = yaml.safe_load((run / f"config.until-{step}.yaml").read_text())
    assert old["train"]["steps"] == 400
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == step + 2


def test_ctrl_c_while_checkpoints_are_saved_exits_130_with_every_record(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    wait_for_steps(proc, run, 3)
    while not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]:
        time.sleep(0.005)  # a save in flight
    interrupt(proc)
    step = checkpoints(run)[-1]
    assert len(checkpoints(run)) == 2 and not [
        p for p in (run / "checkpoints").iterdir() if not p.name.isdigit()
    ]
    assert train_steps(run) == list(range(1, step + 1))
    meta = json.loads((run / "checkpoints" / str(step) / "meta" / "metadata").read_text())
    assert [r for _, r in meta["records"]] == [read_metrics(run)[-1]]


def test_a_closing_terminal_saves_the_step_like_sigterm(tmp_path):
    run = tmp_path / "run"
    proc = start(run)  # train.checkpoint_every=0: nothing saved until it stops
    wait_for_steps(proc, run, 3)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 129, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    step = checkpoints(run)[-1]
    assert checkpoints(run) == [step] and step >= 3
    assert err.strip().splitlines()[-1].startswith(f"jaxpod: interrupted at step {step}: saved")
    assert train_steps(run) == list(range(1, step + 1))
    assert not (run / ".jaxpod.lock").exists()


# docs/runs.md's tiny command profiles the tiny 4-step program of the other CLI modules (the
# session's compilation cache holds it once); its logdir is the config's, here under tmp_path.
def test_the_documented_profile_command_runs_as_printed(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (command,) = [
        line.split(" #")[0].split()
        for line in (ROOT / "docs" / "runs.md").read_text().splitlines()
        if line.startswith(".venv/bin/jaxpod profile configs/tiny.yaml --warmup")
    ]
    proc = jaxpod(*command[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "runs" / "tiny-profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
