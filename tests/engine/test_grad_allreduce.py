"""Training with each gradient all-reduce option equals the default (`psum` per leaf).

`parallel.grad_allreduce` (psum | ring) and `parallel.grad_bucket_bytes` change only how the
data-parallel sum of the gradients runs. One SGD step of each option on 2x2x2 (data axes
replica and pipeline: the embeddings' gradients are summed over both) from the same initial
state as the default engine, on the same batch: loss, gradients (SGD's trace after one step
is the gradient) and parameters.

`psum` over buckets adds the same numbers in the same order as `psum` per leaf: bit-identical.
The ring adds them in another order (float32 throughout), a change of summation order like a
change of mesh: the equivalence lab's tolerances (tests/helpers/lab.py) apply. The ring over
the RTS-split data axes is checked in tests/parallel/test_collectives.py (reduce_grads) and
by the 2-process run of tests/cli/test_multihost_collectives.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lab import (
    GRAD_TOL,
    LAB_PROCESS,
    assert_loss_close,
    assert_params_close,
    assert_trees_close,
    batch,
    copy_tree,
    leaves,
    loss_and_grads_of,
    put,
    sgd_trace,
    update_bound,
)
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

from jaxpod.engine import abstract_engine

pytestmark = LAB_PROCESS

SHAPE = (2, 2, 2)
BUCKET = "parallel.grad_bucket_bytes=65536"  # 64 KiB: several buckets, some leaves alone
RING = "parallel.grad_allreduce=ring"
# each knob away from its default once (the ring per leaf: tests/parallel/test_collectives.py)
OPTIONS = {"psum bucketed": (BUCKET,), "ring bucketed": (RING, BUCKET)}


def one_step(lab, *extra):
    """(initial state, state after one SGD step, its metrics, lr) of `lab.cfg(SHAPE, sgd,
    *extra)`'s engine. The initial state depends on the mesh only: every option starts from
    the lab's default engine's (`lab.engine`), and the default's step is the lab's
    (`lab.steps`, which test_mesh_equivalence.py's one-step tests share in a process)."""
    cfg, mesh, default, initial = lab.engine(SHAPE, "sgd")
    if not extra:
        new_state, metrics = lab.steps(SHAPE, "sgd", 1)[0]
        return initial, new_state, metrics, float(default.stages.lr_schedule(0))

    def run():
        engine, _ = abstract_engine(lab.cfg(SHAPE, "sgd", *extra), mesh)
        new_state, metrics = engine.train_step(copy_tree(initial), put(engine, batch(0)))
        return new_state, jax.device_get(metrics), float(engine.stages.lr_schedule(0))

    return initial, *lab.memo(("grad_allreduce", extra), run)


@pytest.mark.parametrize("name", OPTIONS)
def test_one_step_equals_the_default(lab, name):
    initial, state, metrics, lr = one_step(lab, *OPTIONS[name])
    _, default, default_metrics, _ = one_step(lab)
    grads, want = sgd_trace(state.opt_state), sgd_trace(default.opt_state)
    if name.startswith("psum"):
        assert float(metrics["loss"]) == float(default_metrics["loss"])
        for part, got, ref in (("grads", grads, want), ("params", state.params, default.params)):
            g, w = leaves(got), leaves(ref)
            for k in w:
                np.testing.assert_array_equal(g[k], w[k], err_msg=f"{part} {k}")
        return
    assert_loss_close(metrics["loss"], default_metrics["loss"], name)
    assert_trees_close(grads, want, GRAD_TOL, f"grads {name}")
    bound = update_bound("sgd", want, lr)
    assert_params_close(state.params, default.params, initial.params, bound, f"params {name}")


def count_collectives(lab, *extra):
    """Collective equations over `replica` in the jaxpr of `engine.loss_and_grads` on 2x1x1
    (the gradient reduction runs once, after the micro-batch loop); the parameter specs."""
    cfg = lab.tiny_cfg("train.micro_batch=2", "train.grad_accum=1", *extra, mesh=(2, 1, 1))
    fn, params, specs = loss_and_grads_of(lab, cfg)
    tokens = jax.ShapeDtypeStruct((cfg.global_batch, cfg.model.seq_len + 1), jnp.int32)
    counts: dict[str, int] = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, tuple) else (axes,)
            if "replica" in axes and eqn.primitive.name not in ("pvary", "pcast"):
                counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(params, tokens).jaxpr)
    return counts, specs


def test_buckets_cut_the_collective_count(lab):
    """psum per leaf: one per gradient leaf, plus the loss's; one big bucket per group of
    leaves that may share one (same reduction axes and varying axes: here, the same spec
    axes); the ring: 2 (n - 1) = 2 ppermutes per bucket instead of its psum."""
    per_leaf, specs = count_collectives(lab)
    big = "parallel.grad_bucket_bytes=1000000000"
    bucketed, _ = count_collectives(lab, big)
    ring, _ = count_collectives(lab, RING, big)
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    groups = len({frozenset(jax.tree.leaves(tuple(s))) for s in flat})
    print(f"{len(flat)} leaves, {groups} groups: {per_leaf} / {bucketed} / ring {ring}")
    psums = lambda c: c.get("psum", 0) + c.get("psum_invariant", 0)
    assert psums(per_leaf) == len(flat) + 1
    assert psums(bucketed) == groups + 1 < psums(per_leaf)
    assert psums(ring) == 1 and ring["ppermute"] == 2 * groups
