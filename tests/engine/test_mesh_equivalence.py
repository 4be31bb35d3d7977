"""The engine on every mesh equals the plain single-device model: initial parameters and their
shardings, one optimizer step (loss, gradients, parameters, optimizer state and their shardings,
logged norms), three steps, eval, and one data-parallel gradient reduction per step.

The reference and the engines come from the session's equivalence lab (tests/helpers/lab.py:
each mesh's engine is built once per test process). Run with `-s` to see every measured error.

Which mesh covers what: the initial parameters and their specs are checked on all seven
meshes (`MESHES`: each axis alone and together; no compiled step). A train step is one XLA
compile per (mesh, optimizer), so the steps run on `STEP_MESHES`, which still exercise every
code path the single-axis meshes do: 1x1x1 (nothing sharded), 2x2x2 (every axis > 1 at
once: the replica gradient reduction, the GPipe scan, Megatron's tensor psums), 1x4x2 (four
stages, the pipelined path without replicas) and 2x1x4 (tensor width 4, replicas without a
pipeline: the accumulation loop). 2x1x1 is 2x1x4's replica path with a size-1 tensor axis,
1x1x2 its tensor path without replicas, 1x2x1 1x4x2's pipelined path with fewer stages.
1x4x2's engines start their pipeline carry as NaN (the lab's `NAN_FILLED`): its steps prove
too that no bubble tick reaches the loss, a gradient or a parameter on four stages.
"""

from __future__ import annotations

import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.lab import (
    GRAD_TOL,
    INIT_ATOL,
    INIT_MAX_ULP,
    LAB_PROCESS,
    NORM_RTOL,
    adam_state,
    assert_loss_close,
    assert_params_close,
    assert_sharded_as,
    assert_trees_close,
    batch,
    leaves,
    loss_and_grads_of,
    mesh_id,
    put,
    record,
    sgd_trace,
    update_bound,
)
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

pytestmark = LAB_PROCESS

MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4)]
# The meshes a train step is compiled on (module docstring): AdamW on all four (gradients via
# its first moment, the update, the optimizer state, the norms), SGD on the three sharded ones
# (the momentum trace is the gradient exactly; the update's tight bound). 1x1x1's SGD step is
# 2x1x4's non-pipelined path with size-1 axes.
STEP_MESHES = [(1, 1, 1), (2, 2, 2), (1, 4, 2), (2, 1, 4)]
STEP_CASES = [(shape, "adamw") for shape in STEP_MESHES]
STEP_CASES += [(shape, "sgd") for shape in STEP_MESHES if shape != (1, 1, 1)]

EXPECTED_SPECS = {
    "wte": P("tensor", None),
    "wpe": P(None, None),
    "ln_f": {"scale": P(None), "bias": P(None)},
    "layers": {
        "ln1": {"scale": P("pipeline", None), "bias": P("pipeline", None)},
        "ln2": {"scale": P("pipeline", None), "bias": P("pipeline", None)},
        "attn": {
            "w_qkv": P("pipeline", None, None, "tensor"),
            "b_qkv": P("pipeline", None, "tensor"),
            "w_o": P("pipeline", "tensor", None),
            "b_o": P("pipeline", None),
        },
        "mlp": {
            "w_in": P("pipeline", None, "tensor"),
            "b_in": P("pipeline", "tensor"),
            "w_out": P("pipeline", "tensor", None),
            "b_out": P("pipeline", None),
        },
    },
}

