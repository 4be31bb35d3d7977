"""Phases: a stage's layer stack cut into K scans, each able to fetch its own weights.

With the stack resting in host memory, a fetching phase moves its `[L/K, ...]` weights to the
device right before it runs, as a remat unit that never saves them: the backward pass fetches
them again instead of holding every phase's copy (`PHASE_WEIGHTS`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpod.parallel.layer_scan import scan_layers
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
    phases: int = 1,
    fetch: Callable | None = None,
    remat_policy: str = "none",
) -> jax.Array:
    """Apply `layer_fn(x, one_layer_params) -> x` to every layer of `stacked` (`[L, ...]`).

    With `phases=K` the stack is cut into K contiguous phases of L/K layers, each its own
    scan, and `fetch` (if given) is applied to a phase's `[L/K, ...]` weights right before
    that phase runs (e.g. host to device memory). A fetching phase is a `jax.checkpoint`
    that keeps what the layers' `remat_policy` keeps (each layer's input and the policy's
    values; with `none`, everything) but never the fetched weights (`PHASE_WEIGHTS`): the
    backward pass fetches each phase's weights again instead of keeping every phase's copy
    alive. (An outer policy overrides the inner one: "save anything" here would save every
    layer's intermediates whatever the layer's policy.) The result does not depend on K.
    """
    if phases == 1 and fetch is None:
        return scan_layers(layer_fn, x, stacked, unroll)
    size = jax.tree.leaves(stacked)[0].shape[0]
    if size % phases:
        raise ValueError(f"{size} layers do not split into phases={phases}")
    n = size // phases
    step = layer_fn
    if fetch is not None and remat_policy != "none":
        step = lambda x, p: layer_fn(checkpoint_name(x, LAYER_INPUT), p)  # noqa: E731

    def phase(x, phase_layers):
        if fetch is not None:
            fetched = fetch(phase_layers)
            phase_layers = jax.tree.map(lambda a: checkpoint_name(a, PHASE_WEIGHTS), fetched)
        return scan_layers(step, x, phase_layers, unroll)

    if fetch is not None:
        phase = jax.checkpoint(phase, policy=phase_policy(remat_policy), prevent_cse=False)
    for i in range(phases):
        x = phase(x, jax.tree.map(lambda a, i=i: a[i * n : (i + 1) * n], stacked))
    return x


def phase_policy(remat_policy: str) -> Callable:
    """What a fetching phase saves for the backward pass: with `none` everything but the
    fetched weights; otherwise each layer's input (`LAYER_INPUT`) and what the layer's
    policy saves, as the same layers scanned without phases would."""
    cp = jax.checkpoint_policies
    if remat_policy == "none":
        return cp.save_anything_except_these_names(PHASE_WEIGHTS)
    inputs = cp.save_only_these_names(LAYER_INPUT)
    return cp.save_from_both_policies(inputs, REMAT_POLICIES[remat_policy])
