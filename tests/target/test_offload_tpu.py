"""Each host-offload credit found in XLA:TPU's compiled program (libtpu, no TPU attached): the
tiny preset's train step for a TPU v5p 2x2x2 slice, the expected bytes derived from the
abstract state's shard shapes (per chip, elements x dtype size), never written down.

- `memory.phases=K` with the layers on the host: inside the micro-batch loop each phase
  fetches its own `L/K` layers of every stacked weight matrix, once for its forward pass and
  once again for its backward pass (`jaxpod.parallel.phases.scan_phases`); without a
  pipeline the update goes a phase at a time too (`jaxpod.optim.phased`), and the device
  total falls with K;
- gradients stay in device memory: the host-resident state comes in and the new state goes
  back, nothing else crosses (`jaxpod.parallel.offload.value_and_grad`);
- `memory.stream=matrix` with the layers on the host compiles, each step reading one
  layer's matrix of the whole stack (`jaxpod.parallel.weights_ready.read_layer`);
- `memory.offload=[activations]`: what the remat policy saves lives in host memory
  (XLA's host temporaries, the planner's host activations), on a mesh without a pipeline
  and under gpipe and circular (not skipping their bubbles: the xfail).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from typing import NamedTuple

import jax
import pytest
from helpers import make_tiny_cfg

from jaxpod.target.buffers import compile_with_spaces, device_memory_bytes
from jaxpod.target.hlo import async_overlap, transfers
from jaxpod.target.hlo_runs import runs
from jaxpod.target.hlo_text import parse, shape_bytes

pytestmark = pytest.mark.slow

TARGET = "tpu-v5p:2x2x2"
HOST = "pinned_host"
FLAT = (4, 1, 2)  # no pipeline: the micro-batch loop holds the layers' passes
# per-chip dimensions XLA:TPU does not pad (multiples of its (8, 128) tiles): the bytes
# of its host arguments are the arrays' own
UNPADDED = ("model.d_model=256", "model.heads=2", "model.d_ff=1024")


class Program(NamedTuple):
    cfg: object
    state: object  # the abstract TrainState, with its shardings
    text: str  # the optimized HLO
    memory: object  # `memory_analysis()`
    spaces: dict  # bytes per memory space (`jaxpod.target.buffers`)
    matrices: dict  # the stacked weight matrices' bytes per chip, by path


@pytest.fixture(scope="module")
def tpu():
    """`tpu(*overrides, mesh=FLAT) -> Program`, each compiled once per module."""
    from jaxpod.inspect.compile import abstract_inputs
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    devices = target_devices(parse_target(TARGET))
    done: dict = {}

    def compile_(*overrides: str, mesh=FLAT) -> Program:
        if (overrides, mesh) not in done:
            cfg = make_tiny_cfg(*overrides, mesh=mesh)
            shape = (cfg.mesh.replica, cfg.mesh.pipeline, cfg.mesh.tensor)
            engine, state, batch = abstract_inputs(cfg, torus_mesh(shape, devices))
            lowered = engine.train_step.lower(*engine.updating_arguments(state, batch))
            compiled, spaces = compile_with_spaces(lowered, {})
            memory = compiled.memory_analysis()
            matrices = stacked_matrices(state, engine.stages.masks.decay["layers"])
            text = compiled.as_text()
            done[overrides, mesh] = Program(cfg, state, text, memory, spaces, matrices)
        return done[overrides, mesh]

    return compile_


def shard_bytes(x) -> int:
    """Bytes of one chip's shard of an abstract array."""
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def resting(state) -> tuple[int, int]:
    """`(leaves, bytes per chip)` of the host-resident (`pinned_host`) leaves of `state`."""
    leaves = [x for x in jax.tree.leaves(state) if x.sharding.memory_kind == HOST]
    return len(leaves), sum(shard_bytes(x) for x in leaves)


