"""The (replica, pipeline, tensor) device mesh and where each parameter lives on it.

Models name their parameter dimensions logically (`"layers"`, `"vocab"`, ...); the table
`LOGICAL_TO_MESH` is the single place that says which mesh axis splits which kind of
dimension. Everything not named there is replicated.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config, MeshConfig
from jaxpod.errors import ConfigError

AXES = ("replica", "pipeline", "tensor")

LOGICAL_TO_MESH: dict[str, str] = {
    "layers": "pipeline",  # each pipeline stage holds a contiguous part of the layer stack
    "vocab": "tensor",  # vocab-parallel embedding / output projection
    "heads": "tensor",  # attention heads
    "mlp": "tensor",  # MLP hidden units
    "positions": "tensor",  # the position table of sequence-parallel models, split along T
}


def select_devices(count: int) -> list[jax.Device]:
    """The devices a run with config `devices=count` uses.

    On CPU, `count` virtual devices (the process may have more, e.g. under pytest). On a
    real TPU/GPU backend every device takes part and `count` is not consulted.
    """
    devices = jax.devices()
    if devices[0].platform != "cpu":
        return devices
    if len(devices) < count:
        raise ConfigError(
            f"devices={count} but jax started with {len(devices)} CPU devices; set devices "
            "before jax starts (the jaxpod CLI does) or lower devices"
        )
    return devices[:count]


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A `Mesh` with axes `(replica, pipeline, tensor)` of sizes from `cfg`.

    Axes are `Auto`-typed: the kernels are explicit `shard_map`s and the optimizer update is
    left to the GSPMD partitioner, which keeps whole-parameter reductions (norms) correct.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = (cfg.replica, cfg.pipeline, cfg.tensor)
    need = shape[0] * shape[1] * shape[2]
    if need != len(devices):
        raise ConfigError(
            f"mesh replica*pipeline*tensor = {need} does not match the {len(devices)} available "
            "devices; change mesh.* or devices"
        )
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_for(cfg: Config) -> Mesh:
    """The mesh a run of `cfg` trains on: `make_mesh` over the devices `select_devices` picks
    for `cfg.total_devices` (what `jaxpod train` and `jaxpod compile` build)."""
    return make_mesh(cfg.mesh, select_devices(cfg.total_devices))


RTS_AXES = ("rts_outer", "rts_inner")


def split_replica(
    mesh: Mesh, rts: int, rts_optimizer: int
) -> tuple[Mesh, tuple[str, ...], tuple[str, ...]]:
    """The engine's mesh for replicated tensor sharding, and the axes weights and optimizer
    state are split over.

    With `rts = rts_optimizer = 1` this is `mesh` itself. Otherwise the replica axis (size
    r) is reshaped, row-major, into `(replica, rts_outer, rts_inner)` of sizes
    `(r / big, big / small, small)` with `small, big = sorted((rts, rts_optimizer))`: groups
    of `small` consecutive replicas inside groups of `big`. Weights are split over the axes
    whose product is `rts`, optimizer state over those giving `rts_optimizer` (so one must
    divide the other). The devices and their order are unchanged, and batch row r still
    lands on the same device (rows are split over the three axes, outer-major).
    """
    if rts == 1 and rts_optimizer == 1:
        return mesh, (), ()
    small, big = sorted((rts, rts_optimizer))
    if big % small:
        raise ConfigError(
            f"memory.rts={rts} and memory.rts_optimizer={rts_optimizer} must divide one "
            "another (weights and optimizer state are split over nested replica groups)"
        )
    r, p, t = (mesh.shape[a] for a in AXES)
    devices = mesh.devices.reshape(r // big, big // small, small, p, t)
    names = ("replica", *RTS_AXES, "pipeline", "tensor")
    split = Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))

    def axes(k: int) -> tuple[str, ...]:
        return () if k == 1 else ("rts_inner",) if k == small else RTS_AXES

    return split, axes(rts), axes(rts_optimizer)


def logical_to_spec(axes: tuple[str | None, ...]) -> P:
    """`("layers", "embed", "mlp") -> P("pipeline", None, "tensor")`."""
    return P(*(LOGICAL_TO_MESH.get(a) if a else None for a in axes))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def param_specs(state: nnx.State) -> dict:
    """Nested dict of `PartitionSpec`s mirroring `state`, from each Param's `axes` metadata."""
    specs = jax.tree.map(
        lambda v: logical_to_spec(v.get_metadata()["axes"]), state, is_leaf=_is_var
    )
    return nnx.to_pure_dict(specs)


def shardings(mesh: Mesh, specs, memory_kind: str | None = None) -> object:
    """`NamedSharding`s on `mesh` for a tree of `PartitionSpec`s (in `memory_kind`)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
