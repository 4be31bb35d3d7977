"""Compile-only NVIDIA GPUs: XLA:GPU compiles a program for GPUs that are not attached.

With the CUDA plugin of the installed jax (`jax-cuda12-plugin` and `jax-cuda12-pjrt`; the CUDA
libraries are not needed), `jax.experimental.topologies.get_topology_desc(platform="cuda")`
makes compile-only devices from a topology `<slices>x<hosts per slice>x<GPUs per host>` and a
`GpuTargetConfigProto` in text form: the GPU's public figures (SMs, clocks, memory size and
bandwidth, compute capability), kept in `specs/` (XLA's own spec files). A mesh of them
compiles to XLA:GPU's optimized program and buffer assignment (`memory_analysis()`). Each
device's `coords` are `[slice, host, GPU]`: no torus (NVLink joins a host's GPUs all to all).

Limits of these devices: they have no memory spaces, so a `pinned_host` sharding of
an argument falls back to device memory (a `device_put` to the host inside jit still compiles
to host buffers), and `cost_analysis()` returns None.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from jaxpod.errors import UserError

SPECS = Path(__file__).resolve().parent / "specs"
# Where `make` installs XLA:GPU's compiler (the `gpu-target` extra) apart from the packages jax
# looks for plugins in at every start: where no GPU is, a loaded CUDA plugin logs warnings.
# A GPU target puts it on the path before jax starts a backend.
SIDE_DIR = Path(sys.prefix) / "gpu-target"
SPEC_FILES = {"h100": "h100_sxm.txtpb"}  # model -> its GpuTargetConfigProto text
GPUS_PER_HOST = 8


def gpu_topology_devices(model: str, count: int) -> list:
    """`count` compile-only GPUs of `model` ("h100"), ordered by id: one host of `count` (1 to
    8) or, for a multiple of 8, `count / 8` hosts of 8 in one slice."""
    import jax

    if not _cuda_plugin_installed():
        v = jax.__version__
        raise UserError(
            f"a GPU target needs jax's CUDA plugin: pip install 'jax-cuda12-plugin=={v}' "
            f"'jax-cuda12-pjrt=={v}' (no GPU or CUDA libraries needed), then run again"
        )
    if model not in SPEC_FILES:
        raise UserError(f"no GPU spec for {model!r}; known: {', '.join(SPEC_FILES)}")
    if 1 <= count <= GPUS_PER_HOST:
        topology = f"1x1x{count}"
    elif count > 0 and count % GPUS_PER_HOST == 0:
        topology = f"1x{count // GPUS_PER_HOST}x{GPUS_PER_HOST}"
    else:
        raise UserError(f"{count} GPUs: give 1 to 8 (one host) or a multiple of 8 (hosts of 8)")
    # With no CUDA libraries the plugin's version check fails and it does not register, unless
    # skipped (or JAX_PLATFORMS excludes cuda); it only matters for running on a GPU.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    spec = SPECS / SPEC_FILES[model]
    try:
        with _without_driver_notice():
            topo = topologies.get_topology_desc(
                platform="cuda",
                topology_name=topology,
                topology=topology,
                target_config=spec.read_text(),
            )
    except NotImplementedError as e:  # the plugin did not register: its CUDA check failed
        raise UserError(
            f"jax's CUDA plugin did not start ({e}): jax started before its CUDA check could "
            "be skipped; run with JAX_PLATFORMS=cpu"
        ) from e
    except jax.errors.JaxRuntimeError as e:
        raise UserError(
            f"XLA:GPU of jax {jax.__version__} refused {spec.name}: {str(e).splitlines()[0]}"
        ) from e
    return sorted(topo.devices, key=lambda d: d.id)


# What the CUDA plugin logs when it loads where there is no GPU, as expected for a compile for
# GPUs that are not attached: dropped; anything else it writes is passed on.
DRIVER_NOTICE = ("All log messages before absl::InitializeLog()", "Could not find cuda drivers")


@contextlib.contextmanager
def _without_driver_notice():
    """Run the block with file descriptor 2 (C++ logging writes there) captured, then write
    back every captured line but the CUDA plugin's `DRIVER_NOTICE`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(x for x in lines if not any(n in x for n in DRIVER_NOTICE)))


def _cuda_plugin_installed() -> bool:
    """Whether jax's CUDA 12 or 13 plugin is installed (neither is imported); one in
    `SIDE_DIR` is put on the path."""
    if SIDE_DIR.is_dir() and str(SIDE_DIR) not in sys.path:
        sys.path.append(str(SIDE_DIR))
        importlib.invalidate_caches()
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