def stacked_matrices(state, decayed: dict) -> dict[str, int]:
    """Bytes per chip of each stacked weight matrix (the layers' leaves with the weight-decay
    role: not the biases and norms, which the engine fetches whole), by path."""
    flat = jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]
    path = lambda p: "/".join(str(k.key) for k in p)  # noqa: E731
    roles = jax.tree.leaves(decayed)
    return {path(p): shard_bytes(x) for (p, x), d in zip(flat, roles, strict=True) if d}


def other_sizes(state) -> set[int]:
    """Bytes per chip of the parameters outside the layer stack (fetched too: a transfer of
    that size is not told apart from a stacked matrix's)."""
    others = {k: v for k, v in state.params.items() if k != "layers"}
    return {shard_bytes(x) for x in jax.tree.leaves(others)}


def fetches(text: str) -> tuple[Counter, Counter]:
    """`(in loops, in the entry)`: the async host->device copies, `{bytes: times run}`."""
    module = parse(text)
    times = runs(module)
    looped, entry = Counter(), Counter()
    for copy in async_overlap(text, "to_device"):
        where = entry if copy["computation"] == module.entry else looped
        where[copy["bytes"]] += times[copy["computation"]]
    return looped, entry


def row(tally: dict) -> tuple[int, int]:
    return tally["executed"], tally["executed_bytes"]


