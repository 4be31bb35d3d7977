"""Named recomputation (remat) policies: one line each, built from `jax.checkpoint_policies`.

A policy decides which intermediate values of a layer are *saved* for the backward pass;
everything else is recomputed from the layer's input. The model tags the interesting
values with `checkpoint_name` (see `jaxpod.models.attention`).

With `memory.offload` containing `activations`, the values a policy saves are *offloaded*
instead: written to `pinned_host` memory in the forward pass and read back in the backward
pass (`OFFLOAD_POLICIES`, built from `save_and_offload_only_these_names` /
`offload_dot_with_no_batch_dims`); what is recomputed does not change. The TPU/GPU lowering
places them on the host; the CPU lowering has no such placement (`jaxpod.parallel.offload`).
The planner counts them on the host where the device profile's backend places them there
(`DeviceProfile.offloads_activations`: XLA:TPU, tests/target/test_offload_tpu.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpod.parallel.tensor import ATTENTION_OUT, ATTENTION_QKV, COLLECTIVE_OUT

cp = jax.checkpoint_policies

# name -> policy; None means "no remat at all" (save everything the autodiff wants).
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": cp.nothing_saveable,  # keep only the layer input
    "minimal": cp.dots_with_no_batch_dims_saveable,  # keep weight matmul outputs
    # keep the attention projections
    "attention": cp.save_only_these_names(ATTENTION_QKV, ATTENTION_OUT),
    "comms": cp.save_only_these_names(COLLECTIVE_OUT),  # recompute local math, never a psum
}


def _offload_names(*names: str) -> Callable:
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )


# name -> the same policy with its saved values living in host memory. `none` saves every
# intermediate; offloaded, it keeps the weight-matmul outputs (`minimal`'s set) on host.
OFFLOAD_POLICIES: dict[str, Callable] = {
    "none": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "full": cp.nothing_saveable,  # saves nothing: nothing to offload
    "minimal": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    "attention": _offload_names(ATTENTION_QKV, ATTENTION_OUT),
    "comms": _offload_names(COLLECTIVE_OUT),
}


def saving(policy: str, *, offload: bool = False) -> Callable:
    """The `jax.checkpoint` policy that saves what the named `policy` saves (`none`:
    everything), for a unit wrapped around layers that already carry it."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {policy!r}; choose from {list(REMAT_POLICIES)}")
    if offload:
        return OFFLOAD_POLICIES[policy]
    return REMAT_POLICIES[policy] or cp.everything_saveable


def remat(
    fn: Callable, policy: str, *, offload: bool = False, prevent_cse: bool = False
) -> Callable:
    """Wrap `fn` (one layer's forward) with the named recomputation policy; `offload=True`
    keeps the saved values in host memory (`OFFLOAD_POLICIES`); `prevent_cse=True` keeps
    XLA from merging the recomputation with an identical computation outside it (needed
    when `fn` runs inside another remat unit: see `jaxpod.parallel.matrix_stream`)."""
    saves = saving(policy, offload=offload)
    if policy == "none" and not offload:
        return fn
    return jax.checkpoint(fn, policy=saves, prevent_cse=prevent_cse)
