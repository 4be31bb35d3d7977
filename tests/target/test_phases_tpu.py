"""What XLA:TPU's step holds with the layer stack's state on the host in `memory.phases` K
(libtpu, no TPU attached): a v5p 2x2x2 slice, mesh 4x1x2 (no pipeline), the tiny preset at d
512, 16 positions, one sequence a micro-batch, remat full, params and AdamW's moments on the
host; the values read from the default memory space's buffer assignment and live ranges.

The planner's `updates_in_phases` (`jaxpod.planner.phased`): the update brings in one phase's
stacked matrices and their moments, makes their new values and writes them back before the
next phase, so at the update's peak the program holds phase-sized pieces of the stack, at
least one phase's fetched state and no whole stack of weights or moments; the planner's
update counts one phase's weights, moved-in moments and new params beside the gradients,
and its device total is within 10 % of XLA:TPU's at K=2 and 4. At K=1 XLA:TPU's peak is
the last micro-batch's backward, which holds more than the planner counts (the last test).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest
from helpers import make_tiny_cfg
from helpers.dumps import dims_of, dumped_program, peak_position, tpu_mesh

from jaxpod.planner.backend import backend_plan
from jaxpod.target.buffers import device_memory_bytes
from jaxpod.target.hlo_text import parse
from jaxpod.target.live_ranges import covered

pytestmark = pytest.mark.slow

TARGET, MESH = "tpu-v5p:2x2x2", (4, 1, 2)
# a state-dominated step: d 512, 16 positions, one sequence a micro-batch
WEIGHTY = ("model.d_model=512", "model.heads=4", "model.d_ff=2048", "model.seq_len=16")
WEIGHTY += ("train.micro_batch=1", "memory.offload=[params,optimizer]", "model.remat=full")


@pytest.fixture(scope="module")
def program():
    """`program(K) -> (cfg, Dumped)`, each K compiled once per module."""
    done: dict = {}

    def compile_(phases: int):
        if phases not in done:
            cfg = make_tiny_cfg(*WEIGHTY, f"memory.phases={phases}", mesh=MESH)
            done[phases] = cfg, dumped_program(cfg, tpu_mesh(MESH, TARGET), device_only=True)
        return done[phases]

    return compile_


def stacked_state(engine, state) -> dict[str, tuple[tuple[int, ...], int]]:
    """The stacked matrices (the layers' weight-decayed leaves) and their optimizer moments:
    path -> (one chip's shard dims, bytes)."""
    decayed = jax.tree.leaves(engine.stages.masks.decay["layers"])
    key = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    layers = jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]
    names = {tuple(map(key, p))[-2:] for (p, _), d in zip(layers, decayed, strict=True) if d}
    found = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = tuple(map(key, path))
        if "layers" in keys and keys[-2:] in names:
            dims = tuple(x.sharding.shard_shape(x.shape))
            found["/".join(keys)] = dims, math.prod(dims) * x.dtype.itemsize
    return found


def called(module, names: list[str]) -> set[str]:
    """The computations `names` and every computation they call, transitively."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in found and name in module.computations:
            found.add(name)
            todo += [c for i in module.computations[name].instructions for _, c in i.calls()]
    return found


def update_start(module, schedule: dict) -> int:
    """The first position of the update's first part: its guarded `lax.cond`, the entry's
    first `conditional`, and the computations it calls."""
    where = {i.name: c for c, comp in module.computations.items() for i in comp.instructions}
    entry = module.computations[module.entry].instructions
    first = next(i for i in entry if i.opcode == "conditional")
    inside = called(module, [c for _, c in first.calls()])
    return min(t for t, name in schedule.items() if where.get(name) in inside)


def update_peak(dumped) -> int:
    """The position of the update at which the temporaries cover the most bytes."""
    values, ranges, schedule = dumped.live
    start = update_start(parse(dumped.compiled.as_text()), schedule)
    return max(range(start, max(schedule) + 1), key=lambda t: covered(values, ranges, t))


def held_pieces(cfg, dumped, t: int) -> dict[int, int]:
    """Bytes of the temporaries alive at position `t` shaped as pieces of the stacked state
    (a stacked matrix's shard dims, any number of layers): leading dim -> bytes."""
    values, ranges, _ = dumped.live
    trailing = {dims[1:] for dims, _ in stacked_state(dumped.engine, dumped.state).values()}
    held: dict[int, int] = {}
    for name, (a, b) in ranges.items():
        shape = values[name][2]
        dims = () if shape.startswith("(") else dims_of(shape)  # an array, not a tuple
        if a <= t <= b and len(dims) >= 3 and dims[1:] in trailing:
            held[dims[0]] = held.get(dims[0], 0) + values[name][0]
    return held


def planned_update(cfg) -> float:
    """The planner's update count (profile tpu-v5p) besides the resting state: the weights,
    the moved-in state, the new params and the gradients."""
    from jaxpod.planner.bytes import _state_bytes
    from jaxpod.planner.counts import param_layout
    from jaxpod.planner.plan import plan
    from jaxpod.planner.profiles import get_profile

    profile = get_profile("tpu-v5p")
    on_tpu = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, device="tpu-v5p"))
    b = plan(on_tpu)["bytes_per_device"]
    grads = _state_bytes(cfg, param_layout(cfg), profile)["grads_update"]
    return b["weights"] + b["moved_in"] + b["updates"] + grads


