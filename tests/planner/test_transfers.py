"""Every byte the planner credits is a transfer or a buffer the lowered step has.

The planner's memory credits are checked against the program jax lowers, not against the
memory kinds the engine asked for: a transfer is an `annotate_device_placement` custom call
inside the step (the entry's results carry placements too: where the new state is returned,
not a transfer), the host-resident state is the entry's arguments with
`memory_kind = "pinned_host"`, and the blocks gathered are the `all_gather` results.

Two lowerings of the same step (docs/memory.md, "Which program the planner counts"). The CPU
lowering, the program XLA:CPU compiles here, has no transfer inside the step: it reads the
host-resident state in place (one RAM), fetches no piece of it, and places no saved
activation on the host. The TPU/GPU lowering (`lowering_platforms`, no such device needed)
moves the optimizer state in whole for the update and back, fetches the layers phase by phase
or matrix by matrix, and offloads the saved activations. The planner counts the layers on
the device (what the CPU program's lack of pieces implies; on the TPU profiles, in phases
without a pipeline, one phase at a time, as the TPU program fetches them), the saved
activations on the device for the CPU profile (for the TPU profiles on the host:
tests/planner/test_activation_offload.py) and, for profiles that do not share host memory,
the optimizer state moved in whole (what the TPU/GPU program does). Also here: the token
table and the MLP gathered a block at a time.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helpers import PLANNER_GPT, SMALL_GPT, make_tiny_cfg

from jaxpod.parallel.offload import placements
from jaxpod.planner.plan import plan

ARGUMENT = re.compile(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}")
# jax lowers a placement inside jit (`jax.device_put` to a memory kind, a remat policy's
# offload) for TPU and GPU only; the CPU lowering, which XLA:CPU compiles, drops them. Lowering
# for another platform needs no such device: these programs are read, never compiled.
ACCELERATORS = ("tpu", "cuda")
OFFLOADED_LAYERS = ("memory.offload=[params]", "model.remat=full")

# one process with test_xla_copies.py, which compiles a program of this module's
pytestmark = pytest.mark.xdist_group(PLANNER_GPT)


# Each config's step is traced once and lowered once per platform in this module (several
# tests read the same config's CPU, TPU and GPU programs): keyed by the resolved config.
_TRACED: dict = {}
_LOWERED: dict = {}


def _lowered(mesh_for, *overrides, mesh=(1, 1, 2), platform: str | None = None) -> str:
    """The tiny step's StableHLO as jax lowers it for this backend, or for `platform`."""
    from jaxpod.inspect.compile import abstract_inputs

    cfg = make_tiny_cfg(*overrides, mesh=mesh)
    if (cfg, platform) not in _LOWERED:
        if cfg not in _TRACED:
            engine, state, batch = abstract_inputs(cfg, mesh_for(cfg))
            _TRACED[cfg] = engine.train_step.trace(state, batch)
        platforms = None if platform is None else (platform,)
        _LOWERED[cfg, platform] = _TRACED[cfg].lower(lowering_platforms=platforms).as_text()
    return _LOWERED[cfg, platform]


def _placements(text: str, results: bool = False) -> Counter:
    """(memory kind, type) of each placement inside the step, the transfers; or, with
    `results`, of those on the values the entry returns (`jaxpod.parallel.offload`)."""
    return placements(text)[results]


def _placed(text: str, kind: str, results: bool = False) -> set[str]:
    """The types placed in memory `kind` (`device` or `pinned_host`) inside the step, or,
    with `results`, on the values it returns."""
    return {t for k, t in _placements(text, results) if k == kind}


def _arguments(text: str) -> list[tuple[str, bool]]:
    """(type, on host) of each argument of the entry function."""
    entry = next(line for line in text.splitlines() if "func.func public @main" in line)
    return [(t, 'memory_kind = "pinned_host"' in attrs) for t, attrs in ARGUMENT.findall(entry)]


def _gathers(text: str) -> list[str]:
    return re.findall(r"stablehlo.all_gather.*-> (tensor<[^>]*>)", text)