# --------------------------------------------------------------------------------------------
# 1. Mesh equivalence: init, shardings, one optimizer step.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
def test_init_params_match_reference(lab, shape):
    """The engine's initial params on any mesh are the reference model's values (they depend
    only on the seed), bit-identical to the 1-device jitted init, in the engine's specs, which
    are the Megatron/pipeline layout; each device holds only its own shard and no device
    holds a whole tensor-split weight. (The state after a step: `test_one_step_matches_
    reference`; grads straight out of `engine.loss_and_grads`: test_pipeline_equivalence.py.)"""
    cfg, mesh, engine, state = lab.engine(shape, "adamw")
    params, specs = state.params, engine.stages.specs
    assert specs == EXPECTED_SPECS
    _, ref_params, _ = lab.reference()
    g, w = leaves(params), leaves(ref_params)
    assert g.keys() == w.keys()
    worst = max(float(np.max(np.abs(g[k] - w[k]))) for k in w)
    record("init |mesh - eager reference|", worst)
    assert worst <= INIT_ATOL
    for k in w:
        np.testing.assert_array_max_ulp(g[k], w[k], maxulp=INIT_MAX_ULP)
    one_device = leaves(lab.engine((1, 1, 1), "adamw")[3].params)
    for k in w:
        np.testing.assert_array_equal(g[k], one_device[k], err_msg=k)
    assert_sharded_as(params, specs, mesh, "initial params")


@pytest.mark.parametrize(
    ("shape", "optim"), STEP_CASES, ids=[f"{mesh_id(s)}-{o}" for s, o in STEP_CASES]
)
def test_one_step_matches_reference(lab, shape, optim):
    """One `engine.train_step` == one plain step: loss, every gradient leaf, every updated
    parameter leaf, the optimizer state and the logged norms; the updated params, AdamW's
    moments and SGD's trace (= grads) live exactly in the params' specs.

    Gradients are read from the optimizer state the engine's own step produced: SGD's
    momentum trace after the first step is g + 0.9 * 0 = g exactly (asserted on the
    reference), AdamW's first moment is 0.1 * g and its second 0.05 * g**2.
    """
    cfg, mesh, engine, _ = lab.engine(shape, optim)
    new_state, metrics = lab.steps(shape, optim, 1)[0]
    specs = engine.stages.specs
    assert specs == EXPECTED_SPECS
    assert_sharded_as(new_state.params, specs, mesh, "updated params")
    if optim == "sgd":
        assert_sharded_as(sgd_trace(new_state.opt_state), specs, mesh, "grads (sgd trace)")
    else:
        adam = adam_state(new_state.opt_state)
        assert_sharded_as(adam.mu, specs, mesh, "adam mu")
        assert_sharded_as(adam.nu, specs, mesh, "adam nu")
    ref = lab.ref_steps(optim)[0]
    lr = float(lab.ref_optimizer(optim)[1](0))
    assert lr == np.float32(cfg.optim.lr)  # no warm-up: the first step uses the full lr
    where = f"{optim} params"

    assert int(new_state.step) == 1
    assert_loss_close(metrics["loss"], ref["loss"], "one step")
    if optim == "sgd":
        ref_trace = leaves(sgd_trace(ref["opt_state"]))
        for k, v in leaves(ref["grads"]).items():
            np.testing.assert_array_equal(ref_trace[k], v, err_msg=k)
        assert_trees_close(sgd_trace(new_state.opt_state), ref["grads"], GRAD_TOL, "grads")
    else:
        adam, ref_adam = adam_state(new_state.opt_state), adam_state(ref["opt_state"])
        assert_trees_close(adam.mu, ref_adam.mu, GRAD_TOL, "adam mu = 0.1 g")
        assert_trees_close(adam.nu, ref_adam.nu, 2 * GRAD_TOL, "adam nu = 0.05 g^2")
    bound = update_bound(optim, ref["grads"], lr)
    assert_params_close(new_state.params, ref["params"], ref["old_params"], bound, where)
    norms = {"grad_norm": ref["grads"], "update_norm": ref["updates"], "param_norm": ref["params"]}
    for name, tree in norms.items():
        want = float(optax.tree.norm(tree))
        err = abs(float(metrics[name]) - want) / want
        record(f"metric {name} {optim}", err)
        assert err <= NORM_RTOL, (name, float(metrics[name]), want)
    assert float(metrics["lr"]) == lr


# --------------------------------------------------------------------------------------------
# 2. Several steps.
# --------------------------------------------------------------------------------------------


