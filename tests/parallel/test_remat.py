"""Recomputation policies (`jaxpod.parallel.remat`): every policy gives the same loss and
gradients, really wraps the layers in a checkpoint, and `full` uses less temporary memory.

The reference comes from the session's equivalence lab (tests/helpers/lab.py): the plain
model's gradients on its first batch, at its initial params, which the engine runs at too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers.lab import (
    GRAD_TOL,
    LAB_PROCESS,
    assert_trees_close,
    at_reference_params,
    batch,
    loss_and_grads_of,
    put,
)
from jax.extend.core import jaxprs_in_params

from jaxpod.config import CHOICES
from jaxpod.inspect.compile import compile_to_inspect
from jaxpod.parallel.remat import REMAT_POLICIES

pytestmark = LAB_PROCESS

# Remat policies recompute the same ops, but XLA fuses the recomputation differently (a few
# ulp per op). Measured max leaf-relative difference 4.8e-7 (full vs none, wpe).
REMAT_TOL = 2e-6


def test_remat_policy_names_match_config_choices():
    assert set(REMAT_POLICIES) == set(CHOICES["model.remat"])


def remat_run(lab, policy):
    """(loss, grads, the remat policies in its jaxpr) of `engine.loss_and_grads` on 1x2x2
    with `model.remat=policy`, at the reference's initial params (put in the engine's
    shardings: no init program) on its first batch: the jaxpr read is the one traced for
    the program that ran (one trace)."""

    def run():
        cfg = lab.cfg((1, 2, 2), "adamw", f"model.remat={policy}")
        engine, params = at_reference_params(lab, cfg)
        args = (params, put(engine, batch(0)))
        traced = jax.jit(engine.loss_and_grads).trace(*args)
        loss, _, grads = traced.lower().compile()(*args)
        return loss, grads, remat_policies_used(traced.jaxpr.jaxpr)

    return lab.memo(("remat", policy), run)


@pytest.mark.parametrize("policy", list(REMAT_POLICIES))
def test_remat_policy_gradients(lab, policy):
    """Every recomputation policy gives the `none` policy's loss and grads on 1x2x2 (and the
    reference's), and every policy but `none` really wraps the layers in a checkpoint."""
    loss, grads, used = remat_run(lab, policy)
    none_loss, none_grads, _ = remat_run(lab, "none")
    assert_trees_close(grads, none_grads, REMAT_TOL, f"remat grads {policy} vs none")
    assert abs(float(loss) - float(none_loss)) <= REMAT_TOL * abs(float(none_loss))
    _, ref_grads = lab.ref_loss_and_grads()
    assert_trees_close(grads, ref_grads, GRAD_TOL, f"remat grads {policy} vs reference")
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
        memory = compile_to_inspect(jax.jit(fn).lower(params, tokens)).memory_analysis()
        temp[policy] = memory.temp_size_in_bytes
    print(f"temp_size_in_bytes: none={temp['none']:,} full={temp['full']:,}")
    assert temp["full"] < temp["none"]


@pytest.mark.parametrize("policy", ["full", "none"])
def test_a_fetching_phase_keeps_what_the_layer_policy_keeps(policy):
    """A phase that fetches its weights (`scan_phases(fetch=...)`, host-resident layers) is a
    checkpoint around the layers' scan; it must keep what the layers' remat policy keeps,
    not override it. Under `full`: each layer's input and no hidden-sized value (an outer
    "save anything" policy kept every layer's [B, F] intermediates, 2.4x XLA's bytes on a
    1x1x2 GPT with its layers offloaded). The loss and gradients equal the plain scan's."""
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    from jaxpod.parallel.layer_scan import scan_layers
    from jaxpod.parallel.phases import scan_phases
    from jaxpod.parallel.remat import remat

    layers, batch, d, f, phases = 4, 8, 16, 48, 2
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    stacked = {
        "w_in": jax.random.normal(k1, (layers, d, f)) / d**0.5,
        "w_out": jax.random.normal(k2, (layers, f, d)) / f**0.5,
    }
    x = jax.random.normal(k3, (batch, d))

    def layer(h, p):
        return h + jnp.tanh(h @ p["w_in"]) @ p["w_out"]

    layer_fn = remat(layer, policy)
    fetch = lambda chunk: jax.tree.map(lambda a: a * 1.0, chunk)  # noqa: E731  (a transfer)

    def phased(x, stacked):
        out = scan_phases(layer_fn, x, stacked, phases=phases, fetch=fetch, remat_policy=policy)
        return jnp.sum(out**2)

    def plain(x, stacked):
        return jnp.sum(scan_layers(layer_fn, x, stacked) ** 2)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # one line per residual: "f32[4,8,16] from ..."
        print_saved_residuals(phased, x, stacked)
    dims = re.findall(r"^\w+\[([\d,]*)\]", printed.getvalue(), re.M)
    shapes = [tuple(int(n) for n in ds.split(",") if n) for ds in dims]
    assert shapes, printed.getvalue()
    hidden = [s for s in shapes if s and s[-1] == f and len(s) >= 2 and s[-2] == batch]
    inputs = [s for s in shapes if s == (layers // phases, batch, d)]
    if policy == "full":
        assert hidden == [], shapes
        assert len(inputs) == phases, shapes  # each phase's layer inputs, stacked
    else:  # no remat: the layers' intermediates are kept, as without phases
        assert hidden, shapes
    got = jax.value_and_grad(phased, argnums=(0, 1))(x, stacked)
    want = jax.value_and_grad(plain, argnums=(0, 1))(x, stacked)
    assert_trees_close(got, want, REMAT_TOL, f"phases vs plain scan, {policy}")
