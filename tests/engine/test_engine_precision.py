"""Mixed precision in the engine: bfloat16 master weights train, an overflowing float16 step
is skipped bit-identically.

The reference comes from the session's equivalence lab (tests/helpers/lab.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers.lab import LAB_PROCESS, batch, leaves, put, record

from jaxpod.engine import build_engine

pytestmark = LAB_PROCESS

# bfloat16 compute vs the float32 reference: a bfloat16 forward rounds every activation to
# 8 bits of mantissa; measured relative loss difference 3e-6 at init (the loss is dominated
# by log(V) and the logits are small). Stated bound 1e-3 (~ 2**-10).
BF16_LOSS_RTOL = 1e-3


def test_bfloat16_master_weights_step(lab):
    """precision.params/compute bfloat16 with bfloat16 master weights (stochastic rounding)
    and dynamic loss scaling on 2x2x2: the state holds bfloat16 params, the first loss is
    the float32 reference's to bfloat16 accuracy, the loss scale is reported, nothing is
    skipped, every parameter stays finite and the step moves the weights."""
    prec = (
        "precision.params=bfloat16",
        "precision.compute=bfloat16",
        "precision.master=same-as-params",
        "precision.loss_scale=dynamic",
    )
    cfg = lab.cfg((2, 2, 2), "adamw", *prec)
    engine, state = build_engine(cfg, lab.mesh_for(cfg))
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    old = leaves(state.params)
    new, metrics = engine.train_step(state, put(engine, batch(0)))
    ref_loss = float(lab.ref_loss_and_grads()[0])
    err = abs(float(metrics["loss"]) - ref_loss) / ref_loss
    record("loss bfloat16 vs float32 reference", err)
    assert err <= BF16_LOSS_RTOL
    assert float(metrics["loss_scale"]) == cfg.precision.loss_scale_init
    assert int(metrics["skipped_steps"]) == 0
    moved = 0
    for k, v in leaves(new.params).items():
        assert v.dtype == jnp.bfloat16 and np.all(np.isfinite(v.astype(np.float32))), k
        moved += int(np.sum(v != old[k]))
    assert moved > 0.5 * sum(v.size for v in old.values())


def test_float16_overflow_skips_step(lab):
    """float16 compute with a loss scale of 2**40: the scaled gradients overflow float16, so
    the step is skipped: params and optax state bit-identical, `skipped_steps` 1, the scale
    halved for the next step, and no NaN reaches the weights."""
    prec = (
        "precision.params=float16",
        "precision.compute=float16",
        "precision.loss_scale=dynamic",
        f"precision.loss_scale_init={2.0**40}",
    )
    cfg = lab.cfg((2, 2, 2), "adamw", *prec)
    engine, state = build_engine(cfg, lab.mesh_for(cfg))
    old_params, old_tx = leaves(state.params), leaves(state.opt_state.tx)
    assert {a.dtype for a in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    new, metrics = engine.train_step(state, put(engine, batch(0)))
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**40
    assert float(new.opt_state.loss_scale.scale) == 2.0**39 and int(new.step) == 1
    for k, v in leaves(new.params).items():
        np.testing.assert_array_equal(v, old_params[k], err_msg=k)
    for k, v in leaves(new.opt_state.tx).items():
        np.testing.assert_array_equal(v, old_tx[k], err_msg=k)