@pytest.mark.parametrize("phases", [1, 2, 4])
def test_the_update_holds_one_phase_of_the_stack(program, phases):
    """At the update's peak the stacked state is held in pieces of one phase's layers, L/K
    (a phase's fetched matrices and moments, new values, gradients; in phases none whole):
    at least one phase's fetched state, S/K, and no more than the planner's update counts
    (one phase's weights, moved-in moments and new params, and the gradients:
    `updates_in_phases`)."""
    cfg, dumped = program(phases)
    values, ranges, _ = dumped.live
    t = update_peak(dumped)
    held = held_pieces(cfg, dumped, t)
    layers = cfg.model.layers
    assert set(held) == {layers // phases}, held  # no whole stack
    state = sum(n for _, n in stacked_state(dumped.engine, dumped.state).values())
    update = planned_update(cfg)
    print(f"K={phases}: held {held}, S/K {state / phases:.0f}, planned update {update:.0f}")
    assert state / phases <= held[layers // phases] <= covered(values, ranges, t) <= update


@pytest.mark.parametrize("phases", [2, 4])
def test_planned_device_total_in_phases_within_a_tenth(program, phases):
    """The planner's device total (profile tpu-v5p) is within 10 % of XLA:TPU's (the HBM
    allocations of its buffer assignment) in phases: its update holds one phase's state."""
    cfg, dumped = program(phases)
    planned = backend_plan(cfg, "tpu-v5p")["device_total"]
    xla = device_memory_bytes(dumped.spaces)
    print(f"K={phases}: planned {planned / 2**20:.1f} MiB, XLA:TPU {xla / 2**20:.1f} MiB")
    assert 0.9 <= planned / xla <= 1.1


def test_without_phases_the_peak_is_the_last_micro_batch_backward(program):
    """K=1: XLA:TPU's peak is not in the update but in the backward of the micro-batch it
    runs outside the loop, where the update's moments have already come in and the stack is
    held twice (the loop's fetch, kept for the update, and that micro-batch's own) beside the
    micro-batch's gradients: the whole stacks there outweigh the planner's device total,
    whose update counts the stack, the moments, the gradients and the new params
    (docs/memory.md, "Offload and phases in XLA:TPU's program")."""
    cfg, dumped = program(1)
    values, ranges, schedule = dumped.live
    peak = peak_position(values, ranges)
    assert peak < update_start(parse(dumped.compiled.as_text()), schedule)
    stacked = stacked_state(dumped.engine, dumped.state)
    weights = sum(n for path, (_, n) in stacked.items() if path.startswith("params/"))
    moments = sum(n for _, n in stacked.values()) - weights
    held = held_pieces(cfg, dumped, peak)
    assert set(held) == {cfg.model.layers}
    planned = backend_plan(cfg, "tpu-v5p")["device_total"]
    print(f"K=1 peak: whole stacks {held}, planned {planned}")
    assert 3 * weights + moments <= held[cfg.model.layers]  # two stacks, gradients, moments
    assert planned < held[cfg.model.layers]
