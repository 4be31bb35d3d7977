"""Optimizers and schedules: polynomial/warm-up values, masks from the models' parameter roles,
LARS and LAMB equal to optax's on unstacked params, and per-layer trust ratios on stacked
[L, ...] leaves equal to running the optimizer on L separate leaves."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpod.config import OptimConfig, load_config
from jaxpod.optim.chains import (
    clip_by_norm,
    lamb,
    lars,
    make_optimizer,
    scale_by_layerwise_trust_ratio,
    schedule,
)

# Tolerances: the same math in a different reduction order (our per-layer sum of squares vs
# jnp.linalg.norm; a [L, ...] reduction vs L separate ones) differs by a few float32 ulps per
# step; 1e-6 relative over 5 steps on O(1) values is ~10 ulps of headroom.
RTOL, ATOL = 1e-6, 1e-7
STEPS = 5


def _run(tx, params, grads, clip_first=None):
    """`len(grads)` optimizer steps (`grads`: a tree of `[steps, ...]` leaves, `_grads`), one
    jitted scan (a single compile per test); `clip_first`: a max norm the gradients are
    clipped to by `clip_by_norm` (with their global norm) before `tx`."""

    def step(carry, g):
        params, state = carry
        if clip_first is not None:
            g = clip_by_norm(g, optax.tree.norm(g), clip_first)
        updates, state = tx.update(g, state, params)
        return (optax.apply_updates(params, updates), state), None

    run = jax.jit(lambda p, gs: jax.lax.scan(step, (p, tx.init(p)), gs)[0][0])
    return run(params, grads)


# Inputs are drawn with numpy: no XLA compile per shape (a jax.random draw is one compile for
# each shape it is called with); what is compared is the same on any inputs.
def _normal(seed, shape) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _grads(params, seed, steps=STEPS):
    """`steps` random gradient trees like `params` (scale 0.1), stacked: leaves `[steps, ...]`."""
    flat, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    draws = [0.1 * rng.standard_normal((steps, *np.shape(p))).astype(np.float32) for p in flat]
    return jax.tree.unflatten(tree, draws)


def _assert_trees_close(a, b):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


def _flat_params():
    """Unstacked params with weight, bias and norm-scale leaves (numpy arrays)."""
    return {
        "dense": {"kernel": _normal(10, (6, 5)), "bias": np.full((5,), 0.1, np.float32)},
        "norm": {"scale": np.ones((5,), np.float32), "bias": np.zeros((5,), np.float32)},
        "mlp": {"w_in": _normal(11, (5, 7)), "b_in": _normal(12, (7,))},
        "wte": _normal(13, (11, 5)),
    }


# the role mask of `_flat_params`: no decay (and no trust ratio) for biases and norm scales
FLAT_DECAY = {
    "dense": {"kernel": True, "bias": False},
    "norm": {"scale": False, "bias": False},
    "mlp": {"w_in": True, "b_in": False},
    "wte": True,
}


# --------------------------------------------------------------------------- schedules


def test_polynomial_schedule_with_warmup_matches_closed_form():
    cfg = OptimConfig(lr=0.8, lr_schedule="polynomial", power=2.0, end_lr=0.01, warmup_steps=10)
    total = 110
    lr = schedule(cfg, total)
    for s in [0, 1, 5, 9]:  # linear warm-up from 0
        assert float(lr(s)) == pytest.approx(0.8 * s / 10, rel=1e-6)
    for s in [10, 11, 35, 60, 99, 110, 150]:
        t = min(s - 10, 100) / 100
        want = 0.01 + (0.8 - 0.01) * (1 - t) ** 2
        assert float(lr(s)) == pytest.approx(want, rel=1e-5), s


def test_constant_and_cosine_unchanged():
    c = schedule(OptimConfig(lr=0.5, lr_schedule="constant", warmup_steps=4), 20)
    assert [float(c(s)) for s in (0, 2, 4, 19)] == pytest.approx([0.0, 0.25, 0.5, 0.5])
    cos = schedule(OptimConfig(lr=0.5, lr_schedule="cosine", warmup_steps=0), 20)
    assert [float(cos(s)) for s in (0, 10, 20)] == pytest.approx([0.5, 0.25, 0.0], abs=1e-7)


def test_cosine_with_warmup_matches_closed_form():
    """Linear warm-up 0 -> lr over 4 steps, then lr/2 (1 + cos(pi t / 16)) over the other 16."""
    cos = schedule(OptimConfig(lr=0.5, lr_schedule="cosine", warmup_steps=4), 20)
    steps = [0, 1, 2, 4, 6, 12, 19, 20, 30]
    want = [
        0.5 * s / 4 if s < 4 else 0.25 * (1 + math.cos(math.pi * min(s - 4, 16) / 16))
        for s in steps
    ]
    assert [float(cos(s)) for s in steps] == pytest.approx(want, abs=1e-7)


# ------------------------------------------------------------------------------- masks


def test_masks_from_the_models_parameter_roles():
    """GPT declares its biases and norms `NO_DECAY`, its tables `TABLE`, its layers stacked
    (a leading "layers" axis) and the dimension of the stored `[L, ...]` array its streamed
    steps cut into panels (W_qkv's q/k/v, the MLP's hidden units); an EfficientNet stage's
    MBConv blocks are not stacked and its biases and GroupNorm parameters are not decayed."""
    from flax import nnx

    from jaxpod.models.efficientnet import build_stages
    from jaxpod.models.family import build_model
    from jaxpod.models.params import masks

    cfg = load_config("configs/tiny.yaml", ["model.tie_embeddings=false"])
    m = masks(nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, 0))))
    dm, sm, tm = m.decay, m.stacked, m.table
    assert dm["layers"]["attn"] == {"b_o": False, "b_qkv": False, "w_o": True, "w_qkv": True}
    assert dm["layers"]["mlp"] == {"b_in": False, "b_out": False, "w_in": True, "w_out": True}
    assert dm["layers"]["ln1"] == {"bias": False, "scale": False}
    assert dm["ln_f"] == {"bias": False, "scale": False}
    assert dm["wte"] and dm["wpe"] and dm["unembed"]
    assert all(jax.tree.leaves(sm["layers"]))
    assert not any(jax.tree.leaves({k: v for k, v in sm.items() if k != "layers"}))
    assert {k for k, v in tm.items() if v is True} == {"wte", "unembed"}
    panels = {"w_qkv": (2,), "b_qkv": (1,), "w_o": (), "b_o": ()}
    assert m.panel["layers"]["attn"] == panels
    assert m.panel["layers"]["mlp"] == {"w_in": (2,), "b_in": (1,), "w_out": (1,), "b_out": ()}
    assert m.panel["layers"]["ln1"] == {"bias": (), "scale": ()}
    assert all(m.panel[k] == () for k in ("wte", "wpe", "unembed"))
    stage = nnx.eval_shape(
        lambda: build_stages(
            "b0", num_classes=10, width_mult=0.25, depth_mult=0.2, rngs=nnx.Rngs(0)
        )[0]
    )
    sm = masks(nnx.state(stage))
    assert not any(jax.tree.leaves(sm.stacked)) and not jax.tree.leaves(sm.panel)
    assert sm.decay["blocks"][1]["se_reduce"] == {"kernel": True, "bias": False}
    assert sm.decay["blocks"][1]["spatial"]["norm"] == {"scale": False, "bias": False}


# ------------------------------------------------------------------- vs optax reference


def test_lars_equals_optax_lars_unstacked():
    params = _flat_params()
    grads = _grads(params, 1)
    kw = dict(weight_decay=1e-2, trust_coefficient=0.02, momentum=0.9)
    ours = lars(0.5, **kw, mask=FLAT_DECAY, stacked=False)
    ref = optax.lars(
        0.5, weight_decay_mask=FLAT_DECAY, trust_ratio_mask=FLAT_DECAY, **kw
    )  # same masks
    _assert_trees_close(_run(ours, params, grads), _run(ref, params, grads))


def test_lamb_equals_optax_lamb_unstacked():
    params = _flat_params()
    grads = _grads(params, 2)
    # unmasked: exactly optax.lamb (which applies decay and trust ratio to every leaf)
    ours = lamb(1e-2, b1=0.9, b2=0.99, weight_decay=1e-2, mask=True, stacked=False)
    ref = optax.lamb(1e-2, b1=0.9, b2=0.99, weight_decay=1e-2)
    _assert_trees_close(_run(ours, params, grads), _run(ref, params, grads))
    # masked: optax's own pieces with the trust ratio masked like the decay
    ours = lamb(1e-2, b1=0.9, b2=0.99, weight_decay=1e-2, mask=FLAT_DECAY)
    ref = optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.99, eps=1e-6),
        optax.add_decayed_weights(1e-2, mask=FLAT_DECAY),
        optax.masked(optax.scale_by_trust_ratio(), FLAT_DECAY),
        optax.scale_by_learning_rate(1e-2),
    )
    _assert_trees_close(_run(ours, params, grads), _run(ref, params, grads))


def test_masked_leaves_get_no_decay_and_no_trust_ratio():
    """With zero gradients, only decayed leaves move (weight decay); with unit gradients,
    the first LARS step of a masked leaf is exactly -lr * g (no trust ratio)."""
    params = _flat_params()
    zeros = jax.tree.map(np.zeros_like, params)
    tx = lars(0.5, weight_decay=0.1, trust_coefficient=0.02, mask=FLAT_DECAY)
    first = _first_update(tx)
    upd = first(zeros, params)
    mask = FLAT_DECAY
    for m, u in zip(jax.tree.leaves(mask), jax.tree.leaves(upd), strict=True):
        assert bool(np.any(u != 0)) == m
    ones = jax.tree.map(np.ones_like, params)
    upd = first(ones, params)
    np.testing.assert_array_equal(upd["dense"]["bias"], -0.5 * np.ones(5))
    np.testing.assert_array_equal(upd["norm"]["scale"], -0.5 * np.ones(5))
    assert not np.allclose(upd["dense"]["kernel"], -0.5)
    for name in ("sgd", "adamw"):  # decay masked for every optimizer
        cfg = OptimConfig(name=name, weight_decay=0.1, lr_schedule="constant", grad_clip=0.0)
        tx, _ = make_optimizer(cfg, 10, decay_mask=FLAT_DECAY)
        upd = _first_update(tx)(zeros, params)
        assert not bool(np.any(upd["norm"]["scale"] != 0)), name
        assert bool(np.any(upd["wte"] != 0)), name


def _first_update(tx):
    """`(grads, params) -> the first update of tx` as one jitted program (numpy leaves out)."""
    update = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])
    return lambda g, p: jax.tree.map(np.asarray, update(g, p))


# -------------------------------------------------------------------- stacked == per layer


L = 3


def _stacked_params():
    """Params with stacked `[L, ...]` layer leaves (numpy arrays)."""
    scales = np.arange(1, L + 1, dtype=np.float32)  # very different norms per layer
    return {
        "layers": {
            "attn": {
                "w_qkv": _normal(20, (L, 4, 3, 4)) * scales[:, None, None, None],
                "b_qkv": _normal(21, (L, 3, 4)),
            },
            "ln1": {"scale": np.ones((L, 4), np.float32), "bias": np.zeros((L, 4), np.float32)},
        },
        "wte": _normal(22, (9, 4)),
        "ln_f": {"scale": np.ones((4,), np.float32), "bias": np.zeros((4,), np.float32)},
    }


# the role masks of `_stacked_params`: the "layers" leaves are stacked; biases and norms
# are not decayed
STACKED = {"layers": True, "wte": False, "ln_f": False}
STACKED_DECAY = {
    "layers": {"attn": {"w_qkv": True, "b_qkv": False}, "ln1": {"scale": False, "bias": False}},
    "wte": True,
    "ln_f": {"scale": False, "bias": False},
}


def _unstack(tree, axis=0):
    """{"layers": leaves [L, ...]} -> {"layer0": ..., "layer1": ...} + the other entries (the
    layer axis `axis`; sliced in numpy: no compile)."""
    out = {k: v for k, v in tree.items() if k != "layers"}
    for i in range(L):
        out[f"layer{i}"] = jax.tree.map(
            lambda x, i=i: np.take(np.asarray(x), i, axis=axis), tree["layers"]
        )
    return out


def _restack(tree):
    out = {k: v for k, v in tree.items() if not k.startswith("layer")}
    layers = [jax.tree.map(np.asarray, tree[f"layer{i}"]) for i in range(L)]
    out["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *layers)
    return out


@pytest.mark.parametrize(
    "make",
    [
        lambda st, m: lars(2.0, weight_decay=1e-2, trust_coefficient=0.01, stacked=st, mask=m),
        lambda st, m: lamb(1e-2, weight_decay=1e-2, stacked=st, mask=m),
    ],
    ids=["lars", "lamb"],
)
def test_stacked_trust_ratio_equals_per_layer(make):
    """The important one: a stacked [L, ...] leaf updated by the optimizer equals L separate
    leaves updated by it (trust ratios per layer), over several steps."""
    params = _stacked_params()
    grads = _grads(params, 3)
    stacked = _run(make(STACKED, STACKED_DECAY), params, grads)
    unstacked_decay = {k: v for k, v in STACKED_DECAY.items() if k != "layers"}
    unstacked_decay |= {f"layer{i}": STACKED_DECAY["layers"] for i in range(L)}
    per_layer = _run(make(False, unstacked_decay), _unstack(params), _unstack(grads, axis=1))
    _assert_trees_close(stacked, _restack(per_layer))
    # and the test has power: a whole-leaf trust ratio on the stacked leaf differs
    whole = _run(make(False, STACKED_DECAY), params, grads)
    w_s, w_w = stacked["layers"]["attn"]["w_qkv"], whole["layers"]["attn"]["w_qkv"]
    assert not np.allclose(w_s, w_w, rtol=1e-3)


def test_layerwise_transform_matches_optax_per_slice():
    """One application of the bare transform on a stacked leaf == optax.scale_by_trust_ratio
    on each slice (same coefficient and eps)."""
    p = _stacked_params()["layers"]["attn"]["w_qkv"]
    u = _normal(9, p.shape)
    u[1] = 0.0  # a zero-norm layer keeps ratio 1 (optax's rule), per layer
    ours = jax.jit(
        lambda u, p: scale_by_layerwise_trust_ratio(0.01, 1e-3, stacked=True).update(u, None, p)[0]
    )(u, p)
    ref = optax.scale_by_trust_ratio(trust_coefficient=0.01, eps=1e-3)
    wants = jax.jit(lambda u, p: [ref.update(u[i], None, p[i])[0] for i in range(L)])(u, p)
    for i in range(L):
        np.testing.assert_allclose(ours[i], wants[i], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ make_optimizer, clip


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars"])
def test_make_optimizer_clip_false_plus_clip_by_norm_equals_clip(name):
    """`clip=False` + `clip_by_norm(g, global_norm, grad_clip)` == the chain with the clip,
    bit for bit (the caller-supplied-norm path for shard_map)."""
    params = _stacked_params()
    cfg = OptimConfig(name=name, lr=0.1, grad_clip=0.05, weight_decay=1e-3, warmup_steps=2)
    with_clip, lr = make_optimizer(cfg, 20)
    without, _ = make_optimizer(cfg, 20, clip=False)
    assert float(lr(1)) == pytest.approx(0.05)
    grads = _grads(params, 4, steps=3)  # each side one jitted program, as train jits it
    p1, p2 = _run(with_clip, params, grads), _run(without, params, grads, cfg.grad_clip)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(p1))


def test_clip_by_norm_scales_by_min_one():
    g = {"a": jnp.array([3.0, 4.0])}
    np.testing.assert_allclose(clip_by_norm(g, jnp.array(5.0), 1.0)["a"], [0.6, 0.8])
    np.testing.assert_array_equal(clip_by_norm(g, jnp.array(5.0), 10.0)["a"], [3.0, 4.0])


def test_make_optimizer_call_compatible_with_train():
    """Every optimizer's update traces and lowers under `jax.jit` as train calls it, and its
    updates have the params' tree structure (read from the lowered program: nothing here
    needs it compiled; the other tests compile and run these chains)."""
    cfg = load_config("configs/tiny.yaml")
    for name in ("sgd", "adamw", "lamb", "lars"):
        optim = dataclasses.replace(cfg.optim, name=name, lr_schedule="polynomial", power=2.0)
        tx, lr = make_optimizer(optim, cfg.train.steps)
        params = _stacked_params()
        grads = jax.tree.map(lambda g: g[0], _grads(params, 0, 1))
        state = jax.eval_shape(tx.init, params)
        updates, _ = jax.jit(tx.update).lower(grads, state, params).out_info
        assert jax.tree.structure(updates) == jax.tree.structure(params)
        assert float(lr(cfg.train.steps)) == pytest.approx(cfg.optim.end_lr, abs=1e-9)


def test_unclipped_optimizer_shares_the_state_tree():
    """`clip=False` swaps the clip for `optax.identity()`: the same state tree, so the
    layer-by-layer update (which clips itself) can update the engine's state."""
    params = {"w": jnp.ones((3, 2)), "bias": jnp.zeros((2,))}
    for name in ("sgd", "adamw", "lamb", "lars"):
        cfg = OptimConfig(name=name, grad_clip=1.0)
        clipped, _ = make_optimizer(cfg, 10)
        unclipped, _ = make_optimizer(cfg, 10, clip=False)
        assert jax.tree.structure(clipped.init(params)) == jax.tree.structure(
            unclipped.init(params)
        )


