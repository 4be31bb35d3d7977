"""Stochastic rounding (unbiased, exact, neighbours only), the float16 stall demonstration, and
loss scaling (an overflowing step is skipped bit-identically; dynamic scale halves/grows)."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxpod.config import OptimConfig, PrecisionConfig
from jaxpod.optim import stochastic_round  # the public name (jaxpod.optim.precision's)
from jaxpod.optim.chains import make_optimizer
from jaxpod.optim.guarded import guarded_update, whole_tree
from jaxpod.optim.precision import (
    LossScaleState,
    all_finite,
    apply_updates,
    cast_tree_like,
    compute_dtype,
    init_loss_scale,
    master_dtype,
    param_dtype,
    select_tree,
    update_loss_scale,
)

HALF = [np.float16, ml_dtypes.bfloat16]
HALF_IDS = ["float16", "bfloat16"]


def _f32(y) -> np.ndarray:
    return np.asarray(jnp.asarray(y).astype(jnp.float32))


def _neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Reference (numpy, bit-stepping): the `dtype` values lo <= |x| < hi (lo == |x| when
    representable), as float64 magnitudes; hi may be inf past the max."""
    a = np.abs(x.astype(np.float64))
    c = a.astype(np.float32).astype(dtype)  # round-to-nearest, then step down if above
    cb = c.view(np.uint16).astype(np.int64)
    cb = np.where(c.astype(np.float64) > a, cb - 1, cb)
    lo = cb.astype(np.uint16).view(dtype).astype(np.float64)
    hi = (cb + 1).astype(np.uint16).view(dtype).astype(np.float64)
    return lo, hi


