"""LARS / LAMB on sharded parameters: trust ratios use whole-parameter (per-layer) norms.

The reference comes from the session's equivalence lab (tests/helpers/lab.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.lab import (
    GRAD_TOL,
    LAB_PROCESS,
    assert_loss_close,
    assert_sharded_as,
    assert_trees_close,
    find_state,
    mesh_id,
    reference_optimizer,
    sgd_trace,
)

from jaxpod.engine import abstract_engine
from jaxpod.parallel.mesh import shardings

pytestmark = LAB_PROCESS

# The optax chain runs under GSPMD on the globally sharded arrays, so every norm is a
# reduction over the whole array and XLA inserts the cross-shard sums. To test exactly that,
# the sharded update is fed the reference's own gradients and parameters (sharded onto the
# mesh): only the order of the norms' sums differs. (With the mesh's own gradients, Adam's
# first step g / (|g| + eps) in LAMB amplifies their rounding noise where |g| ~ eps, as for
# AdamW in tests/engine/test_mesh_equivalence.py; the engine test below checks the full steps
# through the losses.) Measured max leaf-relative error: 3.5e-7 (lars and lamb, all three
# meshes).
TRUST_TOL = 4 * GRAD_TOL
TRUST_MESHES = [(2, 2, 2), (1, 4, 2), (2, 1, 4)]


def trust_updates(lab, shape, optim):
    """One optimizer update under GSPMD (as in the engine) of the reference's step-0 grads
    and params, sharded with the engine's specs on `shape`."""
    cfg = lab.cfg(shape, optim)
    mesh = lab.mesh_for(cfg)
    specs = abstract_engine(cfg, mesh)[0].stages.specs
    ref = lab.ref_steps(optim, 2)[0]
    to_mesh = lambda tree: jax.device_put(tree, shardings(mesh, specs))
    grads, params = to_mesh(ref["grads"]), to_mesh(ref["old_params"])
    assert_sharded_as(grads, specs, mesh, "sharded reference grads")
    opt, _ = reference_optimizer(cfg)
    return jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[0])(grads, params)


@pytest.mark.parametrize("optim", ["lars", "lamb"])
@pytest.mark.parametrize("shape", TRUST_MESHES, ids=mesh_id)
def test_trust_ratio_optimizers_sharded_match_reference(lab, shape, optim):
    """LARS/LAMB updates of the tensor- and pipeline-sharded grads == the reference updates.

    Teeth: on this mesh a trust ratio taken over one tensor shard of `w_in` (per layer) would
    be off by more than 10x the tolerance (computed from the reference arrays)."""
    updates = trust_updates(lab, shape, optim)
    ref = lab.ref_steps(optim, 2)[0]
    assert_trees_close(updates, ref["updates"], TRUST_TOL, f"{optim} updates {mesh_id(shape)}")
    t = lab.mesh_for(lab.cfg(shape, optim)).shape["tensor"]
    if t > 1:
        p = np.asarray(ref["old_params"]["layers"]["mlp"]["w_in"], np.float64)
        u = np.asarray(ref["updates"]["layers"]["mlp"]["w_in"], np.float64)
        whole = np.linalg.norm(p, axis=(1, 2)) / np.linalg.norm(u, axis=(1, 2))
        shard = [
            np.linalg.norm(ps, axis=(1, 2)) / np.linalg.norm(us, axis=(1, 2))
            for ps, us in zip(np.split(p, t, axis=2), np.split(u, t, axis=2), strict=True)
        ]
        wrong = max(float(np.max(np.abs(r / whole - 1))) for r in shard)
        print(f"shard-local trust ratio would be off by {wrong:.1e}")
        assert wrong > 10 * TRUST_TOL


def test_trust_ratio_engine_steps_match_reference(lab):
    """Two `train_step`s with LARS on 2x2x2: both losses match the reference, and LARS's
    momentum trace after step 1 (= the trust-ratio-scaled update) matches too.

    One compiled train step: the engine updates LAMB by the same code (`guarded_update` of
    the masked `make_optimizer` chain on the global arrays, per-layer trust ratios on the
    stacked leaves), and LAMB's chain on these shardings is
    `test_trust_ratio_optimizers_sharded_match_reference`'s, on three meshes."""
    optim = "lars"
    steps, ref = lab.steps((2, 2, 2), optim, 2), lab.ref_steps(optim, 2)
    for k in range(2):
        assert_loss_close(steps[k][1]["loss"], ref[k]["loss"], f"{optim} step {k + 1}")
    got = sgd_trace(steps[0][0].opt_state)
    want = find_state(ref[0]["opt_state"], "TraceState").trace
    assert_trees_close(got, want, TRUST_TOL, "lars trace")
