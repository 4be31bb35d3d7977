"""Where a stacked model's state lives: the mesh (its replica axis split for RTS), the
parameter specs inside and outside `shard_map`, the RTS dimensions of weights and optimizer
state, and which parameters live in host memory (`memory.offload`, `memory.phases`).

Everything is read from the parameters' roles (`jaxpod.models.params.Masks`), never from
their names.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config
from jaxpod.models.params import Masks
from jaxpod.parallel import offload
from jaxpod.parallel.mesh import split_replica
from jaxpod.parallel.replica import NO_GATHER, rts_dims, with_rts


class Placement(NamedTuple):
    """Where everything lives: the engine's mesh and the specs inside/outside `shard_map`."""

    mesh: Mesh  # the caller's mesh, or with the replica axis split for RTS
    batch_axes: tuple[str, ...]  # mesh axes the batch rows are split over
    specs: dict  # the model's layout: what `shard_map` computes with (after gathering)
    stored_specs: dict  # params as stored: specs + the RTS axes on the RTS dimension
    rts_dims: dict  # per param: the dimension gathered over `rts_axes`, or -1
    rts_axes: tuple[str, ...]
    opt_specs: dict  # per-parameter optimizer leaves: specs + the rts_optimizer axes
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
        """Leading (batch) dimension split over the batch axes."""
        axes = self.batch_axes
        return P(axes[0] if len(axes) == 1 else axes)

    def param_shardings(self) -> dict:
        return jax.tree.map(
            lambda s, h: NamedSharding(self.mesh, s, memory_kind=offload.HOST if h else None),
            self.stored_specs,
            self.host,
            is_leaf=lambda x: isinstance(x, P),
        )


def make_placement(cfg: Config, mesh: Mesh, params: dict, specs: dict, masks: Masks) -> Placement:
    """The placement of `cfg.memory` for abstract `params` with model specs `specs` and role
    `masks` (`masks.panel`: per leaf, the dimensions streaming cuts panels along)."""
    mem = cfg.memory
    k_opt = mem.rts if mem.rts_optimizer is None else mem.rts_optimizer
    emesh, w_axes, o_axes = split_replica(mesh, mem.rts, k_opt)
    batch_axes = tuple(a for a in emesh.axis_names if a not in ("pipeline", "tensor"))
    everything = "params" in mem.offload
    host = jax.tree.map(lambda s: everything or (s and mem.phases > 1), masks.stacked)
    layers_on_host = any(jax.tree.leaves(jax.tree.map(lambda h, s: h and s, host, masks.stacked)))
    avoid = jax.tree.map(lambda _: (), masks.stacked)  # dimensions panels are cut along
    if mem.vocab_slices > 1:  # slices of rows, cut before the gather: never split the rows
        avoid = jax.tree.map(lambda t, a: (0,) if t else a, masks.table, avoid)
    dims = rts_dims(params, specs, masks.stacked, emesh.shape, w_axes, avoid)
    if mem.stream == "matrix":
        # each step gathers (and, host-resident, fetches) only its panels, cut from the local
        # shard before the gather: RTS splits another dimension. A leaf with no other (the
        # MLP biases) is gathered whole and then cut, unless its panels are fetched.
        cut = jax.tree.map(lambda s, a, p: p if s else a, masks.stacked, avoid, masks.panel)
        panel_dims = rts_dims(params, specs, masks.stacked, emesh.shape, w_axes, cut)
        keep = lambda d, p: d if p == NO_GATHER and not layers_on_host else p  # noqa: E731
        dims = jax.tree.map(keep, dims, panel_dims)
    opt_dims = rts_dims(params, specs, masks.stacked, emesh.shape, o_axes)
    if k_opt == mem.rts:
        # the optimizer state split along the weights' dimension wherever the weights are
        # split (vocabulary slices and panels move it): the update's gradients, weights and
        # moments are then the same shards, with no all-to-all to reshard them
        same = lambda w, o: o if w == NO_GATHER else w  # noqa: E731
        opt_dims = jax.tree.map(same, dims, opt_dims)
    return Placement(
        emesh,
        batch_axes,
        specs,
        with_rts(specs, dims, w_axes),
        dims,
        w_axes,
        with_rts(specs, opt_dims, o_axes),
        host,
        "optimizer" in mem.offload,
        mem.phases,
        "activations" in mem.offload,
    )