def test_float32_moments_are_float32_and_the_same_math():
    """`optim.moments=float32` on float16 leaves: the state is float32, and each update equals
    the optimizer run on the float32-cast leaves, cast back to float16 (exactly: the same
    float32 arithmetic, one rounding at the end)."""
    from jaxpod.optim.chains import float32_state

    params = {"w": _normal(0, (8, 4)).astype(np.float16)}
    grads = {"w": (1e-3 * _normal(1, (8, 4))).astype(np.float16)}
    inner = optax.lamb(1e-2, b1=0.9, b2=0.999)
    tx = float32_state(inner)
    # each first update one jitted program (dtypes of the states: read from their shapes)
    first = lambda tx: jax.jit(lambda g, p: tx.update(g, tx.init(p), p))  # noqa: E731
    state = jax.eval_shape(tx.init, params)
    assert {leaf.dtype for leaf in jax.tree.leaves(state) if leaf.ndim} == {jnp.dtype("float32")}
    updates, _ = first(tx)(grads, params)
    up = lambda t: jax.tree.map(lambda a: a.astype(np.float32), t)  # noqa: E731
    want, _ = first(inner)(up(grads), up(params))
    assert updates["w"].dtype == jnp.float16
    np.testing.assert_array_equal(updates["w"], np.asarray(want["w"]).astype(np.float16))
    # in float16, g^2 of these gradients underflows: the plain optimizer's second moment is 0
    _, half = first(inner)(grads, params)
    nu = next(
        s.nu for s in jax.tree.leaves(half, is_leaf=lambda s: hasattr(s, "nu")) if hasattr(s, "nu")
    )
    assert float(np.max(np.asarray(nu["w"]).astype(np.float32))) == 0.0
    cfg = dataclasses.replace(OptimConfig(name="lamb"), moments="float32")
    full, _ = make_optimizer(cfg, 10)
    assert {
        leaf.dtype for leaf in jax.tree.leaves(jax.eval_shape(full.init, params)) if leaf.ndim
    } == {jnp.dtype("float32")}
