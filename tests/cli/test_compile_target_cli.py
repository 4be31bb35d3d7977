"""`jaxpod compile CONFIG --target ...` through the CLI: XLA:TPU's and XLA:GPU's programs of
the tiny step with no accelerator attached, every key of `--json`, the one-line refusals."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT
from helpers.cli import assert_user_error, jaxpod

pytestmark = pytest.mark.cli

TINY = str(ROOT / "configs" / "tiny.yaml")
KEYS = (
    "device_total_bytes argument_bytes temp_bytes peak_bytes host_argument_bytes "
    "host_temp_bytes flops_per_device collectives transfers compile_s "
    "planned_device_total_bytes planned_profile planned_ratio target layout memory_spaces"
).split()
KINDS = {"all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"}


@pytest.fixture(scope="module")
def tpu_json():
    proc = jaxpod("compile", TINY, "--target", "tpu-v5p:2x2x2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_tpu_compile_reports_every_key(tpu_json):
    r = json.loads(tpu_json.stdout)
    assert set(KEYS) <= set(r)
    assert (r["platform"], r["devices"], r["planned_profile"]) == ("tpu", 8, "tpu-v5p")
    assert set(r["collectives"]) == KINDS
    assert set(r["transfers"]) == {"to_device", "to_host"}
    # the HBM total is the buffer assignment's memory spaces but the on-chip ones (and the
    # host's, which this program has none of)
    spaces = r["memory_spaces"]
    assert r["device_total_bytes"] == sum(spaces.values()) - spaces["vmem"] - spaces["smem"]
    assert r["device_total_bytes"] > r["device_argument_bytes"] > 0
    assert r["device_temp_bytes"] == r["device_total_bytes"] - r["device_argument_bytes"]
    assert r["device_temp_bytes"] < r["temp_bytes"]  # XLA's temporaries include the VMEM
    assert r["memory_spaces"]["vmem"] > 0  # on-chip scratch, reported apart
    # a 2x2x2 mesh: the pipeline sends activations, tensor and replica axes all-reduce
    assert r["collectives"]["collective-permute"]["count"] > 0
    assert r["collectives"]["all-reduce"]["executed"] >= r["collectives"]["all-reduce"]["count"]
    assert r["flops_per_device"] > 0 and r["peak_bytes"] > 0
    assert r["planned_ratio"] == pytest.approx(
        r["planned_device_total_bytes"] / r["device_total_bytes"]
    )
    assert "tensor 2 on" in r["layout"]
    assert tpu_json.stderr == ""  # --json: no progress lines, and libtpu starts quietly


def test_the_text_report_shows_progress_and_the_torus():
    proc = jaxpod("compile", TINY, "--target", "tpu-v5p:2x2x2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = proc.stderr.strip().splitlines()
    assert all(line.startswith("jaxpod: ") for line in progress), proc.stderr
    assert any("compiling it with XLA:TPU" in line for line in progress)
    assert "on the torus   replica 2 on" in proc.stdout
    assert "planner: device profile 'tpu-v5p'" in proc.stdout


def test_the_replica_axis_fills_from_the_target():
    proc = jaxpod("compile", TINY, "mesh.replica=-1", "--target", "tpu-v5e:4x4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["mesh"] == {"replica": 4, "pipeline": 2, "tensor": 2}
    assert r["planned_profile"] == "tpu-v5e"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--target", "tpu-v5p:2x2x4"], "--target tpu-v5p:2x2x4 has 16 chips but the mesh has 8"),
        (["--target", "v5p-16"], "--target v5p-16 names no target"),
        (["--target", "tpu-v5e:2x2x2"], "TPU v5e is a 2-D torus"),
        (
            ["memory.offload=[activations]", "train.skip_bubbles=true", "--target", "tpu-v4:2x2x2"],
            "train.skip_bubbles=true with memory.offload=[activations] under gpipe: XLA:TPU "
            "cannot compile it for tpu-v4:2x2x2",
        ),
    ],
)
def test_a_target_that_does_not_fit_is_one_line(args, needle):
    assert_user_error(jaxpod("compile", TINY, *args), needle)


# a valid mapping one of XLA:TPU's passes (while-loop all-reduce code motion) fails a check on
REFUSED = ("mesh.replica=4", "mesh.pipeline=1", "mesh.tensor=1", "model.name=bert")
REFUSED += ("model.d_model=512", "model.heads=8", "model.d_ff=2048", "model.seq_len=256")
REFUSED += ("model.vocab=8192", "train.grad_accum=4", "model.remat=full", "memory.rts=4")
REFUSED += ("precision.compute=bfloat16", "precision.params=bfloat16", "precision.master=float32")


def test_a_step_xla_cannot_compile_is_one_line():
    proc = jaxpod("compile", TINY, *REFUSED, "--target", "tpu-v5p:2x2x1", "--json")
    assert_user_error(proc, "XLA could not compile the step for tpu-v5p:2x2x1 (INTERNAL")


def test_a_gpu_compile_reports_every_key():
    """XLA:GPU for 8 compile-only H100s (jax's CUDA plugin, which `make` installs apart)."""
    proc = jaxpod("compile", TINY, "--target", "h100:8", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert set(KEYS) <= set(r)
    assert (r["platform"], r["devices"], r["planned_profile"]) == ("gpu", 8, "h100-80gb")
    assert r["collectives"]["collective-permute"]["count"] > 0
    assert r["layout"] == ""  # NVLink joins a host's GPUs all to all: no torus
    assert proc.stderr == ""
