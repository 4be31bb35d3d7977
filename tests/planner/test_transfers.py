"""Every byte the planner credits is a transfer or a buffer the lowered step has.

The planner's memory credits are checked against the program jax lowers, not against the
memory kinds the engine asked for: host-to-device and device-to-host transfers are the
`annotate_device_placement` custom calls of the lowered StableHLO, the host-resident state is
the entry's arguments with `memory_kind = "pinned_host"`, and the blocks gathered are the
`all_gather` results. Each test lowers a small step and checks the structure the planner
assumes (`jaxpod.planner.bytes`): host-resident layers and optimizer state moved whole (no
phase-, panel- or layer-sized transfer exists), no saved activation placed on the host, the
token table and the MLP gathered a block at a time.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helpers import make_tiny_cfg

from jaxpod.planner.plan import plan

PLACEMENT = re.compile(r'_xla_buffer_placement = "(\w+)".*\) -> (tensor<[^>]*>)')
ARGUMENT = re.compile(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}")


def _lowered(mesh_for, *overrides, mesh=(1, 1, 2)) -> str:
    from jaxpod.run.aot import abstract_inputs

    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    return engine.train_step.lower(state, batch).as_text()


def _placements(text: str) -> Counter:
    """(memory kind, result type) of every placement annotation: a transfer when it differs
    from where the value lives."""
    return Counter(m.groups() for m in PLACEMENT.finditer(text))


def _arguments(text: str) -> list[tuple[str, bool]]:
    """(type, on host) of each argument of the entry function."""
    entry = next(line for line in text.splitlines() if "func.func public @main" in line)
    return [(t, 'memory_kind = "pinned_host"' in attrs) for t, attrs in ARGUMENT.findall(entry)]


def _gathers(text: str) -> list[str]:
    return re.findall(r"stablehlo.all_gather.*-> (tensor<[^>]*>)", text)


@pytest.mark.parametrize(
    ("extra", "mesh"),
    [
        (["memory.phases=2"], (1, 1, 2)),
        (["memory.stream=matrix", "memory.mlp_panels=2"], (1, 1, 2)),
        (["memory.phases=2"], (1, 2, 1)),
    ],
    ids=["phases", "matrix", "pipelined"],
)
def test_host_layers_reach_the_device_whole(mesh_for, extra, mesh):
    """With the layer stack host-resident, every transfer in the step moves a whole argument:
    no phase-, panel- or layer-sized piece is ever transferred. So the planner counts the
    stage's stack on the device for the whole step, whatever the phases or the stream."""
    overrides = ["memory.offload=[params]", "model.remat=full", *extra]
    text = _lowered(mesh_for, *overrides, mesh=mesh)
    arguments = _arguments(text)
    host = {t for t, on_host in arguments if on_host}
    stacked = {t for t in host if re.match(r"tensor<4x", t)}  # [L=4, ...] layer leaves
    assert stacked, "the layer stack should be host-resident"
    moved = {t for (kind, t), _ in _placements(text).items() if kind == "device"}
    assert stacked <= moved  # the whole stack is moved to the device
    whole = {t for t, _ in arguments} | {"tensor<f32>", "tensor<i32>"}
    assert moved <= whole, f"pieces transferred: {sorted(moved - whole)}"
    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    resident = make_tiny_cfg("model.remat=full", *extra, mesh=mesh)
    planned, kept = plan(cfg)["bytes_per_device"], plan(resident)["bytes_per_device"]
    assert planned["weights"] == kept["weights"] and planned["grads"] == kept["grads"]
    assert planned["arguments"] < kept["arguments"]  # at rest, the stack is on the host


