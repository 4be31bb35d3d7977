"""The train state every model shares, and where its optimizer state lives.

    TrainState(step int32[], params, opt_state=OptState(tx, loss_scale))

`params` is the model's tree as its stage layout stores it: nested dicts of (sharded) arrays
for stacked models, per-dtype stage rows `{dtype: [S, n]}` for packed ones. `tx` is the optax
chain's state of the same layout; `loss_scale` the `LossScaleState` (replicated scalars).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxpod.optim.precision import LossScaleState
from jaxpod.platform import cpu_only

# XLA:CPU's LLVM optimization level for the state's init, a program that runs once per run:
# at -O1 it compiles in about 40 % less time than at the default level and computes the same
# bits (tests/engine/test_init.py): run once, its compile time outweighs its run time, so a
# fresh run on CPU starts sooner.
INIT_OPTIONS = {"xla_backend_optimization_level": 1}


def compile_once(fn: Callable, out_shardings, *args) -> jax.stages.Compiled:
    """`jax.jit(fn, out_shardings=out_shardings)` compiled for `args` as a program that runs
    once (the state's init): on CPU with `INIT_OPTIONS`, elsewhere as any jit."""
    options = cpu_only(INIT_OPTIONS)
    return jax.jit(fn, out_shardings=out_shardings).lower(*args).compile(compiler_options=options)


def put_global(tree, shardings):
    """`tree`'s host values as global arrays of `shardings`, each process writing only the
    shards it addresses. (A `device_put` of a one-device array onto a sharding that spans
    processes gives, in jax's multi-process runtime, an array whose shards cannot be read.)"""

    def put(x, sharding):
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree, shardings)


class OptState(NamedTuple):
    """`tx`: the optax chain's state; `loss_scale`: the `LossScaleState`."""

    tx: optax.OptState
    loss_scale: LossScaleState


class TrainState(NamedTuple):
    """`step` int32[] (optimizer steps taken), `params` (master dtype) and `opt_state`."""

    step: jax.Array
    params: Any
    opt_state: OptState


def optimizer_shardings(optimizer: optax.GradientTransformation, params, other, like=None):
    """Shardings of `optimizer.init(params)`: per-parameter leaves (moments) take their
    parameter's sharding (or the matching leaf of `like`, a tree of shardings); everything
    else (step counts) gets `other`."""
    abstract = jax.eval_shape(optimizer.init, params)
    like = jax.tree.map(lambda p: p.sharding, params) if like is None else like
    return optax.tree_map_params(
        optimizer, lambda _, s: s, abstract, like, transform_non_params=lambda _: other
    )


def with_shardings(shapes, shardings):
    """`ShapeDtypeStruct`s of `shapes` carrying the matching leaf of `shardings`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings
    )
