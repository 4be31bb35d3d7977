"""BERT (masked-language model) on the engine: the sharded loss and gradients equal the plain
single-device model's; the masking is exact, deterministic and independent of the mesh.

The reference is `BERT.__call__` on the whole global batch on one device, with the row keys
of `jaxpod.models.family.row_keys(seed, step, arange(G))`; the engine masks each replica's rows
inside `shard_map` from the same (seed, step, global row) keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import PINNED_TRANSFORMERS
from helpers.lab import adam_state

from jaxpod.engine import abstract_engine, build_engine
from jaxpod.models.family import build_model, row_keys

# fp32 throughout; the mesh only reorders sums. Measured maxima over the meshes below: loss
# 2.6e-7 relative, gradients 1.1e-6 leaf-relative (max |got - want| / max |want|). The
# bounds are those of tests/helpers/lab.py for GPT.
LOSS_RTOL = 1e-6
GRAD_TOL = 3e-6
GLOBAL_BATCH = 16
BERT = ("model.name=bert", "model.vocab=264", f"train.global_batch={GLOBAL_BATCH}")
BERT += ("train.grad_accum=null", "train.micro_batch=2", "optim.warmup_steps=0")


def batch(step: int = 0) -> np.ndarray:
    return np.random.default_rng([7, step]).integers(0, 256, (GLOBAL_BATCH, 65), np.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


_REF: dict = {}


def reference(cfg, step: int = 0):
    """Plain (loss, grads, initial params) of the whole batch on one device (one program per
    norm: the step whose row keys mask the batch is an argument)."""
    if cfg.model.norm not in _REF:
        graphdef, state = nnx.split(build_model(cfg.model, cfg.train.seed))
        seed = cfg.train.seed

        def loss(p, tokens, step):
            keys = row_keys(seed, step, jnp.arange(GLOBAL_BATCH))
            return nnx.merge(graphdef, p)(tokens, keys)

        _REF[cfg.model.norm] = (jax.jit(jax.value_and_grad(loss)), nnx.to_pure_dict(state), {})
    fn, params, done = _REF[cfg.model.norm]
    if step not in done:
        done[step] = fn(params, batch(step), jnp.int32(step))
    return (*done[step], params)


# Pre-LN with every axis sharded at once (2x2x2: `test_bert_engine_trains`, whose train
# step's first AdamW moment is 0.1 x the clipped gradients, checked like these), post-LN on the full
# mesh, sequence-parallel and streamed matrix by matrix (RTS 2, the MLP in 2 panels:
# `Layer.steps`' post-LN order), and post-LN with sequence parallelism on the tensor-heavy
# mesh (tensor width 4; the embedding LayerNorm, the position table split over tensor and
# the MLM targets/weights on split positions): each case is one XLA compile, so the list is
# kept to what adds evidence. (Pre-LN without sequence parallelism on 1x2x4 runs the kernels
# of the 2x2x2 pre-LN step on 4 tensor shards instead of 2: the same code, which the
# post-LN 1x2x4 case runs at width 4.)
MATRIX = "model.remat=full memory.rts=2 memory.stream=matrix memory.mlp_panels=2"
CASES = [((2, 2, 2), "post", True, MATRIX), ((1, 2, 4), "post", True, "")]


@pytest.mark.parametrize(
    ("shape", "norm", "sp", "more"),
    CASES,
    ids=[
        "x".join(map(str, s)) + f"-{n}" + "-sp" * sp + "-matrix" * bool(m) for s, n, sp, m in CASES
    ],
)
def test_sharded_mlm_loss_and_grads_match_reference(tiny_cfg, mesh_for, shape, norm, sp, more):
    """`engine.loss_and_grads` for BERT on replica/pipeline/tensor meshes == the plain model:
    loss (mean over the masked positions of the global batch) and every gradient leaf
    (post-LN on two meshes: the same kernels in another order), at the reference's initial
    params put in the engine's shardings (the engine's own init: test_bert_engine_trains)."""
    extra = more.split()
    cfg = tiny_cfg(*BERT, f"model.norm={norm}", f"model.sequence_parallel={sp}", *extra, mesh=shape)
    engine, state = abstract_engine(cfg, mesh_for(cfg))  # no init program: the reference's
    params = jax.device_put(reference(cfg)[2], jax.tree.map(lambda a: a.sharding, state.params))
    tokens = jax.device_put((batch(3),), engine.batch_sharding)
    loss, _, grads = jax.jit(engine.loss_and_grads)(params, tokens, None, jnp.int32(3))
    assert_matches_reference(cfg, loss, grads, 3, f"{shape} {norm}")


def assert_matches_reference(cfg, loss, grads, step: int, what: str, scale: float = 1.0):
    """`loss` and `grads` (times `scale`) are the reference's of `step`'s batch and masks."""
    want_loss, want_grads, _ = reference(cfg, step)
    err = abs(float(loss) - float(want_loss)) / float(want_loss)
    print(f"{what}: loss {float(loss):.6f} rel err {err:.1e}")
    assert err <= LOSS_RTOL
    got, want = jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(want_grads)
    errs = {
        jax.tree_util.keystr(k): rel_err(g, scale * np.asarray(w, np.float64))
        for (k, g), (_, w) in zip(got, want, strict=True)
    }
    worst = max(errs, key=errs.get)
    print(f"  worst grad leaf {worst} {errs[worst]:.1e}")
    assert errs[worst] <= GRAD_TOL, errs


# test_pinned's bert-222 case compiles this test's program (its config, spelled alike): one
# process compiles it once (`PINNED_TRANSFORMERS`, an xdist group the two tests share).
@pytest.mark.xdist_group(PINNED_TRANSFORMERS)
def test_bert_engine_trains(tiny_cfg, mesh_for):
    """`build_engine` with model.name=bert, pre-LN, on 2x2x2 (every axis sharded at once): the
    first step's loss and gradients are the reference's of step 0's masks (the gradients
    read from AdamW's first moment, (1 - b1) times the clipped gradient after one step: the
    global-norm clip at `optim.grad_clip`, here below the gradient's norm), the weights
    move, and eval runs."""
    cfg = tiny_cfg(*BERT, mesh=(2, 2, 2))
    engine, state = build_engine(cfg, mesh_for(cfg))
    before = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    losses = []
    for k in range(2):
        state, metrics = engine.train_step(
            state, jax.device_put((batch(k),), engine.batch_sharding)
        )
        losses.append(float(metrics["loss"]))
        if k == 0:
            mu = jax.device_get(adam_state(state.opt_state).mu)  # before step 2 donates it
    ref_norm = np.sqrt(
        sum(
            np.sum(np.square(np.asarray(g, np.float64)))
            for g in jax.tree.leaves(reference(cfg, 0)[1])
        )
    )
    clip = min(1.0, cfg.optim.grad_clip / ref_norm)
    assert clip < 1.0  # the clip is exercised
    scale = (1 - cfg.optim.b1) * clip
    assert_matches_reference(cfg, losses[0], mu, 0, "2x2x2 pre, step 1", scale)
    assert all(np.isfinite(losses)) and float(metrics["update_norm"]) > 0
    after = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    val = engine.eval_step(state.params, jax.device_put((batch(9),), engine.batch_sharding))
    val = float(val["val_loss"])
    assert np.isfinite(val) and 3.0 < val < 7.0
