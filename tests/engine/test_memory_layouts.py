"""Memory mappings change where bytes live, never the numbers: replicated tensor sharding
(`memory.rts`, `memory.rts_optimizer`), host offload (`memory.offload`) and phases
(`memory.phases`) each train exactly like the plain engine, and the per-device bytes of the
live arrays (measured from `addressable_shards`, by memory kind) change by the expected
factors.

Every config is the tiny GPT with global batch 16 and SGD with momentum (the plain engines are the
equivalence lab's, tests/helpers/lab.py, so the session's compilation cache serves them; the
512-token one, `VOCAB`, is this module's). Each engine is built and trained once per process
(`run`): the RTS case with vocabulary slices and the vocabulary-slices test read one run, and
the compiled step the tests read is the one the run compiled.
"""

from __future__ import annotations

from collections import Counter

import jax
import numpy as np
import pytest
from helpers.lab import LAB_PROCESS

from jaxpod.engine import build_engine
from jaxpod.parallel import offload
from jaxpod.parallel.replica import NO_GATHER
from jaxpod.run.mapping import bytes_per_device, most_on_one_device

pytestmark = LAB_PROCESS

BASE = ("train.global_batch=16", "train.grad_accum=null", "train.micro_batch=2")
BASE += ("optim.grad_clip=0", "optim.warmup_steps=0", "optim.name=sgd")
STEPS = 2
# Same math, different summation order (gathered weights, reduce-scattered gradients, host
# round trips): measured loss differences <= 1 ulp (relative 1e-7), parameters after two SGD
# steps max |diff| 3.7e-9 (0 for offload). Bounds: 1e-6 relative (the GPT mesh bound) and
# 1e-7 absolute; the SGD updates being compared are lr * |g| ~ 1e-6 .. 1e-3.
LOSS_RTOL = 1e-6
PARAM_ATOL = 1e-7


def batch(step: int) -> np.ndarray:
    return np.random.default_rng([2024, step]).integers(0, 256, (16, 65), np.int32)


def abstract_batch(engine) -> tuple:
    """The engine's batch `(tokens,)` as a `ShapeDtypeStruct` with its sharding."""
    return (jax.ShapeDtypeStruct((16, 65), np.int32, sharding=engine.batch_sharding[0]),)


def held(tree) -> dict[int, int]:
    """Bytes each device holds of `tree`, every memory kind together."""
    return {d: sum(kinds.values()) for d, kinds in bytes_per_device(tree).items()}


_RUNS: dict = {}
VOCAB = ("model.vocab=512", "model.sequence_chunks=2")  # a table no layer matrix is shaped like


def momentum(state):
    """The SGD momentum trace (the optimizer's per-parameter state) of the engine's state."""
    is_trace = lambda x: type(x).__name__ == "TraceState"
    found = [x.trace for x in jax.tree.leaves(state.opt_state.tx, is_leaf=is_trace) if is_trace(x)]
    assert len(found) == 1
    return found[0]


def run(tiny_cfg, mesh_for, shape, *extra):
    """(engine, [metrics], final state) of STEPS train steps (memoised)."""
    key = (shape, extra)
    if key not in _RUNS:
        cfg = tiny_cfg(*BASE, *extra, mesh=shape)
        engine, state = build_engine(cfg, mesh_for(cfg))
        out = []
        for k in range(STEPS):
            state, m = engine.train_step(state, jax.device_put((batch(k),), engine.batch_sharding))
            out.append(jax.device_get(m))
        _RUNS[key] = (engine, out, state)
    return _RUNS[key]


