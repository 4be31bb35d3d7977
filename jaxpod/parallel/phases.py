"""Phases: a stage's layer stack cut into K scans, each able to fetch its own weights.

With the stack resting in host memory, a fetching phase moves its `[L/K, ...]` weights to the
device right before it runs, as a remat unit that never saves them: the backward pass fetches
them again instead of holding every phase's copy (`PHASE_WEIGHTS`). Its slice of the stack
depends on its input (`fetch_phase`), so each micro-batch fetches it again, in turn.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpod.parallel.layer_scan import scan_layers
from jaxpod.parallel.manual import vary_like, varying_axes
from jaxpod.parallel.remat import REMAT_POLICIES

# Weights a phase fetched (see `scan_phases`): never saved for the backward pass, fetched again.
PHASE_WEIGHTS = "phase_weights"
# A layer's input inside a fetching phase: what the phase saves per layer under remat.
LAYER_INPUT = "phase_layer_input"


def scan_phases(
    layer_fn: Callable,
    x: jax.Array,
    stacked: dict,
    *,
    unroll: bool = False,
    loop: bool = False,
    phases: int = 1,
    fetch: Callable | None = None,
    remat_policy: str = "none",
) -> jax.Array:
    """Apply `layer_fn(x, one_layer_params) -> x` to every layer of `stacked` (`[L, ...]`).

    With `phases=K` the stack is cut into K contiguous phases of L/K layers, each its own
    scan. With `fetch` (e.g. host to device memory) a phase is a `jax.checkpoint` that takes
    the whole stack, slices its own L/K layers out of it and fetches them (`fetch_phase`),
    then runs them: it keeps what the layers' `remat_policy` keeps (each layer's input and
    the policy's values; with `none`, everything) but never the fetched weights
    (`PHASE_WEIGHTS`): the backward pass fetches each phase's weights again instead of
    keeping every phase's copy alive. (An outer policy overrides the inner one: "save
    anything" here would save every layer's intermediates whatever the layer's policy.) The
    result does not depend on K. `unroll`, `loop`: how each phase runs its layers
    (`scan_layers`).
    """
    if phases == 1 and fetch is None:
        return scan_layers(layer_fn, x, stacked, unroll, loop)
    size = jax.tree.leaves(stacked)[0].shape[0]
    if size % phases:
        raise ValueError(f"{size} layers do not split into phases={phases}")
    n = size // phases
    if fetch is None:
        for i in range(phases):
            part = jax.tree.map(lambda a, i=i: a[i * n : (i + 1) * n], stacked)
            x = scan_layers(layer_fn, x, part, unroll, loop)
        return x
    step = layer_fn
    if remat_policy != "none":
        step = lambda x, p: layer_fn(checkpoint_name(x, LAYER_INPUT), p)  # noqa: E731

    def phase(x, stacked, i):
        fetched = fetch_phase(stacked, i * n, n, x, fetch)
        fetched = jax.tree.map(lambda a: checkpoint_name(a, PHASE_WEIGHTS), fetched)
        return scan_layers(step, x, fetched, unroll, loop)

    # prevent_cse: the backward pass's fetch must not be merged with the forward pass's
    # (the same slice of the same stack), which would keep every phase's copy alive
    phase = jax.checkpoint(
        phase, policy=phase_policy(remat_policy), prevent_cse=True, static_argnums=(2,)
    )
    for i in range(phases):
        x = phase(x, stacked, i)
    return x


def fetch_phase(stacked: dict, start: int, size: int, x: jax.Array, fetch: Callable) -> dict:
    """`fetch` of the layers `[start, start + size)` of `stacked`, read as a slice whose start
    depends on `x` (its value is `start`): the fetch can run only once `x` exists, so XLA
    can neither hoist it out of a loop around the phase (every micro-batch fetches it
    again) nor start every phase's fetch at once. A leaf whose varying axes do not cover
    `x`'s is sliced at `start` as it is (the index would widen its type)."""
    token = jax.lax.stop_gradient(x.reshape(-1)[0])  # an order, not a value: no gradient
    zero = (jnp.nan_to_num(token) * 0).astype(jnp.int32)  # finite, so exactly 0

    def take(a):
        if varying_axes(token) <= varying_axes(a):
            return jax.lax.dynamic_slice_in_dim(a, vary_like(start + zero, a), size)
        return a[start : start + size]

    return fetch(jax.tree.map(take, stacked))


def phase_policy(remat_policy: str) -> Callable:
    """What a fetching phase saves for the backward pass: with `none` everything but the
    fetched weights; otherwise each layer's input (`LAYER_INPUT`) and what the layer's
    policy saves, as the same layers scanned without phases would."""
    cp = jax.checkpoint_policies
    if remat_policy == "none":
        return cp.save_anything_except_these_names(PHASE_WEIGHTS)
    inputs = cp.save_only_these_names(LAYER_INPUT)
    return cp.save_from_both_policies(inputs, REMAT_POLICIES[remat_policy])
