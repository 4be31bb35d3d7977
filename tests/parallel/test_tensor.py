"""The Megatron kernels of `jaxpod.parallel.tensor`, sharded over a `tensor` axis of 2 and 4.

Each kernel runs inside `jax.shard_map` with its weights split the way the model splits them
and is compared, values and gradients (`jax.grad` through the `shard_map`), with
  * the same kernel with `axis=None` (the plain single-device path the model's reference uses);
  * an independent formula: float64 numpy (`x @ w + b`, `table[tokens]`, log-softmax, and the
    hand-derived gradients), and for the cross-entropy also
    `optax.softmax_cross_entropy_with_integer_labels` on the full logits.
Errors are measured as max|got - want| / max|want| over the whole array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpod.parallel.tensor import (
    VocabSlices,
    column_dense,
    row_dense,
    vocab_cross_entropy,
    vocab_embed,
)

# Sharded vs the axis=None kernel (or optax): all fp32, only the summation order differs (the
# psum adds t partial dots; optax goes through log_softmax). Measured max 1.7e-7 vs the kernel,
# 5.4e-7 vs optax (cross-entropy gradients); 0 for the embedding.
SHARDED_TOL = 1e-6
# fp32 vs float64 numpy: fp32 rounding of dots of length <= 64 and of exp/log.
# Measured max 5.4e-7 (cross-entropy), 1.5e-7 (dense kernels).
FLOAT64_TOL = 2e-6

TENSOR_SIZES = [2, 4]
B, T, D, F, V = 3, 5, 16, 32, 64  # F, V and the 4 heads of W_qkv split evenly over 2 and 4


def tensor_mesh(t: int):
    return jax.make_mesh((t,), ("tensor",), (AxisType.Auto,), devices=jax.devices()[:t])


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check(name: str, got, want, tol: float) -> None:
    err = rel_err(got, want)
    print(f"{name}: rel err {err:.2e} (tol {tol:.0e})")
    assert np.all(np.isfinite(np.asarray(got))), name
    assert err <= tol, f"{name}: max|got - want| / max|want| = {err:.3e} > {tol:.0e}"


def check_all(name, sharded, plain, f64, plain_name="plain"):
    """Compare the sharded results (value, *grads) with the fp32 plain ones (tight) and with
    float64 (looser)."""
    for i, (s, p, r) in enumerate(zip(sharded, plain, f64, strict=True)):
        check(f"{name}[{i}] sharded vs {plain_name}", s, p, SHARDED_TOL)
        check(f"{name}[{i}] {plain_name} vs float64", p, r, FLOAT64_TOL)
        check(f"{name}[{i}] sharded vs float64", s, r, FLOAT64_TOL)


def value_and_grads(f, loss, argnums, *args):
    """`f(*args)` and the gradients of `loss(f)` at `args` (w.r.t. `argnums`), one jit: one
    program for the sharded kernel, one for the plain one (each compiled, not run op by
    op)."""
    return jax.jit(lambda *a: (f(*a), jax.grad(loss(f), argnums=argnums)(*a)))(*args)


def normal(rng: np.random.Generator, *shape, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def boundary_ids(t: int) -> np.ndarray:
    """Every shard's first and last vocabulary id: 0, V/t - 1, V/t, ..., V - 1."""
    size = V // t
    return np.array(sorted({i * size + j for i in range(t) for j in (0, size - 1)}), np.int32)