def assert_same_training(a, b, what: str) -> None:
    (_, ma, sa), (_, mb, sb) = a, b
    for k in range(STEPS):
        la, lb = float(ma[k]["loss"]), float(mb[k]["loss"])
        assert abs(la - lb) <= LOSS_RTOL * abs(lb), (what, k, la, lb)
    pa, pb = jax.tree.leaves_with_path(sa.params), jax.tree.leaves_with_path(sb.params)
    worst = 0.0
    for (path, x), (_, y) in zip(pa, pb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, path
        worst = max(worst, float(np.max(np.abs(x - y))))
    print(f"{what}: losses {[float(m['loss']) for m in ma]}, max |param diff| {worst:.1e}")
    assert worst <= PARAM_ATOL, (what, worst)


VOCAB_SLICES = ("memory.rts=2", "memory.vocab_slices=4")
RTS_CASES = {  # name: (mesh, both engines' overrides, RTS overrides, weight/optimizer factor)
    # a layer gathered at a time, and the token table a slice of rows at a time: the run
    # test_vocab_slices_gather_the_table_a_slice_at_a_time reads (the whole table is gathered
    # in the matrix case)
    "rts2-vocab-slices4-2x2x2": ((2, 2, 2), VOCAB, VOCAB_SLICES, 2, 2),
    "rts1-opt2-2x1x4": ((2, 1, 4), (), ("memory.rts=1", "memory.rts_optimizer=2"), 1, 2),
    # one matrix (the MLP's in 2 panels) gathered at a time, each step a remat unit nested in
    # the layer's
    "rts2-matrix-2x2x2": (
        (2, 2, 2),
        (),
        ("memory.rts=2", "memory.stream=matrix", "memory.mlp_panels=2", "model.remat=full"),
        2,
        2,
    ),
}


@pytest.mark.parametrize("name", list(RTS_CASES))
def test_replicated_tensor_sharding(tiny_cfg, mesh_for, name):
    """RTS trains exactly like the plain engine on the same mesh (gathering a layer or, with
    `memory.stream=matrix`, one matrix at a time), and every device's bytes of params and of
    the optimizer's per-parameter state drop by exactly the RTS factors (every leaf of this
    model has a dimension the group divides). With one RTS group for both, the optimizer
    state is split like the weights (the update reshards nothing)."""
    shape, both, extra, k_w, k_o = RTS_CASES[name]
    plain = run(tiny_cfg, mesh_for, shape, *both)
    rts = run(tiny_cfg, mesh_for, shape, *both, *extra)
    assert_same_training(rts, plain, name)
    engine, state = rts[0], rts[2]
    layout = engine.stages.placement
    assert (layout.opt_specs == layout.stored_specs) == (k_w == k_o)
    if k_w > 1:
        assert NO_GATHER not in jax.tree.leaves(engine.stages.placement.rts_dims)
    p_plain, p_rts = held(plain[2].params), held(state.params)
    assert p_plain.keys() == p_rts.keys() and len(p_rts) == 8
    for d in p_plain:
        assert p_rts[d] * k_w == p_plain[d], (d, p_rts[d], p_plain[d])
    o_plain, o_rts = held(momentum(plain[2])), held(momentum(state))
    for d in o_plain:
        assert o_rts[d] * k_o == o_plain[d], (d, o_rts[d], o_plain[d])
    print(f"{name}: device 0 params {p_plain[0]:,} -> {p_rts[0]:,} B, ", end="")
    print(f"momentum {o_plain[0]:,} -> {o_rts[0]:,} B")


OFFLOAD_CASES = {  # name: (mesh, overrides)
    "all-phases2-2x2x2": (
        (2, 2, 2),
        ("memory.offload=[optimizer,params,activations]", "memory.phases=2"),
    ),
    "params-phases2-2x1x4": ((2, 1, 4), ("memory.offload=[params]", "memory.phases=2")),
    # no pipeline: the update too goes a phase at a time (`jaxpod.optim.phased`)
    "optimizer-params-phases4-2x1x4": (
        (2, 1, 4),
        ("memory.offload=[optimizer,params]", "memory.phases=4"),
    ),
}


@pytest.mark.parametrize("name", list(OFFLOAD_CASES))
def test_offload_and_phases(tiny_cfg, mesh_for, name):
    """Host-resident state (pinned_host) and phased execution train exactly like the plain
    engine; the state stays in the memory kinds it was given, and exactly the offloaded
    bytes move from device to host memory."""
    shape, extra = OFFLOAD_CASES[name]
    plain, off = run(tiny_cfg, mesh_for, shape), run(tiny_cfg, mesh_for, shape, *extra)
    assert_same_training(off, plain, name)
    state, state_plain = off[2], plain[2]
    opt_off = "optimizer" in extra[0]
    for a in jax.tree.leaves(state.params):
        assert a.sharding.memory_kind == offload.HOST
    moments = jax.tree.leaves(momentum(state))
    assert {a.sharding.memory_kind for a in moments} == {offload.HOST if opt_off else "device"}
    on = lambda tree, kind: most_on_one_device(tree, kind)  # noqa: E731
    host_bytes = sum(a.nbytes for a in jax.tree.leaves(state.params)) // (
        shape[1] * shape[2]
    )  # params per device (replicated over replicas); every device holds the same amount
    assert on(state_plain, offload.HOST) == 0
    moved = on(state_plain, offload.DEVICE) - on(state, offload.DEVICE)
    assert on(state, offload.HOST) == moved
    assert moved >= host_bytes * 0.9  # non-divisible leaves are replicated: slightly more
    print(f"{name}: {on(state, offload.DEVICE):,} B on device, {moved:,} B on host")


