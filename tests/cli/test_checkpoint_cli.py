"""Checkpoints through the CLI: exact resume, resume after SIGKILL, reshard, refusals (the
in-process restore onto another mesh: tests/run/test_checkpoint.py).

One uninterrupted reference run (4 steps, a checkpoint after each) is shared by the module;
each test copies its run directory and removes the later checkpoints, which leaves exactly what
a run stopped after that step leaves behind. Its train step is the one of the other CLI
modules' tiny 4-step runs (tests/cli/test_resume_cli.py): the session's compilation cache
holds it once.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from helpers.cli import TINY, cli_cmd, cli_env, later_wins

from jaxpod.run.metrics import read_metrics

pytestmark = pytest.mark.cli
STEPS = 4
COMMON = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "optim.warmup_steps=0",
    "train.global_batch=16",
    "train.grad_accum=null",
    "train.keep_checkpoints=5",
]
TIMING = ("step_time_s", "tokens_per_s")


def _cmd(logdir: Path, *overrides: str) -> list[str]:
    return cli_cmd("train", TINY, *later_wins(*COMMON, f"train.logdir={logdir}", *overrides))


def jaxpod_train(logdir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(logdir, *overrides),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(),
        timeout=600,
    )


def train_records(logdir: Path) -> dict[int, dict]:
    """step -> training record without the timing fields; each step must appear once."""
    records = [r for r in read_metrics(logdir) if "loss" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), steps
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING} for r in records}


def complete_steps(logdir: Path) -> list[int]:
    ckpts = logdir / "checkpoints"
    return sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())


def stopped_after(reference: Path, step: int, dest: Path) -> Path:
    """A copy of the reference run as if it had stopped after `step`'s checkpoint."""
    shutil.copytree(reference, dest)
    for later in [s for s in complete_steps(dest) if s > step]:
        shutil.rmtree(dest / "checkpoints" / str(later))
    return dest


def snapshot(logdir: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(logdir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(logdir.rglob("*"))
        if p.is_file()
    }


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("jaxpod: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("reference") / "run"
    proc = jaxpod_train(logdir, "train.checkpoint_every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert complete_steps(logdir) == [1, 2, 3, 4]
    assert sorted(train_records(logdir)) == list(range(1, STEPS + 1))
    return logdir


def test_resume_is_exact_and_a_complete_run_exits_0(reference, tmp_path):
    run = stopped_after(reference, 2, tmp_path / "run")
    proc = jaxpod_train(run, "train.checkpoint_every=1", "train.keep_checkpoints=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed        from step 2" in proc.stdout
    # Bit-identical: same mesh, same data of every step, state restored exactly.
    assert train_records(run) == train_records(reference)
    assert complete_steps(run) == [2, 3, 4]  # keep_checkpoints=3: the oldest one is deleted

    before = snapshot(run)
    again = jaxpod_train(run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is at step 4; nothing to do" in again.stdout
    assert "compiled" not in again.stdout
    assert snapshot(run) == before


@pytest.mark.parametrize("mesh", [(1, 2, 4), (4, 1, 2)], ids=["1x2x4", "4x1x2"])
def test_restore_onto_another_mesh(reference, tmp_path, mesh):
    run = stopped_after(reference, 2, tmp_path / "run")
    r, p, t = mesh
    proc = jaxpod_train(run, f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed        from step 2" in proc.stdout
    got, want = train_records(run), train_records(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, 3):  # kept from the saving run
        assert got[step] == want[step]
    losses = np.array([got[s]["loss"] for s in range(3, STEPS + 1)])
    ref = np.array([want[s]["loss"] for s in range(3, STEPS + 1)])
    # fp32 with another reduction order on another mesh: measured max rel diff 1.1e-7 (1 ulp).
    np.testing.assert_allclose(losses, ref, rtol=1e-6, atol=0)


def test_another_model_is_refused_naming_its_keys(reference, tmp_path):
    """The saved config is compared before any array is read: the key, not an array."""
    run = stopped_after(reference, STEPS, tmp_path / "run")
    before = snapshot(run)
    proc = jaxpod_train(run, "model.d_model=128")
    assert_user_error(proc, "was trained to step 4 with another config (model.d_model 64 -> 128")
    assert "compiled" not in proc.stdout
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "override, needle",
    [
        ("model.layers=8", "params.layers.attn.b_o is [4, 64] float32 there but [8, 64]"),
        ("model.tie_embeddings=false", "params.unembed is in the model only"),
    ],
    ids=["layers", "untied"],
)
def test_mismatched_checkpoint_is_refused(reference, tmp_path, override, needle):
    """Past the config check (`--allow-changes model`), the arrays are compared."""
    run = stopped_after(reference, STEPS, tmp_path / "run")
    before = snapshot(run)
    proc = jaxpod_train(run, override, "--allow-changes", "model")
    line = assert_user_error(proc, "checkpoints/4 does not match the model: ", needle)
    assert line.endswith("use a fresh train.logdir or the same model.* and optim.*")
    assert "compiled" not in proc.stdout
    assert snapshot(run) == before


@pytest.mark.parametrize("damaged", ["largest", "manifest"])
def test_corrupt_checkpoint_is_refused_without_damage(reference, tmp_path, damaged):
    """Half the largest data file, or the state's manifest cut to 10 bytes: one line (the
    manifest's failed read leaves no other orbax read printing a traceback)."""
    run = stopped_after(reference, STEPS, tmp_path / "run")
    files = [p for p in (run / "checkpoints" / "4").rglob("*") if p.is_file()]
    if damaged == "largest":
        data = max(files, key=os.path.getsize)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:
        data = run / "checkpoints" / "4" / "state" / "manifest.ocdbt"
        data.write_bytes(data.read_bytes()[:10])
    before = snapshot(run)
    proc = jaxpod_train(run)
    assert_user_error(proc, "checkpoints/4 cannot be read", "delete that directory")
    assert snapshot(run) == before


def test_resume_after_sigkill_mid_save(reference, tmp_path):
    run = tmp_path / "run"
    for _attempt in range(3):
        shutil.rmtree(run, ignore_errors=True)
        proc = subprocess.Popen(
            _cmd(run, "train.checkpoint_every=1"),
            cwd=ROOT,
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        in_flight = []
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if (run / "checkpoints").is_dir():
                names = [p.name for p in (run / "checkpoints").iterdir()]
                in_flight = [n for n in names if "tmp" in n]
                if len([n for n in names if n.isdigit()]) >= 2 and in_flight:
                    proc.send_signal(signal.SIGKILL)
                    break
            time.sleep(0.01)
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            break
    else:
        pytest.fail("the run always finished before it could be killed mid-save")
    kept = complete_steps(run)
    assert len(kept) >= 2 and kept[-1] < STEPS, kept

    resumed = jaxpod_train(run, "train.checkpoint_every=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed        from step {kept[-1]}" in resumed.stdout
    got, want = train_records(run), train_records(reference)
    assert set(range(kept[-1] + 1, STEPS + 1)) <= set(got)
    for step, record in got.items():
        assert record == want[step], step
    assert complete_steps(run)[-1] == STEPS
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
