"""Named recomputation (remat) policies: one line each, built from `jax.checkpoint_policies`.

A policy decides which intermediate values of a layer are *saved* for the backward pass;
everything else is recomputed from the layer's input. The model tags the interesting
values with `checkpoint_name` (see `jaxpod.models.layers`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpod.parallel.tensor import COLLECTIVE_OUT

cp = jax.checkpoint_policies

# name -> policy; None means "no remat at all" (save everything the autodiff wants).
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": cp.nothing_saveable,  # keep only the layer input
    "minimal": cp.dots_with_no_batch_dims_saveable,  # keep weight matmul outputs
    "attention": cp.save_only_these_names("qkv", "attn_out"),  # keep the attention projections
    "comms": cp.save_only_these_names(COLLECTIVE_OUT),  # recompute local math, never a psum
}


def remat(fn: Callable, policy: str) -> Callable:
    """Wrap `fn` (one layer's forward) with the named recomputation policy."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose from {list(REMAT_POLICIES)}")
    saveable = REMAT_POLICIES[policy]
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=saveable, prevent_cse=False)
