"""A target's devices with no accelerator attached, and the (replica, pipeline, tensor) mesh
laid on its physical torus.

XLA compiles for a TPU slice from its description alone: libtpu's `get_topology_desc` gives
one compile-only device per chip, each with its torus coordinates, and a program lowered on a
mesh of them compiles to XLA:TPU's real program (buffer assignment, host memory included).

The mesh's axes are ordered by how much they talk: tensor (a collective in every layer) last,
then pipeline (one activation per tick), then replica (one gradient reduction per step).
`jax.make_mesh` hands the physical torus axes to the logical axes from the last to the first,
whole axes where sizes allow (a tensor axis of 4 on a 2x2x4 v5p slice takes a 2x2 plane, or
the 4-chip ring), so the tensor group is the chips closest together; where no whole-axis
assignment exists a physical axis is split. An axis laid over several torus axes is then
walked as a snake (boustrophedon: 2x2 as (0,0) (0,1) (1,1) (1,0)), so that consecutive
devices of it, the pipeline's sender and receiver above all, are one hop apart
(`torus_mesh`). `torus_layout` reports where each axis went.
"""

from __future__ import annotations

import importlib.util

import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpod.errors import UserError
from jaxpod.parallel.mesh import AXES
from jaxpod.platform import quiet_tpu_runtime
from jaxpod.target.spec import Target

INSTALL_TPU = (
    "the TPU target needs libtpu, the TPU compiler: pip install 'libtpu==0.0.42.*' (what "
    "`make test` installs into .venv), then run again"
)


def target_devices(target: Target) -> list:
    """The target's compile-only devices, one per chip, ordered by id."""
    if target.platform == "cuda":
        from jaxpod.target.gpu import gpu_topology_devices

        return gpu_topology_devices(target.generation.name, target.chips)
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(INSTALL_TPU)
    quiet_tpu_runtime()
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=target.topology_name, **target.generation.topology_kwargs
    )
    return sorted(topology.devices, key=lambda d: d.id)


def torus_mesh(shape: tuple[int, int, int], devices: list) -> Mesh:
    """A (replica, pipeline, tensor) `Mesh` of `shape` on `devices`, tensor on the closest
    chips: `jax.make_mesh`'s torus assignment, splitting a physical axis only if it must."""
    try:
        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    if grid.flat[0].platform == "tpu":
        for axis in range(grid.ndim):
            grid = np.take(grid, _snake_order(grid, axis), axis=axis)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _snake_order(grid: np.ndarray, axis: int) -> list[int]:
    """The order of the positions along `axis` that walks its torus coordinates as a snake:
    each step one hop (`_snake`); the order it has if it runs along one torus axis."""
    first = tuple(slice(None) if i == axis else 0 for i in range(grid.ndim))
    points = [tuple(d.coords) for d in grid[first]]
    moved = [a for a in range(len(points[0])) if len({p[a] for p in points}) > 1]
    if len(moved) < 2:
        return list(range(len(points)))
    walk = _snake([sorted({p[a] for p in points}) for a in moved])
    rank = {key: i for i, key in enumerate(walk)}
    return sorted(range(len(points)), key=lambda j: rank[tuple(points[j][a] for a in moved)])


def _snake(values: list[list[int]]) -> list[tuple[int, ...]]:
    """Every point of the grid `values[0] x values[1] x ...`, each differing from the one
    before in one coordinate by one step: the rest of the axes walked forward, then back."""
    if len(values) == 1:
        return [(v,) for v in values[0]]
    rest = _snake(values[1:])
    return [(v, *r) for i, v in enumerate(values[0]) for r in (rest if i % 2 == 0 else rest[::-1])]


def torus_layout(mesh: Mesh) -> dict[str, dict]:
    """For each mesh axis: the physical torus axes it runs along (`"x"`, `"y"`, `"z"`) and the
    largest number of torus hops between consecutive devices of it (1: neighbours, counting
    the wrap-around link of a full ring). `{}` off TPU (a GPU host's NVLink is all to all)."""
    grid = mesh.devices
    if grid.flat[0].platform != "tpu":
        return {}
    coords = np.array([getattr(d, "coords", None) or [0] for d in grid.flat])
    coords = coords.reshape(*grid.shape, -1)
    extent = coords.reshape(-1, coords.shape[-1]).max(axis=0) + 1
    layout = {}
    for i, name in enumerate(mesh.axis_names):
        along = np.moveaxis(coords, i, 0)
        step = np.abs(np.diff(along, axis=0))
        step = np.minimum(step, extent - step)  # the torus wraps around
        moved = sorted({int(a) for a in np.nonzero(np.abs(np.diff(along, axis=0)))[-1]})
        layout[name] = {
            "size": int(grid.shape[i]),
            "torus_axes": "".join("xyz"[a] for a in moved),
            "max_hops": int(step.sum(axis=-1).max()) if grid.shape[i] > 1 else 0,
        }
    return layout


def describe_layout(layout: dict[str, dict]) -> str:
    """`replica 4 on z (1 hop), pipeline 2 on y (1 hop), tensor 2 on x (1 hop)`."""
    return ", ".join(
        f"{name} {a['size']}"
        + (
            f" on {a['torus_axes']} ({a['max_hops']} hop{'s' * (a['max_hops'] > 1)})"
            if a["size"] > 1
            else ""
        )
        for name, a in layout.items()
    )
