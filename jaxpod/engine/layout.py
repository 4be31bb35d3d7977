"""Where the engine's state lives: the mesh (its replica axis split for RTS), the parameter
specs inside and outside `shard_map`, the RTS plans of weights and optimizer state, and which
parameters live in host memory (`memory.offload`, `memory.phases`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config.load import Config
from jaxpod.optim.chains import STACKED_KEY, stacked_mask
from jaxpod.parallel import offload
from jaxpod.parallel.mesh import split_replica
from jaxpod.parallel.replica import rts_plan, with_rts
from jaxpod.parallel.stream import block_axes

TABLES = ("wte", "unembed")  # GPT's vocabulary tables: used in blocks of rows (vocab_blocks)


class Layout(NamedTuple):
    """Where everything lives: the engine's mesh and the specs inside/outside `shard_map`."""

    mesh: Mesh  # the caller's mesh, or with the replica axis split for RTS
    batch_axes: tuple[str, ...]  # mesh axes the batch rows are split over
    specs: dict  # the model's layout: what `shard_map` computes with (after gathering)
    store: dict  # params as stored: specs + the RTS axes on the planned dimension
    plan: dict  # per param: the dimension gathered over `rts_axes`, or -1
    rts_axes: tuple[str, ...]
    opt_store: dict  # per-parameter optimizer leaves: specs + the rts_optimizer axes
    host: dict  # per param: True if it lives in pinned_host memory
    host_optimizer: bool
    phases: int
    offload_activations: bool

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Axes over which gradients are summed: the batch axes and `pipeline`."""
        return (*self.batch_axes, "pipeline")

    @property
    def batch_spec(self) -> P:
        axes = self.batch_axes
        return P(axes[0] if len(axes) == 1 else axes, None)

    def param_shardings(self) -> dict:
        return jax.tree.map(
            lambda s, h: NamedSharding(self.mesh, s, memory_kind=offload.HOST if h else None),
            self.store,
            self.host,
            is_leaf=lambda x: isinstance(x, P),
        )


def make_layout(cfg: Config, mesh: Mesh, params: dict, specs: dict) -> Layout:
    """The layout of `cfg.memory` for abstract `params` with model specs `specs`."""
    mem = cfg.memory
    k_opt = mem.rts if mem.rts_optimizer is None else mem.rts_optimizer
    emesh, w_axes, o_axes = split_replica(mesh, mem.rts, k_opt)
    batch_axes = tuple(a for a in emesh.axis_names if a not in ("pipeline", "tensor"))
    stacked = stacked_mask(params)
    everything = "params" in mem.offload
    host = jax.tree.map(lambda s: everything or (s and mem.phases > 1), stacked)
    avoid = jax.tree.map(lambda _: (), stacked)  # dimensions blocks are taken along
    layers_on_host = any(jax.tree.leaves(host[STACKED_KEY]))
    if mem.stream == "matrix" and mesh.shape["pipeline"] == 1 and layers_on_host:
        # each step fetches its blocks (`stack.apply_stack`), taken before the gather
        avoid[STACKED_KEY] = block_axes(params[STACKED_KEY])
    if mem.vocab_blocks > 1:  # blocks of rows, taken before the gather: never split the rows
        avoid.update({name: (0,) for name in TABLES if name in params})
    plan = rts_plan(params, specs, stacked, emesh.shape, w_axes, avoid)
    opt_plan = rts_plan(params, specs, stacked, emesh.shape, o_axes)
    return Layout(
        emesh,
        batch_axes,
        specs,
        with_rts(specs, plan, w_axes),
        plan,
        w_axes,
        with_rts(specs, opt_plan, o_axes),
        host,
        "optimizer" in mem.offload,
        mem.phases,
        "activations" in mem.offload,
    )