def test_host_optimizer_state_is_moved_in_whole_for_the_update(mesh_for):
    """The optimizer state rests on the host and every leaf of it is moved to the device in
    one piece and back: the planner counts it whole at the update's peak (`moved_in`)."""
    text = _lowered(mesh_for, "memory.offload=[optimizer]", "model.remat=full")
    arguments = _arguments(text)
    host = {t for t, on_host in arguments if on_host}
    placements = _placements(text)
    to_device = {t for kind, t in placements if kind == "device"}
    to_host = {t for kind, t in placements if kind == "pinned_host"}
    assert host and host <= to_device and host <= to_host  # moved in, written back
    assert to_device | to_host <= {t for t, _ in arguments} | {"tensor<f32>", "tensor<i32>"}
    pod = ("memory.device=ipu-gc200", "model.remat=full")
    b = plan(make_tiny_cfg("memory.offload=[optimizer]", *pod, mesh=(1, 1, 2)))
    kept = plan(make_tiny_cfg(*pod, mesh=(1, 1, 2)))["bytes_per_device"]
    b = b["bytes_per_device"]
    assert b["optimizer"] == 0 and b["moved_in"] == kept["optimizer"] > 0


def test_xla_cpu_reads_host_optimizer_state_in_place(mesh_for):
    """The `cpu` profile's `shares_host_memory`: on XLA:CPU, where both memory kinds are one
    RAM, offloading the optimizer state leaves the step's temporaries as they were (the update
    reads it in place), so the planner moves nothing in on that backend."""
    from jaxpod.run.aot import compile_step

    results = []
    for offload in ("[]", "[optimizer]"):
        cfg = make_tiny_cfg(f"memory.offload={offload}", "model.remat=full", mesh=(2, 1, 1))
        results.append(compile_step(cfg, mesh_for(cfg)))
    kept, offloaded = results
    assert offloaded["temp_bytes"] == kept["temp_bytes"]
    assert offloaded["device_argument_bytes"] < kept["device_argument_bytes"]
    assert offloaded["planned_temp_bytes"] == kept["planned_temp_bytes"]


@pytest.mark.parametrize("remat", ["minimal", "attention"])
def test_no_saved_activation_is_placed_on_the_host(mesh_for, remat):
    """`memory.offload=activations` lowers to no host placement at all (jax 0.10.2): the
    planner keeps every saved activation on the device."""
    text = _lowered(mesh_for, "memory.offload=[activations]", f"model.remat={remat}")
    assert not [t for (kind, t) in _placements(text) if kind == "pinned_host"]
    offloaded = plan(make_tiny_cfg("memory.offload=[activations]", f"model.remat={remat}"))
    kept = plan(make_tiny_cfg(f"model.remat={remat}"))
    assert offloaded["bytes_per_device"]["activations"] == kept["bytes_per_device"]["activations"]


def test_blocks_are_gathered_one_at_a_time(mesh_for):
    """With RTS the token table is all-gathered one block of rows at a time
    (`memory.vocab_slices`) and the MLP one panel at a time (`memory.mlp_panels`): the largest
    gathers are blocks, never the whole table or matrix, as the planner's `gathered` counts."""
    common = ["memory.rts=2", "memory.rts_optimizer=2", "model.remat=full", "model.vocab=512"]
    whole = _gathers(_lowered(mesh_for, *common, mesh=(2, 1, 1)))
    blocks = ["memory.vocab_slices=4", "memory.stream=matrix", "memory.mlp_panels=4"]
    sliced = _gathers(_lowered(mesh_for, *common, *blocks, mesh=(2, 1, 1)))
    assert "tensor<512x64xf32>" in whole and "tensor<512x64xf32>" not in sliced
    assert "tensor<128x64xf32>" in sliced  # a block of 512 / 4 rows
    assert "tensor<64x256xf32>" in whole and "tensor<64x256xf32>" not in sliced
    assert "tensor<64x64xf32>" in sliced  # a panel of 256 / 4 hidden units
    cfgs = [make_tiny_cfg(*common, *extra, mesh=(2, 1, 1)) for extra in ([], blocks)]
    gathered = [plan(c)["bytes_per_device"]["gathered"] for c in cfgs]
    assert gathered[1] < gathered[0]
