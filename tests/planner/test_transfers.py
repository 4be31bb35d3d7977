"""Every byte the planner credits is a transfer or a buffer the lowered step has.

The planner's memory credits are checked against the program jax lowers, not against the
memory kinds the engine asked for: host-to-device and device-to-host transfers are the
`annotate_device_placement` custom calls of the lowered StableHLO, the host-resident state is
the entry's arguments with `memory_kind = "pinned_host"`, and the blocks gathered are the
`all_gather` results. Each test lowers a small step and checks the structure the planner
assumes (`jaxpod.planner.bytes`): host-resident layers and optimizer state moved whole (no
phase-, panel- or layer-sized transfer exists), no saved activation placed on the host, the
token table and the MLP gathered a block at a time.

That is the CPU lowering, the program XLA:CPU compiles here. The same step lowered for TPU or
GPU (`lowering_platforms`, no such device needed) has what the CPU lowering drops: the phases'
and the matrices' fetches and the saved activations' offload; the last tests find them. The
planner credits none of them, for any profile.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helpers import make_tiny_cfg

from jaxpod.planner.plan import plan

PLACEMENT = re.compile(r'_xla_buffer_placement = "(\w+)".*\) -> (tensor<[^>]*>)')
ARGUMENT = re.compile(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}")


def _lowered(mesh_for, *overrides, mesh=(1, 1, 2), platform: str | None = None) -> str:
    """The tiny step's StableHLO as jax lowers it for this backend, or for `platform`."""
    from jaxpod.run.aot import abstract_inputs

    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
    if platform is None:
        return engine.train_step.lower(state, batch).as_text()
    traced = engine.train_step.trace(state, batch)
    return traced.lower(lowering_platforms=(platform,)).as_text()


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
    """`memory.offload=activations` lowers to no host placement at all on CPU: the
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


# jax lowers a placement inside jit (`jax.device_put` to a memory kind, a remat policy's
# offload) for TPU and GPU only; the CPU lowering, which XLA:CPU compiles, drops them. Lowering
# for another platform needs no such device: these programs are read, never compiled.
ACCELERATORS = ("tpu", "cuda")
OFFLOADED_LAYERS = ("memory.offload=[params]", "model.remat=full")


def _placed(text: str, kind: str) -> set[str]:
    """The types placed in memory `kind` (`device` or `pinned_host`) anywhere in `text`."""
    return {t for k, t in _placements(text) if k == kind}


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_lowering_fetches_a_phase_at_a_time(mesh_for, platform):
    """The phases' fetches are in the TPU/GPU program: with 4 layers in 2 phases on tensor 2,
    the MLP's input matrices move in [2, 64, 128] pieces, a phase of the device's
    [4, 64, 128]. The CPU lowering has no such piece (`test_host_layers_reach_the_device_whole`),
    and the planner counts the CPU lowering's structure for every profile."""
    phases = (*OFFLOADED_LAYERS, "memory.phases=2")
    assert "tensor<2x64x128xf32>" in _placed(
        _lowered(mesh_for, *phases, platform=platform), "device"
    )
    assert "tensor<2x64x128xf32>" not in _placed(_lowered(mesh_for, *phases), "device")


def test_an_accelerator_lowering_fetches_a_pipelined_stage_once(mesh_for):
    """Pipelined (4 layers on 2 stages, phases of 1 layer), a stage's whole stack is fetched
    once before the ticks in the TPU program: the MLP's input matrices move in as [2, 64, 256]
    (the stage's 2 layers), never as a phase's [1, 64, 256]. The CPU lowering moves neither."""
    phases = (*OFFLOADED_LAYERS, "memory.phases=2")
    tpu = _placed(_lowered(mesh_for, *phases, mesh=(1, 2, 1), platform="tpu"), "device")
    assert "tensor<2x64x256xf32>" in tpu and "tensor<1x64x256xf32>" not in tpu
    cpu = _placed(_lowered(mesh_for, *phases, mesh=(1, 2, 1)), "device")
    assert not {"tensor<2x64x256xf32>", "tensor<1x64x256xf32>"} & cpu


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_lowering_streams_a_matrix_at_a_time(mesh_for, platform):
    """`memory.stream=matrix` in the TPU/GPU program: one layer's attention output matrix
    ([32, 64] on tensor 2) and one of its q, k, v matrices ([64, 1, 32]) are moved in alone;
    the CPU lowering moves neither."""
    pieces = {"tensor<32x64xf32>", "tensor<64x1x32xf32>"}
    stream = (*OFFLOADED_LAYERS, "memory.stream=matrix", "memory.mlp_panels=2")
    assert pieces <= _placed(_lowered(mesh_for, *stream, platform=platform), "device")
    assert not pieces & _placed(_lowered(mesh_for, *stream), "device")


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_lowering_offloads_saved_activations(mesh_for, platform):
    """`memory.offload=activations` in the TPU/GPU program: the products remat `minimal`
    saves are placed on the host in the forward pass and back on the device for the backward,
    the MLP's first one, [micro-batch 2, 64 positions, 128 of d_ff 256], among them. The CPU
    lowering places none (`test_no_saved_activation_is_placed_on_the_host`)."""
    offload = ("memory.offload=[activations]", "model.remat=minimal")
    text = _lowered(mesh_for, *offload, platform=platform)
    to_host = _placed(text, "pinned_host")
    assert "tensor<2x64x128xf32>" in to_host
    assert to_host <= _placed(text, "device")
