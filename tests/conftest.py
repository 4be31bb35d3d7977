"""Shared test setup: 8 virtual CPU devices, and helpers to build tiny configs and their meshes.

XLA reads `XLA_FLAGS` once, when jax initialises its backend, so the flag is set here at import
time: pytest imports this file before any test module (and so before jax is imported by them).
Other XLA flags already in the environment are kept; only the device count is replaced.
jax itself is imported lazily, so jax-free test modules (config, data) stay jax-free.

Tests that use the `tiny_cfg`/`mesh_for` fixtures also get jax's persistent compilation cache
in a fresh temporary directory for the session (`xla_compilation_cache`; in this process only,
nothing leaks into subprocesses through the environment): they build the same jitted programs
repeatedly (e.g. the sharded parameter init inside every `build_engine`), and the cache is keyed
on the full program and compile options, so a hit is the identical executable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from jaxpod.platform import use_virtual_cpu_devices  # jax-free: safe before jax starts

DEVICE_COUNT = 8

use_virtual_cpu_devices(DEVICE_COUNT)
os.environ["JAX_PLATFORMS"] = "cpu"

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


def make_tiny_cfg(*overrides: str, mesh: tuple[int, int, int] | None = None, **kw):
    """A resolved config from `configs/tiny.yaml` plus overrides.

    `overrides` are CLI-style strings (`"optim.name=sgd"`); keyword overrides use `__` for the
    dot (`optim__name="sgd"`, values are YAML-parsed like on the CLI); `mesh=(r, p, t)` sets
    `mesh.*` and `devices = r * p * t`. Keyword/mesh overrides are applied after the strings.
    """
    from jaxpod.config import load_config

    args = list(overrides)
    if mesh is not None:
        r, p, t = mesh
        args += [f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}"]
        args += [f"mesh.tensor={t}"]
    for key, value in kw.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        args.append(f"{key.replace('__', '.')}={text}")
    return load_config(TINY_YAML, args)


def model_params_and_specs(cfg):
    """The transformer of `cfg` as `(params ShapeDtypeStructs, PartitionSpecs)`: no weights,
    no mesh (the model's own logical layout)."""
    from flax import nnx

    from jaxpod.engine.stacked import build_model
    from jaxpod.parallel.mesh import param_specs

    state = nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, cfg.train.seed)))
    return nnx.to_pure_dict(state), param_specs(state)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_for(cfg):
    """The (replica, pipeline, tensor) `Mesh` of `cfg` on the first `cfg.devices` devices."""
    import jax

    from jaxpod.parallel.mesh import make_mesh

    n = cfg.mesh.replica * cfg.mesh.pipeline * cfg.mesh.tensor
    devices = jax.devices()
    if len(devices) < n:
        pytest.fail(
            f"need {n} devices, jax has {len(devices)}: was jax initialised before conftest set "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}?"
        )
    return make_mesh(cfg.mesh, devices[:n])


def _reset_jax_cache_state() -> None:
    """jax memoizes "is the persistent cache used?" at the first compile; make it look again."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - the cache is only a speed-up
        return
    compilation_cache.reset_cache()


@pytest.fixture(scope="session")
def xla_compilation_cache():
    """A session-wide persistent compilation cache (unless one is configured already)."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        yield jax.config.jax_compilation_cache_dir
        return
    path = tempfile.mkdtemp(prefix="jaxpod-test-xla-cache-")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _reset_jax_cache_state()
    yield path
    jax.config.update("jax_compilation_cache_dir", None)
    _reset_jax_cache_state()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_cfg(xla_compilation_cache):
    """Factory: `tiny_cfg(*"key=value", mesh=(r, p, t), section__key=value)` -> Config."""
    return make_tiny_cfg


@pytest.fixture(name="mesh_for", scope="session")
def mesh_for_fixture(xla_compilation_cache):
    """Factory: `mesh_for(cfg)` -> the cfg's `Mesh` on `jax.devices()[:n]`."""
    return mesh_for
