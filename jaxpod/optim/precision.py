"""Mixed precision: dtypes of the policy, stochastic rounding, and loss scaling.

Policy (`precision.*`): the TrainState holds params in the *master* dtype (`master_dtype`:
float32, or the params dtype for `master=same-as-params`); the forward pass casts them to
`param_dtype` and models compute in `compute_dtype`. With 16-bit master weights there is no
float32 copy: the optimizer runs on float32 upcasts and `apply_updates` writes the result back
with **stochastic rounding**, so updates far below half an ulp still move the weights on
average (round-to-nearest would drop them: training stalls).

Randomness: the caller passes one key per step, `jax.random.fold_in(jax.random.key(seed),
step)`; each leaf gets `fold_in(key, crc32(path))`, so rounding is deterministic under
`train.seed`, independent of leaf order and of the mesh (threefry is partitionable).

Loss scaling (`LossScaleState`): the loss is multiplied by `scale` before differentiation and
the gradients divided by it. A step whose gradients are not all finite is *skipped*: params
and optimizer state are left bit-identical (a `lax.cond` or `select_tree`: the `Apply`s of
`jaxpod.optim.guarded`) and `skipped` counts it, for every `loss_scale` mode including `none`
(a NaN/inf step is dropped instead of poisoning the weights).
`jaxpod.optim.guarded.guarded_update` does the whole sequence.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpod.config import PrecisionConfig

__all__ = [
    "LossScaleState",
    "all_finite",
    "apply_updates",
    "cast_tree_like",
    "compute_dtype",
    "init_loss_scale",
    "is_half",
    "leaf_key",
    "master_dtype",
    "param_dtype",
    "select_tree",
    "stochastic_round",
    "sum_squares",
    "unscale_grads",
    "update_loss_scale",
]

F32 = jnp.float32
# 16-bit float formats: (explicit mantissa bits, exponent of the smallest normal number)
_FORMATS = {jnp.dtype(jnp.float16): (10, -14), jnp.dtype(jnp.bfloat16): (7, -126)}
MAX_LOSS_SCALE = 2.0**64  # dynamic growth stops here (float32 would overflow at 2**128)
MIN_LOSS_SCALE = 1.0  # dynamic halving stops here: the loss is never scaled *down*


# ----------------------------------------------------------------------------- dtypes


def param_dtype(cfg: PrecisionConfig) -> jnp.dtype:
    """dtype the forward pass casts the (master) params to: `precision.params`."""
    return jnp.dtype(cfg.params)


def compute_dtype(cfg: PrecisionConfig) -> jnp.dtype:
    """dtype of matmuls/convs: `precision.compute`."""
    return jnp.dtype(cfg.compute)


def master_dtype(cfg: PrecisionConfig) -> jnp.dtype:
    """dtype the TrainState holds params (and so updates) in: float32, or `precision.params`
    for `master=same-as-params`."""
    return jnp.dtype(F32) if cfg.master == "float32" else param_dtype(cfg)


def is_half(dtype) -> bool:
    """True for float16 and bfloat16 (the dtypes stochastic rounding targets)."""
    return jnp.dtype(dtype) in _FORMATS


# ----------------------------------------------------------------- stochastic rounding


def stochastic_round(x: jax.Array, key: jax.Array, dtype) -> jax.Array:
    """Round each float32 element of `x` to one of its two neighbouring `dtype` values, up
    (away from zero) with probability `(|x| - lo) / (hi - lo)`, so `E[result] == x`.

    `dtype` is float16 or bfloat16 (float32: `x` unchanged, no randomness used). Done on the
    bit pattern with one uniform uint32 per element, no float arithmetic: `|x|` is
    `M * 2**k` (integer M < 2**24); the `d` low bits of M below the target's ulp are the
    residual R; the value rounds up iff `bits < R * 2**(32 - d)`. This probability is exactly
    `R / 2**d` whenever d <= 32: always for bfloat16 (d = 16, subnormals included); for
    float16 for every |x| >= 2**-33 (normal range d = 13, subnormal range d <= 23). Below
    2**-33 (which rounds to 0 or to 2**-24 with probability < 2**-9) the probability is
    truncated to a multiple of 2**-32.

    Exactly representable values (zeros of either sign, subnormals, max finite) are returned
    unchanged; the sign is kept (negatives round symmetrically); NaN stays NaN, ±inf stays
    ±inf. Overflow follows IEEE: beyond max finite the upper neighbour is ±inf, taken as
    2**(emax + 1); so float16 65504 < |x| < 65536 becomes 65504 or inf with proportional
    probability, and |x| >= 65536 becomes inf (bfloat16 likewise above 3.3895e38). Nothing
    saturates silently: an overflow shows up in `all_finite`.
    """
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(x)
    if dtype == jnp.dtype(F32):
        return x.astype(F32)
    if dtype not in _FORMATS:
        raise ValueError(f"stochastic_round: dtype {dtype} must be float16, bfloat16 or float32")
    return _stochastic_round(x.astype(F32), key, dtype)


@partial(jax.jit, static_argnums=2)  # one fused program (inlined when called under jit)
def _stochastic_round(x: jax.Array, key: jax.Array, dtype: jnp.dtype) -> jax.Array:
    mbits, emin = _FORMATS[dtype]
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(x, u32)
    sign, mag = bits & u32(0x80000000), bits & u32(0x7FFFFFFF)
    biased = (mag >> 23).astype(jnp.int32)  # f32 exponent field; 0 for f32 subnormals
    # |x| = M * 2**(max(biased, 1) - 150); the target's ulp there is 2**(max(e, emin) - mbits)
    drop = (23 - mbits) + jnp.maximum(0, emin + 127 - jnp.maximum(biased, 1))  # d >= 23-mbits
    full = jnp.where(biased > 0, (mag & u32(0x7FFFFF)) | u32(0x800000), mag & u32(0x7FFFFF))
    small = drop <= 23  # else |x| < smallest subnormal of dtype: neighbours 0 and that
    d_small = jnp.minimum(drop, 23).astype(u32)
    low = (u32(1) << d_small) - u32(1)
    resid = jnp.where(small, mag & low, full)  # R < 2**d
    shl = jnp.clip(32 - drop, 0, 31).astype(u32)
    shr = jnp.clip(drop - 32, 0, 31).astype(u32)
    threshold = jnp.where(drop <= 32, resid << shl, resid >> shr)
    tiny = mbits - emin  # smallest subnormal of dtype is 2**-tiny
    tiny_bits = ((127 - tiny) << 23) if tiny <= 126 else (1 << (149 - tiny))
    lo = jnp.where(small, mag & ~low, u32(0))
    hi = jnp.where(small, lo + (u32(1) << d_small), u32(tiny_bits))  # carries into exponent
    up = jax.random.bits(key, x.shape, u32) < threshold
    out = jnp.where(up, hi, lo) | sign  # an exact `dtype` value (or a value past its max)
    if dtype == jnp.dtype(jnp.bfloat16):  # bfloat16 = top half of float32: no conversion
        y = jax.lax.bitcast_convert_type((out >> 16).astype(jnp.uint16), jnp.bfloat16)
    else:  # exact; values >= 2**(emax+1) (or beyond max) become inf by IEEE conversion
        y = jax.lax.bitcast_convert_type(out, F32).astype(dtype)
    return jnp.where(jnp.isnan(x), jnp.array(jnp.nan, dtype), y)


def leaf_key(key: jax.Array, path) -> jax.Array:
    """The key of one leaf: `fold_in(key, crc32(keystr(path)))` (stable across runs, leaf
    order and tree edits elsewhere)."""
    tag = zlib.crc32(jax.tree_util.keystr(path).encode()) & 0x7FFFFFFF
    return jax.random.fold_in(key, tag)


def _round_to(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
    """float `x` -> `dtype`: stochastic rounding for 16-bit floats, a plain cast otherwise."""
    if jnp.dtype(x.dtype) == jnp.dtype(dtype):
        return x
    if is_half(dtype) and jnp.issubdtype(x.dtype, jnp.floating):
        return stochastic_round(x, key, dtype)
    return x.astype(dtype)


@jax.jit
def apply_updates(params, updates, key: jax.Array):
    """`new = p.astype(f32) + u.astype(f32)`, back in `p.dtype`: stochastically rounded
    (per-leaf key `leaf_key(key, path)`) for 16-bit params, a plain cast otherwise (so for
    float32 params it equals `optax.apply_updates`)."""

    def updated(path, p, u):
        new = p.astype(F32) + u.astype(F32)
        return _round_to(new, p.dtype, leaf_key(key, path))

    return jax.tree_util.tree_map_with_path(updated, params, updates)


@jax.jit
def cast_tree_like(new_tree, like_tree, key: jax.Array):
    """Every leaf of `new_tree` in the dtype of the matching leaf of `like_tree`: stochastic
    rounding into 16-bit floats (per-leaf keys), a plain cast otherwise (ints, float32).
    Keeps optimizer-state dtypes fixed across steps (jit/scan carries)."""

    def cast(path, new, like):
        return _round_to(jnp.asarray(new), jnp.asarray(like).dtype, leaf_key(key, path))

    return jax.tree_util.tree_map_with_path(cast, new_tree, like_tree)


def to_float32(tree):
    """Floating leaves upcast to float32; others (step counts) unchanged."""

    def upcast(x):
        x = jnp.asarray(x)
        return x.astype(F32) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(upcast, tree)


# ------------------------------------------------------------------------ loss scaling


class LossScaleState(NamedTuple):
    """`scale` f32[] (multiplies the loss), `good_steps` i32[] (consecutive finite steps
    since the last change; dynamic only, else 0), `skipped` i32[] (steps skipped so far)."""

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array


def init_loss_scale(cfg: PrecisionConfig) -> LossScaleState:
    """Scale 1.0 for `loss_scale=none`, `loss_scale_init` for static and dynamic."""
    scale = 1.0 if cfg.loss_scale == "none" else cfg.loss_scale_init
    return LossScaleState(
        jnp.asarray(scale, F32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    )


def sum_squares(tree) -> jax.Array:
    """f32[]: the sum of squares of every element of every leaf, in float32."""
    return sum((jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree)), F32(0.0))


def all_finite(tree) -> jax.Array:
    """bool[]: every element of every leaf is finite (True for an empty tree)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def update_loss_scale(state: LossScaleState, finite: jax.Array, cfg: PrecisionConfig):
    """The next `LossScaleState` after a step whose gradients were `finite` (bool[]).

    Every mode: a non-finite step counts in `skipped` (the caller skips it). `dynamic`: on
    overflow the scale halves (never below 1.0: halving further would scale the loss down,
    which cannot cure an overflow) and `good_steps` resets; after `loss_scale_period`
    consecutive finite steps it doubles (at most 2**64) and `good_steps` resets. `static`
    and `none`: the scale stays constant."""
    finite = jnp.asarray(finite, bool)
    skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
    if cfg.loss_scale != "dynamic":
        return LossScaleState(state.scale, state.good_steps, skipped)
    good = jnp.where(finite, state.good_steps + 1, 0).astype(jnp.int32)
    grow = good >= cfg.loss_scale_period
    grown = jnp.where(grow, jnp.minimum(state.scale * 2.0, MAX_LOSS_SCALE), state.scale)
    scale = jnp.where(finite, grown, jnp.maximum(state.scale * 0.5, MIN_LOSS_SCALE))
    return LossScaleState(scale.astype(F32), jnp.where(grow, 0, good).astype(jnp.int32), skipped)


def unscale_grads(grads, state: LossScaleState):
    """Gradients of the scaled loss -> float32 gradients of the loss (`g / scale`, exact
    for power-of-two scales)."""
    return jax.tree.map(lambda g: g.astype(F32) / state.scale, grads)


def select_tree(pred: jax.Array, new_tree, old_tree):
    """Leafwise `where(pred, new, old)` (same dtypes): with pred False the result is
    bit-identical to `old_tree`."""
    return jax.tree.map(lambda n, o: jnp.where(pred, n, o.astype(n.dtype)), new_tree, old_tree)