@pytest.mark.parametrize(
    ("extra", "mesh"),
    [
        (["memory.offload=[params]", "memory.phases=2"], (1, 1, 2)),
        (["memory.offload=[params]", "memory.stream=matrix", "memory.mlp_panels=2"], (1, 1, 2)),
        (["memory.offload=[params]", "memory.phases=2"], (1, 2, 1)),
        (["memory.offload=[optimizer]"], (1, 1, 2)),
    ],
    ids=["phases", "matrix", "pipelined", "optimizer"],
)
def test_the_cpu_lowering_transfers_nothing_inside_the_step(mesh_for, extra, mesh):
    """On CPU the host-resident state is read in place: the step has no placement inside it,
    so no phase-, panel- or layer-sized piece is ever fetched, and its only placements are
    its results', the new host-resident state returned to the host. So the planner counts
    the stage's stack on the device for the whole step on an accelerator profile, whatever the
    phases or the stream; on `cpu` (one RAM) only in phases, where XLA:CPU holds the stack in
    its temporaries (tests/planner/test_plan_vs_xla.py, the offloaded weights)."""
    text = _lowered(mesh_for, *extra, "model.remat=full", mesh=mesh)
    host = {t for t, on_host in _arguments(text) if on_host}
    assert host, "some state should be host-resident"
    assert not _placements(text)
    assert host <= _placed(text, "pinned_host", results=True)
    if "memory.offload=[params]" in extra:
        for device in ("cpu", "ipu-gc200"):
            more = (*extra, "model.remat=full", f"memory.device={device}")
            planned = plan(make_tiny_cfg(*more, mesh=mesh))["bytes_per_device"]
            kept = plan(make_tiny_cfg(*more[1:], mesh=mesh))["bytes_per_device"]
            assert planned["grads"] == kept["grads"]
            assert planned["arguments"] < kept["arguments"]  # at rest, the stack is on the host
            on_device = device != "cpu" or "memory.phases=2" in extra
            assert (planned["weights"] == kept["weights"]) == on_device


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_moves_the_host_optimizer_state_in_whole(mesh_for, platform):
    """The TPU/GPU program moves every host-resident optimizer leaf to the device in one
    piece inside the step and back to the host: the planner counts it whole at the update's
    peak (`moved_in`) on the profiles that do not share host memory."""
    text = _lowered(mesh_for, "memory.offload=[optimizer]", "model.remat=full", platform=platform)
    host = {t for t, on_host in _arguments(text) if on_host}
    assert host and host <= _placed(text, "device")  # moved in whole
    assert host <= _placed(text, "pinned_host")  # and written back
    pod = ("memory.device=ipu-gc200", "model.remat=full")
    b = plan(make_tiny_cfg("memory.offload=[optimizer]", *pod, mesh=(1, 1, 2)))
    kept = plan(make_tiny_cfg(*pod, mesh=(1, 1, 2)))["bytes_per_device"]
    b = b["bytes_per_device"]
    assert b["optimizer"] == 0 and b["moved_in"] == kept["optimizer"] > 0


def test_xla_cpu_reads_host_optimizer_state_in_place(mesh_for):
    """The `cpu` profile's `shares_host_memory`: on XLA:CPU, where both memory kinds are one
    RAM, offloading the optimizer state leaves the step's temporaries as they were (the update
    reads it in place), so the planner moves nothing in on that backend. (2x1x1, d 128, seq
    128, remat full, GA 4: without the offload, tests/planner/test_xla_copies.py's
    `replicas-2x1x1` program, which the session's compilation cache shares.)"""
    from jaxpod.inspect.compile import compile_step

    results = []
    for offload in ("[]", "[optimizer]"):
        cfg = make_tiny_cfg(
            *SMALL_GPT,
            f"memory.offload={offload}",
            "model.remat=full",
            "train.grad_accum=4",
            mesh=(2, 1, 1),
        )
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


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_lowering_fetches_a_phase_at_a_time(mesh_for, platform):
    """The phases' fetches are in the TPU/GPU program: with 4 layers in 2 phases on tensor 2,
    the MLP's input matrices move in [2, 64, 128] pieces, a phase of the device's
    [4, 64, 128]. The CPU lowering has no such piece
    (`test_the_cpu_lowering_transfers_nothing_inside_the_step`)."""
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


def test_the_tpu_profiles_count_a_phase_where_the_tpu_lowering_fetches_one():
    """The TPU profiles count one phase of the host-resident stack (`updates_in_phases`)
    where the TPU lowering fetches a phase at a time, without a pipeline, and the stage's
    whole stack where it fetches that, pipelined (the two tests above); the GPU profiles,
    whose compiled program no test reads, count the whole stack."""

    def weights(device: str, mesh: tuple, phases: int) -> int:
        more = (*OFFLOADED_LAYERS, f"memory.phases={phases}", f"memory.device={device}")
        return plan(make_tiny_cfg(*more, mesh=mesh))["bytes_per_device"]["weights"]

    assert weights("tpu-v5e", (1, 1, 2), 2) < weights("tpu-v5e", (1, 1, 2), 1)
    assert weights("tpu-v5e", (1, 2, 1), 2) == weights("tpu-v5e", (1, 2, 1), 1)
    assert weights("h100-80gb", (1, 1, 2), 2) == weights("h100-80gb", (1, 1, 2), 1)


@pytest.mark.parametrize("platform", ACCELERATORS)
def test_an_accelerator_lowering_streams_a_matrix_at_a_time(mesh_for, platform):
    """`memory.stream=matrix` in the TPU/GPU program: one layer's attention output matrix
    ([32, 64] on tensor 2) and its q, k, v matrix ([64, 3, 32]) are moved in alone, each a
    slice of the stack's layer axis (a q, k or v panel is cut on the device), never the
    stage's whole stack of one ([4, 64, 3, 32]); the CPU lowering moves none of them."""
    pieces = {"tensor<32x64xf32>", "tensor<64x3x32xf32>"}
    stream = (*OFFLOADED_LAYERS, "memory.stream=matrix", "memory.mlp_panels=2")
    moved = _placed(_lowered(mesh_for, *stream, platform=platform), "device")
    assert pieces <= moved and "tensor<4x64x3x32xf32>" not in moved
    assert not (pieces | {"tensor<4x64x3x32xf32>"}) & _placed(_lowered(mesh_for, *stream), "device")


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