STEP_FETCH = ("memory.offload=[params]", "memory.stream=matrix", "memory.mlp_panels=2")
STEP_FETCH += ("model.remat=full", "memory.rts=2")


def eqn_shapes(jaxpr, pick, out: Counter) -> Counter:
    """The shapes `pick(eqn)` returns for each equation of `jaxpr` and its sub-jaxprs (inside
    `shard_map` the shapes are a device's), counted."""
    for eqn in jaxpr.eqns:
        out.update(pick(eqn))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    eqn_shapes(inner, pick, out)
    return out


def host_to_device_shapes(jaxpr, out: Counter) -> Counter:
    """Per-device shapes of the host -> device `device_put`s in `jaxpr`, counted."""

    def pick(eqn):
        if eqn.primitive.name != "device_put":
            return []
        pairs = zip(eqn.invars, eqn.params["devices"], strict=True)
        return [
            tuple(var.aval.shape)
            for var, dst in pairs
            if "Host" in str(getattr(var.aval, "memory_space", "")) and "Device" in str(dst)
        ]

    return eqn_shapes(jaxpr, pick, out)


def gathered_shapes(jaxpr) -> Counter:
    """Per-device output shapes of the `all_gather`s in `jaxpr`, counted."""
    pick = lambda eqn: [
        tuple(v.aval.shape) for v in eqn.outvars if eqn.primitive.name == "all_gather"
    ]
    return eqn_shapes(jaxpr, pick, Counter())