def _tricky_values(dtype) -> np.ndarray:
    """float32 values spread over the dtype's whole range, both signs, incl. subnormals."""
    rng = np.random.default_rng(1)
    fi = ml_dtypes.finfo(dtype)
    lo_exp = np.log2(float(fi.smallest_subnormal)) - 2
    mags = 2.0 ** rng.uniform(lo_exp, np.log2(float(fi.max)), 4000)
    if dtype == np.float16:
        mags = mags[mags >= 2.0**-33]  # the exact regime (see stochastic_round's docstring)
    vals = (mags * rng.choice([-1.0, 1.0], mags.size)).astype(np.float32)
    return vals[np.isfinite(vals)]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_round_up_decision_is_exactly_proportional(dtype):
    """Deterministic exactness: for the random uint32 `r` the function draws, it rounds up
    iff r < p * 2**32 with p = (|x| - lo) / (hi - lo) computed in exact rational arithmetic,
    and the result is always lo or hi (with x's sign). So P(up) == p and E[result] == x."""
    x = _tricky_values(dtype)
    key = jax.random.key(7)
    y = _f32(stochastic_round(jnp.asarray(x), key, dtype)).astype(np.float64)
    r = np.asarray(jax.random.bits(key, x.shape, jnp.uint32))
    lo, hi = _neighbours(x, dtype)
    top = 2.0 ** ml_dtypes.finfo(dtype).maxexp  # past max, the upper neighbour (-> inf)
    for xi, yi, ri, lo_i, hi_i in zip(x, y, r, lo, hi, strict=True):
        a = Fraction(abs(float(xi)))
        if lo_i == a:  # representable: unchanged
            assert yi == xi, (xi, yi)
            continue
        hi_i = top if np.isinf(hi_i) else hi_i
        p = (a - Fraction(lo_i)) / (Fraction(hi_i) - Fraction(lo_i))
        want = hi_i if Fraction(int(ri)) < p * 2**32 else lo_i
        want = np.inf if want == top else want
        assert yi == np.copysign(want, xi), (xi, yi, want)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_representable_values_unchanged(dtype):
    fi = ml_dtypes.finfo(dtype)
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -3.0, float(fi.max), -float(fi.max)]
    special += [float(fi.tiny), -float(fi.tiny), float(fi.smallest_subnormal)]
    special += [-float(fi.smallest_subnormal), 3 * float(fi.smallest_subnormal), np.inf, -np.inf]
    rng = np.random.default_rng(0)
    random_repr = rng.standard_normal(5000).astype(np.float32).astype(dtype).astype(np.float32)
    x = np.concatenate([np.asarray(special, np.float32), random_repr])
    for seed in range(3):
        y = stochastic_round(jnp.asarray(x), jax.random.key(seed), dtype)
        assert y.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(_f32(y), x)
        assert np.array_equal(np.signbit(_f32(y)), np.signbit(x))  # -0.0 stays -0.0
    # NaN (a whole array of them: the program compiled above, no other shape to compile)
    nan = stochastic_round(jnp.asarray(np.full_like(x, np.nan)), jax.random.key(0), dtype)
    assert np.isnan(_f32(nan)).all()


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("where", ["normal", "negative", "subnormal"])
def test_unbiased_and_only_neighbours(dtype, where):
    """200k samples of one value between two neighbours: every sample is one of them, and
    the sample mean is within 5 binomial sigmas of x (sigma = gap * sqrt(p(1-p)/n); a false
    failure has probability ~6e-7). The mean is taken in float64 (a float32 sum would add
    its own rounding error)."""
    n, fi = 200_000, ml_dtypes.finfo(dtype)
    base = {"normal": 1.0, "negative": -3.0, "subnormal": 5 * float(fi.smallest_subnormal)}[where]
    lo_b = np.array([abs(base)], np.float32).astype(dtype)
    gap = float(np.array(lo_b.view(np.uint16) + 1, np.uint16).view(dtype)[0]) - abs(base)
    frac = 0.3  # x = lo + 0.3 * gap, away from zero
    x = np.float32(np.sign(base) * (abs(base) + frac * gap))
    assert float(x) != base and abs(abs(float(x)) - abs(base) - frac * gap) < 1e-3 * gap
    p = (abs(float(x)) - abs(base)) / gap  # the exact fraction after float32 rounding of x
    y = _f32(stochastic_round(jnp.full((n,), x), jax.random.key(3), dtype)).astype(np.float64)
    lo, hi = np.sign(base) * abs(base), np.sign(base) * (abs(base) + gap)
    assert set(np.unique(y)) <= {lo, hi}
    sigma = gap * np.sqrt(p * (1 - p) / n)
    assert abs(y.mean() - float(x)) < 5 * sigma, (y.mean() - float(x), sigma)
    assert abs(np.mean(y == hi) - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_overflow_goes_to_inf_proportionally():
    """Between float16's max (65504) and 2**16 the upper neighbour is inf (IEEE-style)."""
    # two values past 2**16 in front, in the same array: 200,000 float32 values, the shape
    # test_unbiased_and_only_neighbours rounds to float16 (its program, no other compile)
    n = 200_000 - 2
    x = np.concatenate([[70000.0, -1e30], np.full((n,), 65504.0 + 8.0)]).astype(np.float32)
    out = _f32(stochastic_round(jnp.asarray(x), jax.random.key(0), jnp.float16))
    big, y = out[:2], out[2:]
    assert set(np.unique(y)) == {65504.0, np.inf}
    p = 8.0 / 32.0
    assert abs(np.mean(np.isinf(y)) - p) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_equal(big, [np.inf, -np.inf])


def test_float32_is_identity_and_rounding_is_deterministic():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    np.testing.assert_array_equal(stochastic_round(x, jax.random.key(1), jnp.float32), x)
    a = stochastic_round(x, jax.random.key(1), jnp.float16)
    b = jax.jit(stochastic_round, static_argnums=2)(x, jax.random.key(1), jnp.float16)
    c = stochastic_round(x, jax.random.key(2), jnp.float16)
    np.testing.assert_array_equal(_f32(a), _f32(b))
    assert not np.array_equal(_f32(a), _f32(c))


def test_policy_dtypes():
    cfg = PrecisionConfig(params="float16", compute="bfloat16", master="float32")
    assert (param_dtype(cfg), compute_dtype(cfg), master_dtype(cfg)) == (
        jnp.float16,
        jnp.bfloat16,
        jnp.float32,
    )
    assert master_dtype(PrecisionConfig(params="bfloat16", master="same-as-params")) == (
        jnp.bfloat16
    )


def test_apply_updates_and_cast_tree_like():
    """float32 params: same as optax.apply_updates. 16-bit params keep their dtype, differ
    from round-to-nearest somewhere, and are reproducible from the key. Opt-state leaves
    return to their dtypes (ints plainly cast)."""
    k = jax.random.key(0)
    w = np.random.default_rng(0).standard_normal(64).astype(np.float32)  # numpy: no compile
    p32 = jax.device_put({"w": w, "b": np.zeros((3,), np.float32)})
    u = jax.device_put(
        {"w": np.full((64,), 1e-3, np.float32), "b": np.full((3,), 1e-3, np.float32)}
    )
    ours, theirs = apply_updates(p32, u, k), optax.apply_updates(p32, u)
    assert _bits_equal(ours, theirs)
    p16 = jax.device_put({"w": w.astype(np.float16), "b": np.zeros((3,), np.float16)})
    tiny = jax.device_put(
        {"w": np.full((64,), 1e-5, np.float32), "b": np.full((3,), 1e-5, np.float32)}
    )
    new = apply_updates(p16, tiny, k)
    assert all(x.dtype == jnp.float16 for x in jax.tree.leaves(new))
    assert not np.array_equal(_f32(new["w"]), _f32(p16["w"]))  # some rounded up
    nearest = (_f32(p16["w"]) + 1e-5).astype(np.float16).astype(np.float32)
    assert not np.array_equal(_f32(new["w"]), nearest)  # not round-to-nearest
    assert np.array_equal(_f32(apply_updates(p16, tiny, k)["w"]), _f32(new["w"]))
    like = {"count": jnp.zeros((), jnp.int32), "mu": jnp.zeros((8,), jnp.bfloat16)}
    newer = {"count": jnp.ones((), jnp.float32), "mu": jnp.full((8,), 1.0 + 2**-10)}
    out = cast_tree_like(newer, like, k)
    assert out["count"].dtype == jnp.int32 and out["mu"].dtype == jnp.bfloat16
    assert int(out["count"]) == 1  # an int plainly cast, not rounded stochastically


def test_stall_demonstration():
    """A weight vector trained by plain SGD on 0.5 * |w - target|^2 with float16 master
    weights in [0.5, 1) (ulp 2**-11, half ulp 2.4e-4) where every update lr * (w - target)
    <= 1e-3 * 0.2 = 2e-4 is below half an ulp: round-to-nearest leaves w bit-identical
    forever (the loss is flat), stochastic rounding follows the float32 run. 3000 steps:
    the float32 loss falls by exp(-2 * 3) ~ 400x; we require SR to fall 50x."""
    n, steps, lr = 512, 3000, 1e-3
    rng = np.random.default_rng(0)  # numpy draws: no compile
    w0 = jnp.asarray(rng.uniform(0.8, 0.95, n).astype(np.float16))
    target = jnp.asarray(np.asarray(w0, np.float32) - rng.uniform(0.05, 0.2, n).astype(np.float32))
    loss = lambda w: 0.5 * jnp.sum(jnp.square(w.astype(jnp.float32) - target))
    tx = optax.sgd(lr)

    def run(rounding):
        def body(carry, step):
            w, s = carry
            g = jax.grad(loss)(w.astype(jnp.float32))
            u, s = tx.update(g, s, w)
            key = jax.random.fold_in(jax.random.key(42), step)
            if rounding == "nearest":
                w = (w.astype(jnp.float32) + u).astype(w.dtype)
            else:
                w = apply_updates(w, u, key)
            return (w, s), loss(w)

        w_init = w0 if rounding != "float32" else w0.astype(jnp.float32)
        (w, _), losses = jax.lax.scan(body, (w_init, tx.init(w_init)), jnp.arange(steps))
        return w, np.asarray(losses)

    l0 = float(loss(w0))
    w_near, l_near = run("nearest")
    _, l_sr = run("stochastic")
    _, l_32 = run("float32")
    assert np.array_equal(_f32(w_near), _f32(w0))  # stalled: not a single bit moved
    assert np.all(l_near == l0)
    assert l_sr[-1] < l0 / 50, (l0, l_sr[-1])
    assert l_32[-1] < l0 / 50
    # SR tracks float32 up to the random walk its rounding noise adds (measured: +4%)
    assert l_sr[-1] < 1.2 * l_32[-1], (l_sr[-1], l_32[-1])


# ------------------------------------------------------------------------ loss scaling


def _setup(master_dtype_, name="lars"):
    params = {  # numpy draws: no compile
        "w": np.random.default_rng(0).standard_normal((8, 4)).astype(master_dtype_),
        "bias": np.zeros((4,), master_dtype_),
    }
    tx, _ = make_optimizer(
        OptimConfig(name=name, lr=0.5, lr_schedule="constant", weight_decay=1e-4),
        100,
        decay_mask={"w": True, "bias": False},
        clip=False,
    )
    return params, tx, tx.init(params)


def _bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", ["lars", "adamw"])
def test_overflow_step_is_skipped_and_scale_halves(dtype, name):
    cfg = PrecisionConfig(
        params=jnp.dtype(dtype).name,
        master="same-as-params",
        loss_scale="dynamic",
        loss_scale_init=1024.0,
        loss_scale_period=3,
    )
    params, tx, opt = _setup(dtype, name)
    ls = init_loss_scale(cfg)
    step = jax.jit(
        lambda g, o, p, s, k: guarded_update(whole_tree(tx), g, o, p, s, k, cfg, max_norm=1.0)
    )
    grads = jax.tree.map(lambda p: np.full(p.shape, 1024.0 * 0.01, dtype), params)
    params, opt, ls, info = step(grads, opt, params, ls, jax.random.key(1))  # a normal step
    assert bool(info["finite"]) and int(ls.good_steps) == 1 and int(ls.skipped) == 0
    bad = {"w": grads["w"].copy(), "bias": grads["bias"]}
    bad["w"][0, 0] = np.inf
    p2, o2, ls2, info = step(bad, opt, params, ls, jax.random.key(2))
    assert not bool(info["finite"])
    assert _bits_equal(p2, params) and _bits_equal(o2, opt)  # untouched, bit for bit
    assert float(ls2.scale) == 512.0 and int(ls2.good_steps) == 0 and int(ls2.skipped) == 1
    nan = jax.tree.map(lambda g: np.full_like(g, np.nan), grads)
    p3, o3, ls3, _ = step(nan, o2, p2, ls2, jax.random.key(3))
    assert _bits_equal(p3, params) and _bits_equal(o3, opt)
    assert float(ls3.scale) == 256.0 and int(ls3.skipped) == 2
    # three finite steps (period 3) double the scale and reset the counter
    for i in range(3):
        p3, o3, ls3, info = step(grads, o3, p3, ls3, jax.random.key(10 + i))
        assert bool(info["finite"]) and all_finite(p3)
    assert float(ls3.scale) == 512.0 and int(ls3.good_steps) == 0 and int(ls3.skipped) == 2
    assert not _bits_equal(p3, params)


def test_loss_scale_modes():
    f, t = jnp.array(False), jnp.array(True)
    dyn = PrecisionConfig(loss_scale="dynamic", loss_scale_init=2.0, loss_scale_period=2)
    s = init_loss_scale(dyn)
    assert float(s.scale) == 2.0
    for _ in range(3):  # halving floors at 1.0
        s = update_loss_scale(s, f, dyn)
    assert float(s.scale) == 1.0 and int(s.skipped) == 3
    s = update_loss_scale(update_loss_scale(s, t, dyn), t, dyn)
    assert float(s.scale) == 2.0 and int(s.good_steps) == 0
    static = PrecisionConfig(loss_scale="static", loss_scale_init=128.0)
    s = update_loss_scale(update_loss_scale(init_loss_scale(static), f, static), t, static)
    assert float(s.scale) == 128.0 and int(s.skipped) == 1
    none = PrecisionConfig()
    s = update_loss_scale(init_loss_scale(none), f, none)
    assert float(s.scale) == 1.0 and int(s.skipped) == 1
    assert isinstance(s, LossScaleState) and s.scale.dtype == jnp.float32
    assert s.good_steps.dtype == jnp.int32 and s.skipped.dtype == jnp.int32


def test_select_tree_and_all_finite():
    new = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.array([1], jnp.int32)}
    old = {"a": jnp.array([2.0, 3.0]), "b": jnp.array([0], jnp.int32)}
    assert not bool(all_finite(new)) and bool(all_finite(old)) and bool(all_finite({}))
    assert _bits_equal(select_tree(jnp.array(False), new, old), old)
    assert _bits_equal(select_tree(jnp.array(True), new, old), new)