def test_boundary_ids_cover_the_brief():
    assert {0, V // 2 - 1, V // 2, V - 1} <= set(boundary_ids(2).tolist())
    assert len(boundary_ids(4)) == 8


@pytest.mark.parametrize("t", TENSOR_SIZES)
@pytest.mark.parametrize("qkv_shaped", [False, True], ids=["w2d", "w_qkv3d"])
def test_column_dense(t, qkv_shaped):
    """`x @ W[D, F_tensor] + b[F_tensor]`: no communication; the output stays split over F."""
    rng = np.random.default_rng(1)
    x = normal(rng, B, T, D)
    w_shape = (D, 3, F) if qkv_shaped else (D, F)
    w, b = normal(rng, *w_shape, scale=0.3), normal(rng, *w_shape[1:])
    cot = normal(rng, B, T, *w_shape[1:])
    split = (None,) * (len(w_shape) - 1) + ("tensor",)
    sharded = jax.shard_map(
        column_dense,
        mesh=tensor_mesh(t),
        in_specs=(P(), P(*split), P(*split[1:])),
        out_specs=P(None, None, *split[1:]),
    )
    loss = lambda f: lambda x, w, b: jnp.sum(f(x, w, b) * cot)
    args = (x, w, b)
    y_s, g_s = value_and_grads(sharded, loss, (0, 1, 2), *args)
    y_p, g_p = value_and_grads(column_dense, loss, (0, 1, 2), *args)

    x64, w64, c64 = x.astype(np.float64), w.astype(np.float64), cot.astype(np.float64)
    y_ref = np.tensordot(x64, w64, axes=1) + b
    gx = np.tensordot(c64, w64, axes=(list(range(2, c64.ndim)), list(range(1, w64.ndim))))
    gw = np.tensordot(x64, c64, axes=([0, 1], [0, 1]))
    gb = c64.sum(axis=(0, 1))
    check_all("column_dense", (y_s, *g_s), (y_p, *g_p), (y_ref, gx, gw, gb))


@pytest.mark.parametrize("t", TENSOR_SIZES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_row_dense(t, bias):
    """`x[..., F_tensor] @ W[F_tensor, D]` psum'd over the tensor axis, plus a replicated b."""
    rng = np.random.default_rng(2)
    x, w = normal(rng, B, T, F), normal(rng, F, D, scale=0.3)
    b = normal(rng, D) if bias else None
    cot = normal(rng, B, T, D)
    sharded = jax.shard_map(
        lambda x, w, b: row_dense(x, w, b, "tensor"),
        mesh=tensor_mesh(t),
        in_specs=(P(None, None, "tensor"), P("tensor", None), P()),
        out_specs=P(),
    )
    plain = lambda x, w, b: row_dense(x, w, b, None)
    loss = lambda f: lambda x, w, b: jnp.sum(f(x, w, b) * cot)
    args = (x, w, b)
    argnums = (0, 1, 2) if bias else (0, 1)
    y_s, g_s = value_and_grads(sharded, loss, argnums, *args)
    y_p, g_p = value_and_grads(plain, loss, argnums, *args)

    x64, w64, c64 = x.astype(np.float64), w.astype(np.float64), cot.astype(np.float64)
    y_ref = x64 @ w64 + (0.0 if b is None else b)
    want = [y_ref, c64 @ w64.T, np.tensordot(x64, c64, axes=([0, 1], [0, 1]))]
    if bias:
        want.append(c64.sum(axis=(0, 1)))
    check_all("row_dense", (y_s, *g_s), (y_p, *g_p), want)


def _tokens(rng: np.random.Generator, t: int, slices: int = 1, rows: int = B) -> np.ndarray:
    """[rows, T] ids: random, with every shard-boundary id (and every slice's, when each
    shard's rows are used in `slices` slices) and a repeat of id V/t."""
    ids = rng.integers(0, V, size=rows * T).astype(np.int32)
    edges = boundary_ids(t * slices)
    ids[: len(edges)] = edges
    ids[len(edges)] = V // t  # a repeated id: its table-gradient rows must accumulate
    return rng.permutation(ids).reshape(rows, T)


def vocab_table(table, slices: int, prepared: list):
    """`table` whole, or used in `slices` slices of rows, each `prepare`d on its own (shapes
    recorded in `prepared`)."""
    if slices == 1:
        return table
    return VocabSlices(table, slices, lambda rows: prepared.append(rows.shape) or rows)


@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("t", TENSOR_SIZES)
def test_vocab_embed(t, slices):
    """Vocab-parallel lookup == `table[tokens]`; its table gradient is a scatter-add. With
    `slices`, a slice of each shard's rows at a time (`VocabSlices`)."""
    rng = np.random.default_rng(3)
    tokens = _tokens(rng, t, slices, rows=2 * B)  # room for every slice's boundary ids
    table, cot = normal(rng, V, D), normal(rng, 2 * B, T, D)
    prepared = []
    sharded = jax.shard_map(
        lambda tok, tab: vocab_embed(tok, vocab_table(tab, slices, prepared), "tensor"),
        mesh=tensor_mesh(t),
        in_specs=(P(), P("tensor", None)),
        out_specs=P(),
    )
    plain = lambda tok, tab: vocab_embed(tok, vocab_table(tab, slices, prepared), None)
    loss = lambda f: lambda tok, tab: jnp.sum(f(tok, tab) * cot)
    x_s, (g_s,) = value_and_grads(sharded, loss, (1,), tokens, table)
    x_p, (g_p,) = value_and_grads(plain, loss, (1,), tokens, table)

    g_ref = np.zeros((V, D))
    np.add.at(g_ref, tokens.ravel(), cot.reshape(-1, D).astype(np.float64))
    # The lookup itself is exact: one shard holds each row, the others add zeros.
    np.testing.assert_array_equal(np.asarray(x_s), table[tokens])
    np.testing.assert_array_equal(np.asarray(x_p), table[tokens])
    check_all("vocab_embed", (x_s, g_s), (x_p, g_p), (table[tokens], g_ref))
    assert np.all(np.asarray(g_s)[np.setdiff1d(np.arange(V), tokens)] == 0)
    assert set(prepared) == ({(V // t // slices, D), (V // slices, D)} if slices > 1 else set())


@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("t", TENSOR_SIZES)
def test_vocab_cross_entropy(t, slices):
    """Vocab-parallel CE of `h @ table.T` == optax's CE on the full logits, and float64. With
    `slices`, the logits of a slice of each shard's rows at a time, softmax online."""
    rng = np.random.default_rng(4)
    n = 2 * V
    targets = _tokens(rng, t, slices, rows=2 * B).ravel()
    targets = np.concatenate([targets, rng.integers(0, V, n - targets.size)]).astype(np.int32)
    h = normal(rng, n, D, scale=3.0)  # logits spread over ~+-25: the max shift matters
    table, weights = normal(rng, V, D, scale=0.5), normal(rng, n)
    prepared = []
    sharded = jax.shard_map(
        lambda h, tab, y: vocab_cross_entropy(h, vocab_table(tab, slices, prepared), y, "tensor"),
        mesh=tensor_mesh(t),
        in_specs=(P(), P("tensor", None), P()),
        out_specs=P(),
    )
    plain = lambda h, tab, y: vocab_cross_entropy(h, vocab_table(tab, slices, prepared), y, None)
    optax_ce = lambda h, tab, y: optax.softmax_cross_entropy_with_integer_labels(h @ tab.T, y)
    loss = lambda f: lambda h, tab, y: jnp.sum(f(h, tab, y) * weights)
    l_s, g_s = value_and_grads(sharded, loss, (0, 1), h, table, targets)
    l_p, g_p = value_and_grads(plain, loss, (0, 1), h, table, targets)
    l_o, g_o = value_and_grads(optax_ce, loss, (0, 1), h, table, targets)

    h64, tab64 = h.astype(np.float64), table.astype(np.float64)
    logits = h64 @ tab64.T
    assert np.ptp(logits) > 40  # the test exercises the max-subtraction
    m = logits.max(axis=-1, keepdims=True)
    log_z = m[:, 0] + np.log(np.exp(logits - m).sum(axis=-1))
    l_ref = log_z - logits[np.arange(n), targets]
    probs = np.exp(logits - log_z[:, None])
    dlogits = (probs - np.eye(V)[targets]) * weights[:, None]
    want = (l_ref, dlogits @ tab64, dlogits.T @ h64)
    check_all("vocab_ce", (l_s, *g_s), (l_p, *g_p), want)
    check_all("vocab_ce", (l_s, *g_s), (l_o, *g_o), want, plain_name="optax")
    # Boundary targets specifically (ids that sit at the edges of a shard's range).
    at_edges = np.isin(targets, boundary_ids(t))
    assert at_edges.sum() >= len(boundary_ids(t))
    check("vocab_ce boundary targets", np.asarray(l_s)[at_edges], l_ref[at_edges], FLOAT64_TOL)
    assert set(prepared) == ({(V // t // slices, D), (V // slices, D)} if slices > 1 else set())
