"""The pipelined image classifier on the engine: its stages' rows, the sharded step vs a plain
reference, two stages vs one, a skipped float16 overflow (stage packing itself:
tests/parallel/test_stages.py).

The reference is computed the plain way on one device: the same stage modules applied one
after another to the whole global batch, `jax.grad` of the mean cross-entropy, and the optax
chain (with its own global-norm clip) on the network's pieces in order (stem, blocks, head).
The sharded engine instead runs GPipe over micro-batches with `lax.switch` per stage, psums
over replicas, clips with a norm psum'd over stages and updates each stage's packed row on
its own devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import DIGITS_STEPS, TINY_EFFICIENTNET, TINY_VISION, digits_cfg

pytestmark = pytest.mark.xdist_group(TINY_EFFICIENTNET)  # the programs test_pinned compiles


@pytest.fixture(scope="module")
def digits():
    from jaxpod.data.images import load_images

    return load_images("digits", image_size=32, seed=0)


def vision_cfg(tiny_cfg, mesh, *extra):
    """The tiny EfficientNet on `mesh`: its two stages on a pipeline of 2, else one."""
    one = () if mesh[1] == 2 else ("model.pipeline_splits=[]",)
    return tiny_cfg(*TINY_VISION, *one, *extra, mesh=mesh)


def global_batch(engine, cfg, digits, step=0):
    g = cfg.global_batch
    return jax.device_put(digits.train_batch(step, 0, g, g), engine.batch_sharding)


def network_pieces(trees: list[dict]) -> list:
    """Stage trees (or masks shaped like them) -> the network's pieces in order: stem, blocks,
    head. One list whatever the split, so every mesh's reference is one program."""
    out = []
    for t in trees:
        out += [t["stem"]] if "stem" in t else []
        out += [t["blocks"][i] for i in sorted(t["blocks"])]
        out += [t["head"]] if "head" in t else []
    return out


def stage_trees(pieces: list, like: list[dict]) -> list[dict]:
    """`network_pieces`' inverse: `pieces` grouped as the stage trees `like`."""
    it, out = iter(pieces), []
    for t in like:
        stage = {}
        if "stem" in t:
            stage["stem"] = next(it)
        stage["blocks"] = {i: next(it) for i in sorted(t["blocks"])}
        if "head" in t:
            stage["head"] = next(it)
        out.append(stage)
    return out


def reference_step(cfg, engine, trees, batch):
    """Plain single-device loss and updated stage trees."""
    from jaxpod.models.efficientnet import normalize
    from jaxpod.optim.chains import make_optimizer

    images, labels = (np.asarray(a) for a in batch)
    graphdefs = engine.stages.graphdefs

    def loss_fn(pieces):
        x = normalize(jnp.asarray(images), jnp.float32)
        for g, t in zip(graphdefs, stage_trees(pieces, trees), strict=True):
            x = nnx.merge(g, t)(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, jnp.asarray(labels)).mean()

    decay = network_pieces([m.decay for m in engine.stages.masks])  # the pieces' roles
    tx, _ = make_optimizer(cfg.optim, cfg.train.steps, decay_mask=decay)

    @jax.jit
    def step(pieces):  # one device, no mesh: the plain gradient and the optax chain
        loss, grads = jax.value_and_grad(loss_fn)(pieces)
        updates, _ = tx.update(grads, tx.init(pieces), pieces)
        return loss, optax.apply_updates(pieces, updates)

    loss, updated = step(network_pieces(trees))
    return float(loss), stage_trees(updated, trees)


def host_trees(engine, params):
    return [jax.tree.map(np.asarray, t) for t in engine.stages.packing.unpack_all(params)]


