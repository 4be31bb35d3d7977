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

from jaxpod.config import MeshConfig
from jaxpod.errors import ConfigError

AXES = ("replica", "pipeline", "tensor")

LOGICAL_TO_MESH: dict[str, str] = {
    "layers": "pipeline",  # each pipeline stage holds a contiguous slice of the layer stack
    "vocab": "tensor",  # vocab-parallel embedding / output projection
    "heads": "tensor",  # attention heads
    "mlp": "tensor",  # MLP hidden units
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


def shardings(mesh: Mesh, specs) -> object:
    """`NamedSharding`s on `mesh` for a tree of `PartitionSpec`s."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