def test_three_adamw_steps_match(lab):
    """Three AdamW steps (fresh batch each) on 2x2x2 and on 1x1x1 log the reference's losses."""
    ref = lab.ref_steps("adamw")
    big, one = lab.steps((2, 2, 2), "adamw", 3), lab.steps((1, 1, 1), "adamw", 3)
    losses = [float(r["loss"]) for r in ref]
    print("reference losses", losses)
    for k in range(3):
        assert int(big[k][0].step) == k + 1
        assert_loss_close(big[k][1]["loss"], one[k][1]["loss"], "3 steps, 2x2x2 vs 1x1x1")
        assert_loss_close(big[k][1]["loss"], ref[k]["loss"], "3 steps, 2x2x2 vs reference")
        assert_loss_close(one[k][1]["loss"], ref[k]["loss"], "3 steps, 1x1x1 vs reference")


# --------------------------------------------------------------------------------------------
# 3. Eval.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 1)], ids=mesh_id)
def test_eval_loss_matches_reference(lab, shape):
    """`engine.eval_step` (forward only) == the plain loss of the same params and batch."""
    cfg, mesh, engine, state = lab.engine(shape, "adamw")
    loss = engine.eval_step(state.params, put(engine, batch(0)))["val_loss"]
    assert_loss_close(loss, lab.ref_steps("adamw")[0]["loss"], "eval")


# --------------------------------------------------------------------------------------------
# 4. The data-parallel gradient reduction happens once per optimizer step.
# --------------------------------------------------------------------------------------------


NO_DATA_MOVED = {"pvary", "pcast"}  # type-level casts to "varying": no communication


def executed_collectives(jaxpr, axis: str) -> Counter:
    """How many times each collective over `axis` *runs* per call: eqns inside a `scan` body
    count `length` times (nested scans multiply); one inside a `while` counts as NaN."""
    counts: Counter = Counter()

    def walk(j, times):
        for eqn in j.eqns:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, tuple | list | set | frozenset) else (axes,)
            if axis in axes and eqn.primitive.name not in NO_DATA_MOVED:
                counts[eqn.primitive.name] += times
            inner = times
            if eqn.primitive.name == "scan":
                inner = times * eqn.params["length"]
            elif eqn.primitive.name == "while":
                inner = math.nan
            for sub in jaxprs_in_params(eqn.params):
                walk(sub, inner)

    walk(jaxpr, 1)
    return counts


def test_gradient_reduction_once_per_step(lab):
    """On 2x1x1, the collectives over `replica` in `engine.loss_and_grads` run once per step:
    one psum per parameter leaf plus one for the loss, for 2 and for 4 micro-batches. The
    counter is not blind to loops: the per-micro-batch tensor-axis psums (Megatron, size-1
    axis here) double from 2 to 4 micro-batches."""
    replica, tensor = {}, {}
    for accum in (2, 4):
        cfg = lab.tiny_cfg(
            "train.micro_batch=2",
            f"train.grad_accum={accum}",
            "train.global_batch=null",
            mesh=(2, 1, 1),
        )
        assert cfg.global_batch == 2 * 2 * accum
        fn, params, _ = loss_and_grads_of(lab, cfg)
        tokens = jax.ShapeDtypeStruct((cfg.global_batch, cfg.model.seq_len + 1), jnp.int32)
        jaxpr = jax.make_jaxpr(fn)(params, tokens).jaxpr
        replica[accum], tensor[accum] = (
            executed_collectives(jaxpr, a) for a in ("replica", "tensor")
        )
    n_leaves = len(jax.tree.leaves(params))
    print(
        f"replica collectives per step: {dict(replica[2])} / {dict(replica[4])}; tensor: "
        f"{sum(tensor[2].values())} / {sum(tensor[4].values())} (grad_accum 2 / 4)"
    )
    assert replica[2] == replica[4]
    assert sum(replica[4].values()) == n_leaves + 1
    assert set(replica[4]) <= {"psum", "psum_invariant"}
    assert sum(tensor[4].values()) == 2 * sum(tensor[2].values()) > 0
