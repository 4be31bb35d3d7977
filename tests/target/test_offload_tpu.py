"""Host offload in XLA:TPU's program of the tiny step (no TPU attached): the offloaded state
is in host memory, by exactly its bytes, and off the device's arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import make_tiny_cfg

pytestmark = pytest.mark.slow

MESH = (2, 2, 2)
# widths XLA:TPU stores unpadded (its tiles are 128 wide): the state's bytes are its logical bytes
WIDE = ("model.d_model=256", "model.heads=2", "model.d_ff=1024", "model.vocab=1024")


def _compiled(*overrides: str):
    from jaxpod.inspect.compile import abstract_inputs, compile_for_target
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    cfg = make_tiny_cfg(*overrides, mesh=MESH)
    target = parse_target("tpu-v5p:2x2x2")
    _, state, _ = abstract_inputs(cfg, torus_mesh(MESH, target_devices(target)))
    return state, compile_for_target(cfg, target)


def _host_bytes(state) -> int:
    """Bytes per chip of the state's host-resident leaves (their shard shapes)."""
    import jax

    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(state)
        if leaf.sharding.memory_kind == "pinned_host"
    )


def test_offloaded_state_is_in_host_memory_and_off_the_device():
    _, plain = _compiled(*WIDE)
    state, offloaded = _compiled(*WIDE, "memory.offload=[params,optimizer]")
    host = _host_bytes(state)
    assert host > 0 and plain["host_argument_bytes"] == 0
    assert offloaded["host_argument_bytes"] == host == offloaded["memory_spaces"]["cmem"]
    assert plain["device_argument_bytes"] - offloaded["device_argument_bytes"] == host
    # the new state goes back to the host: at least its bytes cross each way
    assert offloaded["transfers"]["to_host"]["executed_bytes"] >= host
    assert offloaded["transfers"]["to_device"]["executed_bytes"] >= host
    assert plain["transfers"]["to_host"]["count"] == 0


def test_saved_activations_go_to_host_memory_without_a_pipeline():
    """`memory.offload=[activations]` with the comms policy on a 4x1x2 mesh: XLA:TPU places
    the saved values in host memory: what the policy keeps of each layer, its input and its
    attention psum, [b, T, D] float32 each."""
    global MESH
    mesh, MESH = MESH, (4, 1, 2)
    try:
        _, r = _compiled("memory.offload=[activations]", "model.remat=comms")
    finally:
        MESH = mesh
    cfg = make_tiny_cfg(mesh=(4, 1, 2))
    md, b = cfg.model, cfg.train.micro_batch
    assert r["host_temp_bytes"] == md.layers * 2 * b * md.seq_len * md.d_model * 4
