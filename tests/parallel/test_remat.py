"""Recomputation policies (`jaxpod.parallel.remat`): every policy gives the same loss and
gradients, really wraps the layers in a checkpoint, and `full` uses less temporary memory.

The reference comes from the session's equivalence lab (tests/helpers/lab.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lab import (
    GLOBAL_BATCH,
    GRAD_TOL,
    assert_trees_close,
    loss_and_grads_of,
    sharded_loss_and_grads,
)
from jax.extend.core import jaxprs_in_params

from jaxpod.config import CHOICES
from jaxpod.parallel.remat import REMAT_POLICIES

# Remat policies recompute the same ops, but XLA fuses the recomputation differently (a few
# ulp per op). Measured max leaf-relative difference 4.8e-7 (full vs none, wpe).
REMAT_TOL = 2e-6


def test_remat_policy_names_match_config_choices():
    assert set(REMAT_POLICIES) == set(CHOICES["model.remat"])


@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
def test_remat_policy_gradients(lab, policy):
    """Every recomputation policy gives the `none` policy's loss and grads on 1x2x2 (and the
    reference's), and every policy but `none` really wraps the layers in a checkpoint."""

    def run(policy):
        cfg = lab.cfg((1, 2, 2), "adamw", f"model.remat={policy}")
        return lab.memo(("remat", policy), lambda: sharded_loss_and_grads(lab, cfg)[:2])

    loss, grads = run(policy)
    none_loss, none_grads = run("none")
    assert_trees_close(grads, none_grads, REMAT_TOL, f"remat grads {policy} vs none")
    assert abs(float(loss) - float(none_loss)) <= REMAT_TOL * abs(float(none_loss))
    ref = lab.ref_steps("adamw")[0]
    assert_trees_close(grads, ref["grads"], GRAD_TOL, f"remat grads {policy} vs reference")

    cfg = lab.cfg((1, 2, 2), "adamw", f"model.remat={policy}")
    fn, params, _ = loss_and_grads_of(lab, cfg)
    tokens = jax.ShapeDtypeStruct((GLOBAL_BATCH, cfg.model.seq_len + 1), jnp.int32)
    used = remat_policies_used(jax.make_jaxpr(fn)(params, tokens).jaxpr)
    assert used == ({REMAT_POLICIES[policy]} if policy != "none" else set()), used


def remat_policies_used(jaxpr) -> set:
    """The `policy` of every jax.checkpoint (remat) region in `jaxpr`, nested ones included."""
    found = set()
    for eqn in jaxpr.eqns:
        if "policy" in eqn.params and "prevent_cse" in eqn.params:
            found.add(eqn.params["policy"])
        for sub in jaxprs_in_params(eqn.params):
            found |= remat_policies_used(sub)
    return found


def test_full_remat_uses_less_temp_memory(lab):
    """`full` saves only each layer's input, so XLA's temp buffers for loss_and_grads shrink
    when activations dominate (1 device, seq 128, micro_batch 8, one micro-batch)."""
    temp = {}
    for policy in ("none", "full"):
        cfg = lab.tiny_cfg(
            "model.seq_len=128",
            "train.micro_batch=8",
            "train.grad_accum=1",
            "train.global_batch=null",
            f"model.remat={policy}",
            mesh=(1, 1, 1),
        )
        fn, params, _ = loss_and_grads_of(lab, cfg)
        tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
        memory = jax.jit(fn).lower(params, tokens).compile().memory_analysis()
        temp[policy] = memory.temp_size_in_bytes
    print(f"temp_size_in_bytes: none={temp['none']:,} full={temp['full']:,}")
    assert temp["full"] < temp["none"]