def test_stage_rows_live_on_their_stage(tiny_cfg, mesh_for):
    from jaxpod.engine import build_engine

    cfg = vision_cfg(tiny_cfg, (4, 2, 1))
    mesh = mesh_for(cfg)
    engine, state = build_engine(cfg, mesh)
    for buf in state.params.values():
        for shard in buf.addressable_shards:
            stage = int(np.argwhere(mesh.devices == shard.device)[0][1])
            assert shard.index[0] == slice(stage, stage + 1)
    trees = host_trees(engine, state.params)
    assert sum(x.size for x in jax.tree.leaves(trees)) == engine.stages.params_count
    assert engine.stages.packing.num_stages == 2


# Each distinct config is one XLA compile (10-30 s for a CNN on 2 cores): the meshes and the
# config are test_pinned's effnet-421 and effnet-111, whose programs the compilation cache serves;
# the reference, on the network's pieces, is one program for both meshes.
@pytest.mark.parametrize("shape", [(4, 2, 1), (1, 1, 1)], ids=["4x2x1", "1x1x1"])
def test_step_matches_single_device_reference(tiny_cfg, mesh_for, digits, shape):
    from jaxpod.engine import build_engine

    cfg = vision_cfg(tiny_cfg, shape)
    engine, state = build_engine(cfg, mesh_for(cfg))
    trees = host_trees(engine, state.params)
    batch = global_batch(engine, cfg, digits)
    want_loss, want = reference_step(cfg, engine, trees, batch)
    state, metrics = engine.train_step(state, batch)
    # f32 sums in a different order (micro-batches, replicas, stages), through LARS's norm
    # ratios: measured (both meshes) the loss equal, parameters (all O(1)) at most
    # 1.2e-7 apart; the bounds are about 4x that. The step moves them far more.
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=5e-7)
    moved = 0.0
    for got_tree, want_tree, old_tree in zip(
        host_trees(engine, state.params), want, trees, strict=True
    ):
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(g, w, rtol=0, atol=5e-7),
            got_tree,
            want_tree,
        )
        for w, old in zip(jax.tree.leaves(want_tree), jax.tree.leaves(old_tree), strict=True):
            moved = max(moved, float(np.max(np.abs(np.asarray(w) - np.asarray(old)))))
    assert moved > 100 * 5e-7, moved
    assert int(metrics["skipped_steps"]) == 0


def test_two_stage_losses_equal_one_stage(tiny_cfg, mesh_for, digits):
    """Same seed, same network (parameters are drawn in network order): S=2 == S=1 over three
    steps (test_pinned's effnet-421 and effnet-111 programs). Packed stages in several GPipe
    passes a step: tests/engine/test_schedules_engine.py's EfficientNet test."""
    from jaxpod.engine import build_engine

    losses = {}
    for shape in [(1, 1, 1), (4, 2, 1)]:
        cfg = vision_cfg(tiny_cfg, shape)
        engine, state = build_engine(cfg, mesh_for(cfg))
        run = []
        for step in range(3):
            state, metrics = engine.train_step(state, global_batch(engine, cfg, digits, step))
            run.append(float(metrics["loss"]))
        losses[shape] = run
    # measured 9.8e-8 relative over the 3 steps
    np.testing.assert_allclose(losses[(4, 2, 1)], losses[(1, 1, 1)], rtol=5e-7)


def test_overflow_is_skipped_and_halves_the_scale(mesh_for, digits):
    from jaxpod.engine import build_engine

    # scaled float16 gradients overflow
    cfg = digits_cfg(DIGITS_STEPS, "precision.loss_scale_init=1e30")
    engine, state = build_engine(cfg, mesh_for(cfg))
    assert set(state.params) == {"float16"}  # no float32 master copy anywhere
    before = jax.tree.map(np.asarray, (state.params, state.opt_state.tx))
    state, metrics = engine.train_step(state, global_batch(engine, cfg, digits))
    after = jax.tree.map(np.asarray, (state.params, state.opt_state.tx))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    assert int(metrics["skipped_steps"]) == 1
    assert float(state.opt_state.loss_scale.scale) == pytest.approx(0.5e30, rel=1e-6)
    assert int(state.step) == 1
