"""A target's compile-only devices and the mesh laid on its torus (libtpu, no TPU attached).

The mesh puts tensor on the torus axes first, then pipeline, then replica, and walks an axis
laid over several torus axes as a snake: every pair of consecutive devices of the tensor and
pipeline axes is one ICI hop apart on the slices the presets and the held-out set use.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpod.platform import QUIET_TPU_RUNTIME
from jaxpod.target.devices import _snake, torus_layout, torus_mesh
from jaxpod.target.spec import parse_target

MESHES = [
    ("tpu-v5p:2x2x2", (2, 2, 2)),
    ("tpu-v5p:2x2x4", (4, 4, 1)),
    ("tpu-v5p:2x2x4", (2, 2, 4)),
    ("tpu-v5p:8x8x4", (4, 8, 8)),
    ("tpu-v5e:4x4", (8, 2, 1)),
    ("tpu-v4:2x2x4", (2, 2, 4)),
    ("tpu-v6e:2x4", (2, 1, 4)),
    ("tpu-v5p:2x2x4", (1, 1, 16)),
]


@pytest.fixture(scope="module")
def devices():
    from jaxpod.target.devices import target_devices

    return lambda text: target_devices(parse_target(text))


@pytest.mark.parametrize(("target", "shape"), MESHES)
def test_tensor_and_pipeline_neighbours_are_one_hop_apart(devices, target, shape):
    chips = devices(target)
    mesh = torus_mesh(shape, chips)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in chips)
    layout = torus_layout(mesh)
    for axis, size in zip(("replica", "pipeline", "tensor"), shape, strict=True):
        assert layout[axis]["size"] == size
    for axis in ("pipeline", "tensor"):
        assert layout[axis]["max_hops"] == (1 if layout[axis]["size"] > 1 else 0), layout


def test_the_tensor_axis_takes_whole_torus_axes_first(devices):
    """GPT-3's p8 t8 r4 on a 8x8x4 v5p slice: each axis one whole ring of the torus, tensor on
    an 8-chip ring (not the 4-chip one, which replica gets)."""
    layout = torus_layout(torus_mesh((4, 8, 8), devices("tpu-v5p:8x8x4")))
    assert len(layout["tensor"]["torus_axes"]) == 1
    assert len(layout["pipeline"]["torus_axes"]) == 1
    assert layout["replica"]["torus_axes"] == "z"  # the 4-chip axis


def test_v4_has_one_device_per_chip(devices):
    chips = devices("tpu-v4:2x2x2")
    assert len(chips) == 8
    assert len({tuple(d.coords) for d in chips}) == 8


@pytest.mark.parametrize("sizes", [(2, 2), (4, 2), (2, 3, 2), (4,)])
def test_a_snake_visits_every_point_one_step_at_a_time(sizes):
    walk = _snake([list(range(n)) for n in sizes])
    assert sorted(walk) == sorted(np.ndindex(*sizes))
    steps = np.abs(np.diff(np.array(walk), axis=0)).sum(axis=1)
    assert (steps == 1).all()


@pytest.mark.parametrize("quiet", [True, False])
def test_libtpu_starts_quietly_without_tpus(quiet, tmp_path):
    """With libtpu installed and no TPU attached, a jax start and a topology print nothing and
    write no log file once `quiet_tpu_runtime` ran; without it, libtpu complains about TPU
    hosts and logs to files (so the test can fail)."""
    drop = {"JAX_PLATFORMS", "XLA_FLAGS", *QUIET_TPU_RUNTIME}
    logs = tmp_path / "tpu_logs"
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"TPU_LOG_DIR": str(logs)}
    code = (
        "import jax; jax.devices(); from jax.experimental import topologies; "
        "topologies.get_topology_desc(platform='tpu', topology_name='v5p:2x2x1')"
    )
    if quiet:
        code = "from jaxpod.platform import quiet_tpu_runtime; quiet_tpu_runtime(); " + code
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stderr == "") == quiet, proc.stderr
    written = sorted(p.name for p in logs.glob("*")) if logs.exists() else []
    assert (written == []) == quiet, written


def test_without_libtpu_the_target_says_what_to_install(monkeypatch):
    import importlib.util

    from jaxpod.errors import UserError
    from jaxpod.target import devices

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"pip install 'libtpu==0\.0\.42\.\*'"):
        devices.target_devices(parse_target("tpu-v5p:2x2x2"))


def test_without_the_cuda_plugin_a_gpu_target_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    from jaxpod.errors import UserError
    from jaxpod.target import gpu

    monkeypatch.setattr(gpu, "SIDE_DIR", tmp_path / "absent")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a),
    )
    with pytest.raises(UserError, match="pip install 'jax-cuda12-plugin=="):
        gpu.gpu_topology_devices("h100", 8)
