"""Several processes, one mesh: JAX's multi-controller runtime on loopback (gloo on CPU).

2 processes x 4 virtual CPU devices train the same 2x2x2 mesh as 1 process x 8 devices. The
runs take 4 steps: the one-process run is then the tiny 4-step run other CLI modules compile
(tests/cli/test_resume_cli.py), held once in the session's compilation cache, and run once for
this module and test_multihost_collectives.py (`one_process_run`, tests/conftest.py).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from helpers import ROOT, free_port
from helpers.cli import (
    TINY,
    TINY4,
    TWO_PROCESSES,
    assert_user_error,
    cli_cmd,
    cli_env,
    finish,
    jaxpod,
    start,
    start_two_processes,
)

from jaxpod.run.metrics import read_metrics

pytestmark = [pytest.mark.cli, pytest.mark.xdist_group(TWO_PROCESSES)]


def test_two_processes_train_like_one(tmp_path, one_process_run):
    multi = tmp_path / "multi"
    # per process 4 devices: 2 x 4 = the 8 devices of the 2x2x2 mesh
    procs = start_two_processes("train", TINY, *TINY4, "devices=4", f"train.logdir={multi}")
    main_out, worker_out = finish(procs, timeout=300)
    assert "step      4/4" in main_out
    assert "step " not in worker_out and "devices " not in worker_out  # only process 0 prints
    assert '"processes": 2' in (multi / "mapping.json").read_text()

    records = {"multi": read_metrics(multi), "single": read_metrics(one_process_run)}
    losses = {
        name: np.array([r["loss"] for r in recs if "loss" in r]) for name, recs in records.items()
    }
    assert len(losses["multi"]) == 4
    # Same global batch, same data, same mesh shape; only the collectives differ (gloo
    # across processes): measured max rel diff 1e-7 (1 ulp in fp32).
    np.testing.assert_allclose(losses["multi"], losses["single"], rtol=1e-6, atol=0)
    vals = {
        name: [r["val_loss"] for r in recs if "val_loss" in r] for name, recs in records.items()
    }
    np.testing.assert_allclose(vals["multi"], vals["single"], rtol=1e-6, atol=0)
    # Every process saved its shards into the one checkpoint, committed once.
    assert sorted(p.name for p in (multi / "checkpoints").iterdir()) == ["4"]
    assert (multi / "eval.json").exists()


def test_one_device_per_process_trains_like_one_process(tmp_path):
    """2 processes x 1 device, a 2x1x1 mesh with a dynamic loss scale: the state's scalars
    (step, loss scale) are global arrays every process can read (the run's mapping reads each
    leaf's shards), and the losses are one process's with 2 devices."""
    mesh = ("mesh.replica=2", "mesh.pipeline=1", "mesh.tensor=1", "precision.loss_scale=dynamic")
    run = ("train", TINY, *TINY4, *mesh)
    one = tmp_path / "one"
    finish([start(*run, "devices=2", f"train.logdir={one}")], timeout=300)
    procs = start_two_processes(*run, "devices=1", f"train.logdir={tmp_path / 'two'}")
    finish(procs, timeout=300)
    losses = {
        n: [r["loss"] for r in read_metrics(tmp_path / n) if "loss" in r] for n in ("one", "two")
    }
    assert len(losses["two"]) == 4
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-6, atol=0)


def test_unreachable_coordinator_is_a_bounded_one_line_error(tmp_path):
    proc = jaxpod(
        "train",
        TINY,
        "devices=4",
        f"train.logdir={tmp_path / 'run'}",
        "--coordinator",
        f"127.0.0.1:{free_port()}",  # nobody listens there
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--init-timeout",
        "3",
        timeout=60,
    )
    assert_user_error(proc, "coordinator 127.0.0.1:", "not reachable within 3 s", "--init-timeout")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, needles",
    [
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
            ["--process-id 2", "between 0 and --num-processes - 1 = 1"],
        ),
        (["--num-processes", "2", "--process-id", "0"], ["--coordinator", "go together"]),
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], ["HOST:PORT"]),
        (["--distributed", "auto", "--process-id", "0"], ["--distributed auto"]),
    ],
    ids=["process-id-too-big", "missing-coordinator", "bad-address", "auto-and-explicit"],
)
def test_bad_process_flags(flags, needles, tmp_path):
    proc = jaxpod("train", TINY, f"train.logdir={tmp_path / 'run'}", *flags, timeout=60)
    assert_user_error(proc, *needles)
    assert not (tmp_path / "run").exists()


def test_mesh_must_match_the_devices_of_all_processes(tmp_path):
    proc = jaxpod(
        "train",
        TINY,
        "devices=2",  # 2 per process x 2 processes = 4, but the mesh is 2x2x2
        f"train.logdir={tmp_path / 'run'}",
        "--coordinator",
        "127.0.0.1:1",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        timeout=60,
    )
    assert_user_error(proc, "mesh", "devices=2 per process x 2 processes = 4 devices")


def test_distributed_auto_without_a_cluster(tmp_path):
    cluster_vars = ("SLURM_", "OMPI_", "JAX_COORDINATOR", "TPU_", "CLOUD_TPU", "MEGASCALE_")
    env = {k: v for k, v in cli_env().items() if not k.startswith(cluster_vars)}
    proc = subprocess.run(
        cli_cmd(
            "train", TINY, "devices=4", f"train.logdir={tmp_path / 'run'}", "--distributed", "auto"
        )
        + ["--init-timeout", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert_user_error(proc, "--distributed auto found no cluster environment")
    assert not (tmp_path / "run").exists()