@pytest.mark.parametrize("phases", [2, 4])
def test_each_phase_fetches_its_own_layers_in_the_micro_batch_loop(tpu, phases):
    """Layers on the host in K phases (4 layers, mesh 4x1x2, GA 4): every stacked matrix
    moves in as K pieces of L/K layers, each fetched for its phase's forward pass and again
    for its backward pass in every micro-batch (2 K M fetches; XLA runs one micro-batch
    outside the loop, so the pieces are counted wherever they run), and once more for the
    update, which goes a phase at a time (`jaxpod.optim.phased`): no whole stacked matrix
    ever moves in. Its new value goes back as K pieces; no gradient crosses to the host."""
    program = tpu("memory.offload=[params]", f"memory.phases={phases}", "model.remat=full")
    micro = program.cfg.part_micro
    looped, entry = fetches(program.text)
    every = looped + entry
    matrices = program.matrices
    per_piece = Counter(whole // phases for whole in matrices.values())
    assert all(whole % phases == 0 for whole in matrices.values())
    for piece, leaves in per_piece.items():
        assert looped[piece] > 0, piece  # inside the loop, not hoisted out of it
        assert every[piece] >= (2 * micro + 1) * phases * leaves, (piece, every[piece])
    for whole in set(matrices.values()) - set(per_piece) - other_sizes(program.state):
        assert every[whole] == 0, whole  # no whole stacked matrix, in the loop or the update
    leaves, nbytes = resting(program.state)
    pieces = leaves + (phases - 1) * len(matrices)  # each matrix back in K pieces
    assert row(transfers(program.text)["to_host"]) == (pieces, nbytes)


def phased_state(program: Program) -> tuple[int, int]:
    """`(leaves, bytes per chip)` of the stacked matrices and their optimizer moments: what
    the update in phases brings to the device a phase at a time."""
    names = {("layers", *path.split("/")) for path in program.matrices}
    key = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(program.state)[0]
    leaves = [x for p, x in flat if tuple(map(key, p))[-3:] in names]
    return len(leaves), sum(shard_bytes(x) for x in leaves)


# a state-dominated step: d 512, 16 positions, one sequence a micro-batch
WEIGHTY = ("model.d_model=512", "model.heads=4", "model.d_ff=2048", "model.seq_len=16")
WEIGHTY += ("train.micro_batch=1", "memory.offload=[params,optimizer]", "model.remat=full")


def test_phases_lower_the_device_bytes(tpu):
    """Params and Adam's moments on the host, no pipeline, phases 1, 2, 4: the update brings
    in a phase's matrices and their moments, S/K of the S they hold (`phased_state`), and
    makes their new values, instead of all of S at once. XLA:TPU's device total (its HBM
    allocations) falls with K: by at least the (1 - 1/K) S fetched state no longer held at
    once, by at most twice that (the fetched state and its new value). The update writes
    every stacked matrix and each of its moments back as K pieces. (Inside the micro-batch
    loop XLA:TPU also relays out the stacked W_qkv in host memory, through the device, each
    micro-batch: docs/memory.md.)"""
    programs = {k: tpu(*WEIGHTY, f"memory.phases={k}") for k in (1, 2, 4)}
    total = {k: device_memory_bytes(p.spaces) for k, p in programs.items()}
    pieces, held = phased_state(programs[1])
    print({k: f"{t / 2**20:.1f} MiB" for k, t in total.items()}, f"S {held / 2**20:.1f} MiB")
    assert total[4] < total[2] < total[1]
    for k in (2, 4):
        fall, least = total[1] - total[k], (1 - 1 / k) * held
        assert least <= fall <= 2 * least, (k, fall, least)
        # the update's writes (the entry computation's): each leaf, a matrix in K pieces
        text = programs[k].text
        leaves, nbytes = resting(programs[k].state)
        entry = parse(text).entry
        back = [c["bytes"] for c in async_overlap(text, "to_host") if c["computation"] == entry]
        assert (len(back), sum(back)) == (leaves + (k - 1) * pieces, nbytes)


@pytest.mark.parametrize("optimizer", [False, True], ids=["params", "params-optimizer"])
def test_pipelined_offloaded_state_moves_in_once_and_out_once(tpu, optimizer):
    """Pipelined (the tiny preset's 2x2x2 mesh, dimensions XLA does not pad): each
    host-resident leaf comes to the device once (the stage's stack before the ticks, which
    the update reuses; the optimizer state for the update) and its new value goes back once;
    the gradients are made and stay in device memory. The host arguments are exactly the
    offloaded state, and the device's arguments drop by exactly as much."""
    offload = "memory.offload=[params,optimizer]" if optimizer else "memory.offload=[params]"
    mesh = (2, 2, 2)
    program = tpu(*UNPADDED, offload, "model.remat=full", mesh=mesh)
    kept = tpu(*UNPADDED, "model.remat=full", mesh=mesh)
    leaves, nbytes = resting(program.state)
    assert leaves > 0
    moved = transfers(program.text)
    assert row(moved["to_device"]) == row(moved["to_host"]) == (leaves, nbytes)
    assert program.memory.host_argument_size_in_bytes == nbytes
    on_device = program.memory.argument_size_in_bytes
    assert on_device == kept.memory.argument_size_in_bytes - nbytes


def test_offloaded_state_is_exactly_the_host_memory_of_the_compiled_program():
    """`compile_for_target`'s report (what `jaxpod compile --target --json` prints), params
    and optimizer state offloaded on the tiny preset's mesh: the host arguments are the
    offloaded state, which is also XLA:TPU's host memory space (`cmem`), and the device's
    arguments drop by exactly as much."""
    from jaxpod.inspect.compile import abstract_inputs, compile_for_target
    from jaxpod.target.devices import target_devices, torus_mesh
    from jaxpod.target.spec import parse_target

    target, mesh = parse_target(TARGET), (2, 2, 2)
    plain = compile_for_target(make_tiny_cfg(*UNPADDED, mesh=mesh), target)
    cfg = make_tiny_cfg(*UNPADDED, "memory.offload=[params,optimizer]", mesh=mesh)
    offloaded = compile_for_target(cfg, target)
    _, state, _ = abstract_inputs(cfg, torus_mesh(mesh, target_devices(target)))
    _, host = resting(state)
    assert host > 0 and plain["host_argument_bytes"] == 0
    assert offloaded["host_argument_bytes"] == host == offloaded["memory_spaces"]["cmem"]
    assert plain["device_argument_bytes"] - offloaded["device_argument_bytes"] == host
    assert plain["transfers"]["to_host"]["count"] == 0


def test_only_the_new_state_goes_to_the_host_without_a_pipeline(tpu):
    """Mesh 4x1x2, params and optimizer state on the host: the layers are fetched in every
    micro-batch (forward and backward), but the only host-bound bytes are the new state, each
    leaf once: the transpose of a fetch is no move of the gradient to the host."""
    program = tpu("memory.offload=[params,optimizer]", "model.remat=full")
    leaves, nbytes = resting(program.state)
    moved = transfers(program.text)
    assert row(moved["to_host"]) == (leaves, nbytes)
    assert moved["to_device"]["executed_bytes"] > nbytes  # the layers, once a micro-batch


@pytest.mark.parametrize(
    ("overrides", "mesh"),
    [(("memory.rts=4",), FLAT), (("memory.rts=2",), (2, 2, 2))],
    ids=["rts4-4x1x2", "rts2-2x2x2-pipelined"],
)
def test_matrix_streaming_with_host_layers_compiles(tpu, overrides, mesh):
    """`memory.stream=matrix` in 2 MLP panels with the layers on the host: no computation on
    a host-resident value (no host program), and only the new state goes to the host.
    Without a pipeline each step reads one layer's matrix of the whole stack inside the
    layer loop (its panel taken on the device: XLA:TPU's reads of host memory slice one
    axis); pipelined, the stage's stack comes in once before the ticks."""
    stream = ("memory.offload=[params]", "memory.stream=matrix", "memory.mlp_panels=2")
    program = tpu(*stream, "model.remat=full", *overrides, mesh=mesh)
    assert "HostExecute" not in program.text
    assert 'async_execution_thread="host"' not in program.text
    leaves, nbytes = resting(program.state)
    assert row(transfers(program.text)["to_host"]) == (leaves, nbytes)
    looped, _ = fetches(program.text)
    layers = program.cfg.model.layers // program.cfg.mesh.pipeline
    matrices = program.matrices
    pieces = {whole // layers for whole in matrices.values()}
    for path, whole in matrices.items():
        if program.cfg.mesh.pipeline == 1:
            assert looped[whole // layers] > 0, path
        if whole not in pieces | other_sizes(program.state):
            assert looped[whole] == 0, path


def planned(cfg) -> dict:
    """The plan of `cfg` for the target's device profile."""
    from jaxpod.planner.plan import plan
    from jaxpod.target.spec import parse_target

    profile = parse_target(TARGET).profile
    return plan(dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device=profile)))


def host_arrays(text: str) -> set[str]:
    """The array shapes (layout dropped) that the program places in host memory (`S(5)`)."""
    return set(re.findall(r"(\w+\[[\d,]*\])\{[^}]*S\(5\)\}", text))


# the saved activations outweigh the state: 256 positions, 4 sequences a micro-batch
ACTIVE = (*UNPADDED, "model.seq_len=256", "train.micro_batch=4")


@pytest.mark.parametrize("remat", ["minimal", "attention", "comms"])
def test_offloaded_activations_live_in_host_memory(tpu, remat):
    """`memory.offload=[activations]` without a pipeline: the values the policy saves (each
    layer's, less its input) are XLA:TPU's host temporaries, exactly the planner's host
    activations: arrays stacked over the layers in host memory, each written there in the
    forward pass and read back in the backward pass. The planner's device total falls by
    all but one layer's of them (the layer in its backward holds its own again)."""
    program = tpu(*ACTIVE, "memory.offload=[activations]", f"model.remat={remat}")
    kept = planned(make_tiny_cfg(*ACTIVE, f"model.remat={remat}", mesh=FLAT))["bytes_per_device"]
    offloaded = planned(program.cfg)
    host, layers = offloaded["activations_breakdown"]["host"], program.cfg.model.layers
    assert host > 0 and host % layers == 0
    assert program.memory.host_temp_size_in_bytes == host
    stacked = host_arrays(program.text)
    assert {int(shape.split("[")[1].split(",")[0]) for shape in stacked} == {layers}
    assert sum(shape_bytes(shape) for shape in stacked) == host
    b = offloaded["bytes_per_device"]
    assert (b["peak"], kept["peak"]) == ("backward", "backward")
    assert kept["device_total"] - b["device_total"] == host - host // layers
    assert b["host_total"] - kept["host_total"] == host
    moved = transfers(program.text)
    assert moved["to_host"]["executed_bytes"] == moved["to_device"]["executed_bytes"] > 0
    print(remat, f"XLA:TPU HBM {device_memory_bytes(program.spaces)}", f"planned {b}")


def test_full_remat_saves_nothing_to_offload(tpu):
    """`model.remat=full` saves only each layer's input, which no offload policy names: no
    host temporary, no transfer."""
    program = tpu("memory.offload=[activations]", "model.remat=full")
    assert program.memory.host_temp_size_in_bytes == 0
    assert row(transfers(program.text)["to_host"]) == (0, 0)


def host_buffers(text: str) -> list[str]:
    """The shapes of the buffers the program allocates in host memory (`AllocateBuffer`)."""
    pattern = (
        r"= (\w+\[[\d,]*\])\{[^}]*S\(5\)\} custom-call\(\), custom_call_target=\"AllocateBuffer\""
    )
    return re.findall(pattern, text)


PIPELINED = (2, 2, 2)
CIRCULAR = ("train.pipeline_schedule=circular", "train.virtual_stages=2")


@pytest.mark.parametrize(
    ("remat", "schedule"),
    [("minimal", ()), ("attention", ()), ("comms", ()), ("comms", CIRCULAR)],
    ids=["gpipe-minimal", "gpipe-attention", "gpipe-comms", "circular-comms"],
)
def test_pipelined_offloaded_activations_live_in_host_memory(tpu, remat, schedule):
    """gpipe and circular on the 2x2x2 mesh, the stage's layers looped
    (`StackOptions.layer_loop`): the buffers XLA:TPU allocates in host memory are the
    policy's saved values, one per value and layer of a tick, each stacked over the ticks,
    exactly the planner's host activations; XLA:TPU's device total falls. Remat comms: the
    host temporaries and each way's transfers are those bytes too. Minimal and attention
    save q, k, v as one `[mb, T, 3, HD]` value whose stack XLA:TPU also relays out in host
    memory, through the device, after the ticks (one more copy of it in host memory)."""
    overrides = (*ACTIVE, *schedule, f"model.remat={remat}")
    program = tpu(*overrides, "memory.offload=[activations]", mesh=PIPELINED)
    kept = tpu(*overrides, mesh=PIPELINED)
    acts = planned(program.cfg)["activations_breakdown"]
    host = acts["host"]
    assert host > 0 and host % acts["ticks"] == 0
    buffers = host_buffers(program.text)
    assert {int(shape.split("[")[1].split(",")[0]) for shape in buffers} == {acts["ticks"]}
    assert sum(shape_bytes(shape) for shape in buffers) == host
    assert program.memory.host_temp_size_in_bytes >= host
    assert device_memory_bytes(program.spaces) < device_memory_bytes(kept.spaces)
    if remat == "comms":
        moved = transfers(program.text)
        assert program.memory.host_temp_size_in_bytes == host
        assert moved["to_host"]["executed_bytes"] == moved["to_device"]["executed_bytes"] == host
    print(remat, schedule, f"host {program.memory.host_temp_size_in_bytes} planned {host}")


@pytest.mark.xfail(strict=True, reason="XLA:TPU (libtpu 0.0.42) rejects its own program")
def test_pipelined_offloaded_activations_with_skipped_bubbles(tpu):
    """gpipe skipping its bubbles: a bubble tick's stage runs under `lax.cond`, whose saved
    values come out in host memory; the tick scan stacks them, and XLA:TPU's host offloading
    places the stacked buffer in host memory but not the operand of the async copy that
    fills it (`INTERNAL: ... async-start expects the shape of operand 0 to match the async
    shape at index {0} (... vs ...S(5))`). `jaxpod compile --target` refuses the config
    (`jaxpod.target.spec.check_compiles`)."""
    tpu("memory.offload=[activations]", "train.skip_bubbles=true", mesh=PIPELINED)