def test_matrix_stream_fetches_each_step_its_layers_matrix(tiny_cfg, mesh_for):
    """With host-resident layers and `memory.stream=matrix`, each step fetches the one matrix
    it reads of one layer (`W_qkv`, `W_o`, `W_in`, `W_out`), read as a slice of the stack's
    layer axis alone (XLA:TPU reads host memory along one axis), and its panel is cut on the
    device before the gather: never the whole stack of a matrix; the biases and norms are
    fetched whole. It trains exactly like the plain engine (RTS 2 on the other dimension)."""
    shape = (2, 1, 4)
    plain, off = run(tiny_cfg, mesh_for, shape), run(tiny_cfg, mesh_for, shape, *STEP_FETCH)
    assert_same_training(off, plain, "step fetch")
    engine, state = off[0], off[2]
    assert {a.sharding.memory_kind for a in jax.tree.leaves(state.params)} == {offload.HOST}
    local = lambda a: a.sharding.shard_shape(a.shape)
    stacks = {k: jax.tree.map(local, v) for k, v in state.params["layers"].items()}
    dims = engine.stages.placement.rts_dims["layers"]
    assert dims["mlp"]["w_in"] == 1 and dims["mlp"]["w_out"] == 2  # D, not the hidden units
    others = {k: v for k, v in state.params.items() if k != "layers"}
    rest = Counter(local(a) for a in jax.tree.leaves(others))
    jaxpr = jax.make_jaxpr(engine.eval_step)(state.params, abstract_batch(engine)).jaxpr
    fetched, gathered = host_to_device_shapes(jaxpr, Counter()), gathered_shapes(jaxpr)
    print(f"fetched (per-device shapes: count): {dict(fetched)}")
    print(f"gathered (per-device shapes: count): {dict(gathered)}")
    for path, count, axis in (("attn/w_qkv", 3, 1), ("mlp/w_in", 2, 1), ("mlp/w_out", 2, 0)):
        group, name = path.split("/")
        stack = stacks[group][name]
        layer = stack[1:]
        assert fetched[layer] > 0, (path, layer)  # one layer's matrix, in its step
        assert fetched[stack] == rest[stack], (path, stack)  # only non-layer arrays that shape
        rts = dims[group][name]  # the panel's gathered shape: panel axis cut, RTS dim doubled
        panel = [*layer[:axis], layer[axis] // count, *layer[axis + 1 :]]
        panel[rts - 1] *= 2
        assert gathered[tuple(panel)] > 0, (path, panel)
    assert fetched[stacks["attn"]["w_o"][1:]] > 0


def test_host_weights_stay_on_the_host_across_steps(tiny_cfg, mesh_for):
    """After training steps every weight is still in `pinned_host` memory: the step takes the
    host-resident weights as arguments in that memory kind and returns the new ones to it.
    (Where they are fetched inside the step depends on the lowering: the CPU program reads
    them in place, the TPU/GPU program fetches them phase by phase;
    tests/planner/test_transfers.py.)"""
    shape, extra = OFFLOAD_CASES["params-phases2-2x1x4"]
    engine, _, state = run(tiny_cfg, mesh_for, shape, *extra)
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(state.params)}
    assert kinds == {"pinned_host"}
    lowered = engine.train_step.lower(state, abstract_batch(engine)).as_text()
    entry = lowered[lowered.index("func.func public @main") :].splitlines()[0]
    for a in jax.tree.leaves(state.params):
        arg = f'tensor<{"x".join(map(str, a.shape))}xf32> {{mhlo.memory_kind = "pinned_host"'
        assert arg in entry, arg


def test_vocab_slices_gather_the_table_a_slice_at_a_time(tiny_cfg, mesh_for):
    """With `memory.vocab_slices=4` and RTS 2, the embedding and the loss head use GPT's token
    table a quarter of each tensor shard's rows at a time: the RTS dimension is D, not the
    rows; the train step (forward and backward) all-gathers slices of rows, never the
    table; and it trains exactly like the plain engine (the run and the comparison of
    test_replicated_tensor_sharding[rts2-vocab-slices4-2x2x2], which this reads again)."""
    shape = (2, 2, 2)
    plain = run(tiny_cfg, mesh_for, shape, *VOCAB)
    sliced = run(tiny_cfg, mesh_for, shape, *VOCAB, *VOCAB_SLICES)
    assert_same_training(sliced, plain, "vocab slices")
    engine, state = sliced[0], sliced[2]
    assert engine.stages.placement.rts_dims["wte"] == 1
    # the optimizer state split like the table (D, not the rows): the compiled step has no
    # all-to-all (with the rows split, the update resharded the table's gradient). The
    # program read is the one the run compiled and ran (jit's cache: no compile here).
    assert engine.stages.placement.opt_specs == engine.stages.placement.stored_specs
    traced = engine.train_step.trace(state, abstract_batch(engine))
    hlo = traced.lower().compile().as_text()
    assert "all-to-all(" not in hlo
    gathered = gathered_shapes(traced.jaxpr.jaxpr)
    print(f"all-gathered (per-device shapes: count): {dict(gathered)}")
    rows = 512 // shape[2]
    # the position table [64, 64] once; the embedding's slice and the head's, each gathered
    # in the forward pass and again in the backward pass (each slice is a remat unit)
    assert gathered[(rows // 4, 64)] == 1 + 4
    assert gathered[(rows, 64)] == 0
