"""Parameters carry what generic code needs to know about them: logical axes and roles.

A model creates every weight with `param(value, axes, *roles)`:

- `axes`: one logical name per dimension (`"layers"`, `"embed"`, `"heads"`, `"mlp"`,
  `"vocab"`, `"positions"`, or None); `jaxpod.parallel.mesh.LOGICAL_TO_MESH` maps names to
  mesh axes. A leading `"layers"` axis marks a stacked layer parameter `[L, ...]`.
- roles: `NO_DECAY` (biases, norm scales: no weight decay, no trust ratio) and `TABLE` (a
  token table `[V, D]` that may be used a slice of rows at a time).
- `panel_axis`: the dimension a layer cuts into panels when it is streamed a matrix at a
  time (`Layer.steps`), for the weights that have one.

The optimizer masks, the RTS layout and the streaming code read these (`masks`), never a
parameter's name.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02  # the normal init of every weight matrix and token table
NO_DECAY = "no_decay"
TABLE = "table"
LAYERS = "layers"  # the logical name of the stacked layer axis
PANEL_AXIS = "panel_axis"  # the metadata key of the dimension panels are cut along
STACK = "layers"  # the attribute (and params key) of a stacked model's `[L, ...]` layers


def in_stack(path: tuple) -> bool:
    """Whether a pytree leaf's key path (`jax.tree_util` keys) runs through the stacked layers:
    a parameter's, or an optimizer moment's mirroring it, with the layers as its axis 0."""
    return any(getattr(key, "key", None) == STACK for key in path)


def param(
    value: jax.Array, axes: tuple[str | None, ...], *roles: str, panel_axis: int | None = None
) -> nnx.Param:
    """An `nnx.Param` holding `value` with logical `axes` (one per dimension), `roles` and,
    if it has one, the dimension `panel_axis` of `value` that panels are cut along."""
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not name the {value.ndim} dimensions of {value.shape}")
    panel = {} if panel_axis is None else {PANEL_AXIS: panel_axis}
    return nnx.Param(value, axes=tuple(axes), roles=frozenset(roles), **panel)


def layer_param(
    rngs: nnx.Rngs | None,
    shape,
    axes,
    layers: int | None,
    fill: float | None = None,
    panel_axis: int | None = None,
) -> nnx.Param:
    """A parameter of `shape` (leading `[layers]` axis if stacked): normal(0.02) weights, or
    `fill` for biases and norm parameters (role `NO_DECAY`). `panel_axis`: the dimension of
    `shape` that `Layer.steps` cuts into panels; `axes`: logical names, one per dimension."""
    if layers is not None:
        shape, axes = (layers, *shape), (LAYERS, *axes)
        panel_axis = None if panel_axis is None else panel_axis + 1
    if fill is None:
        value, roles = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32), ()
    else:
        value, roles = jnp.full(shape, fill, jnp.float32), (NO_DECAY,)
    return param(value, axes, *roles, panel_axis=panel_axis)


def panel_axis_of_layer(variable: nnx.Variable) -> int:
    """The dimension of one layer's array of `variable` that panels are cut along (its
    `panel_axis`, less the stacked `"layers"` dimension if it has one)."""
    meta = variable.get_metadata()
    return meta[PANEL_AXIS] - (tuple(meta["axes"])[:1] == (LAYERS,))


def metadata(roles: str | tuple[str, ...] = (), axes: tuple | None = None) -> dict:
    """Metadata for flax's own layers (`kernel_metadata=` / `bias_metadata=`)."""
    roles = (roles,) if isinstance(roles, str) else roles
    return {"roles": frozenset(roles), **({} if axes is None else {"axes": axes})}


class Masks(NamedTuple):
    """Pure-dict trees shaped like the parameters: bools, and `panel`'s dimension tuples."""

    decay: dict  # True: weight decay and trust ratios apply
    stacked: dict  # True: a stacked layer leaf `[L, ...]` (trust ratios per layer)
    table: dict  # True: a token table
    panel: dict  # `(d,)`: panels are cut along dimension d of the stored array; else `()`


def masks(state: nnx.State) -> Masks:
    """The role masks of a model's parameter state (abstract states work: only metadata)."""

    def mask_of(fn) -> dict:
        tree = jax.tree.map(
            lambda v: fn(v.get_metadata()), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        return nnx.to_pure_dict(tree)

    return Masks(
        decay=mask_of(lambda m: NO_DECAY not in m.get("roles", ())),
        stacked=mask_of(lambda m: tuple(m.get("axes") or ())[:1] == (LAYERS,)),
        table=mask_of(lambda m: TABLE in m.get("roles", ())),
        panel=mask_of(lambda m: (m[PANEL_AXIS],) if PANEL_AXIS in m else ()),
    )
