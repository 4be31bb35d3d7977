"""The ring collectives of `jaxpod.parallel.collectives` against `psum`, and bucketed gradients.

The cases (`CASES`, each run on every device of the ring): every variant (one ring, two
opposite rings, two levels for every hosts split) at every axis size 2-8 in float32, and at 12
and 16 in a subprocess with 16 devices; every variant in bfloat16 and float16 at sizes 5 and 8;
every shape (sizes 1, 5, 24, 42: mostly not multiples of n, so padded) in every dtype at size 7.
Each input mixes integer values (|x| <= 8: every partial sum is exact in every dtype) with
normal ones, and is checked:

* integer-valued entries: equal to `psum` bit for bit;
* normal entries, float32: two float32 sums of the same n terms in different orders differ by
  at most 2 (n-1) u sum|x_k| (u = 2^-24, the recursive-summation bound of each);
* normal entries, 16-bit: the ring sums in float32 and rounds once, so it is within
  (n-1) u sum|x_k| + half an ulp (16-bit) of the exact float64 sum, and within
  2 (n-1) u sum|x_k| + one ulp of `psum` of the float32-cast inputs rounded to 16 bits.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.parallel.collectives import (
    Ring,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from jaxpod.parallel.replica import group_into_buckets, reduce_grads

SHAPES = [(), (5,), (4, 6), (3, 7, 2)]
DTYPES = ["float32", "bfloat16", "float16"]
U32 = 2.0**-24  # float32 unit roundoff


def variants(n: int) -> dict[str, dict]:
    """Keyword arguments of `ring_all_reduce`: one ring, two rings, each two-level split."""
    out = {"ring": {}, "bidirectional": {"bidirectional": True}}
    return out | {f"hosts={h}": {"hosts": h} for h in range(2, n) if n % h == 0}


def cases(n: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(variant, dtype, shape) checked at axis size n (see the module docstring)."""
    out = [(v, "float32", SHAPES[n % len(SHAPES)]) for v in variants(n)]
    if n in (5, 8):
        out += [(v, d, (3, 7, 2)) for v in variants(n) for d in DTYPES[1:]]
    if n == 7:
        out += [("ring", d, s) for d in DTYPES for s in SHAPES if (d, s) != ("float32", ())]
    return out


def case_input(n: int, dtype: str, shape, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`[n, *shape]` (row k is device k's input) and the mask of its integer-valued entries."""
    rng = np.random.default_rng([seed, n])
    ints = np.arange(int(np.prod(shape))).reshape(shape) % 2 == 0  # the scalar: an integer
    x = np.where(ints, rng.integers(-8, 9, (n, *shape)), rng.normal(size=(n, *shape)))
    return np.asarray(jnp.asarray(x, dtype)), ints


def run_all_reduces(n: int, todo, inputs):
    """Per case, every device's ring result `[n, ...]`, `psum` of its input and of the input
    cast to float32: one jit for the whole axis size."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    kinds = variants(n)

    def local(xs):
        xs = [x[0] for x in xs]
        pairs = zip(xs, todo, strict=True)
        rings = [ring_all_reduce(x, "x", **kinds[v])[None] for x, (v, _, _) in pairs]
        psums = [jax.lax.psum(x, "x") for x in xs]
        return rings, psums, [jax.lax.psum(x.astype(jnp.float32), "x") for x in xs]

    fn = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P(), P()))
    return jax.device_get(jax.jit(fn)(jax.device_put(inputs, NamedSharding(mesh, P("x")))))


def ulp(values: np.ndarray, dtype) -> np.ndarray:
    """The spacing of `dtype` numbers at |values| (float64; the smallest normal's below it)."""
    info = jnp.finfo(dtype)
    mag = np.maximum(np.abs(values.astype(np.float64)), float(info.tiny))
    return float(info.eps) * 2.0 ** np.floor(np.log2(mag))


def check_size(n: int) -> dict[str, float]:
    """Every case of axis size n; returns the worst |error| / allowed per kind of check."""
    todo = cases(n)
    made = [case_input(n, d, s, seed) for seed, (_, d, s) in enumerate(todo)]
    inputs, masks = [x for x, _ in made], [m for _, m in made]
    rings, psums, wide = run_all_reduces(n, todo, inputs)
    worst: dict[str, float] = {}

    def within(kind: str, err, allowed, where: str) -> None:
        ratio = float(np.max(err / allowed, initial=0.0))
        worst[kind] = max(worst.get(kind, 0.0), ratio)
        assert ratio <= 1, f"{where}: {kind} |error| / allowed = {ratio:.2f}"

    for (variant, dtype, shape), x, ints, ring, psum, f32 in zip(
        todo, inputs, masks, rings, psums, wide, strict=True
    ):
        where = f"n={n} {variant} {dtype} {shape}"
        got = ring.astype(np.float64)  # [n, ...]: every device's copy
        assert ring.dtype == x.dtype and got.shape == (n, *shape), where
        assert np.all(got == got[:1]), f"{where}: devices disagree"
        got, want, normal = got[0], psum.astype(np.float64), ~ints
        np.testing.assert_array_equal(got[ints], want[ints], err_msg=where)
        xs = x.astype(np.float64)
        bound = (n - 1) * U32 * np.abs(xs).sum(0)[normal]
        got = got[normal]
        if dtype == "float32":
            within("float32 vs psum", np.abs(got - want[normal]), 2 * bound, where)
            continue
        exact = xs.sum(0)[normal]
        within("16-bit vs exact", np.abs(got - exact), bound + ulp(got, x.dtype) / 2, where)
        rounded = f32.astype(x.dtype).astype(np.float64)[normal]
        allowed = 2 * bound + ulp(rounded, x.dtype)
        within("16-bit vs psum(f32)", np.abs(got - rounded), allowed, where)
    return worst


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_ring_variants_match_psum(n):
    print(f"n={n}: worst |error| / allowed {check_size(n)}")


def test_ring_variants_match_psum_on_16_devices():
    """Axis sizes 12 and 16 (every hosts split), in a process with 16 virtual devices."""
    code = (
        "from jaxpod.platform import use_virtual_cpu_devices\n"
        "use_virtual_cpu_devices(16)\n"
        "import test_collectives as t\n"
        "for n in (12, 16):\n"
        "    print(n, t.check_size(n))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    print(proc.stdout.decode())


def test_several_axes_and_their_order():
    """A ring over two mesh axes runs over their product, in either order; over one of them it
    is one ring per row (as `psum` over that axis); hosts split the flattened product."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = np.random.default_rng(1).integers(-8, 9, (8, 3, 5)).astype(np.float32)
    cases = {
        "ab": (("a", "b"), {}),
        "ba": (("b", "a"), {}),
        "b": ("b", {}),
        "a": ("a", {}),
        "ab bidirectional": (("a", "b"), {"bidirectional": True}),
        "ab hosts=2": (("a", "b"), {"hosts": 2}),
        "ba hosts=4": (("b", "a"), {"hosts": 4}),
        "b hosts=2": ("b", {"hosts": 2}),
    }

    def local(v):
        v = v[0]
        rings = {k: ring_all_reduce(v, ax, **kw)[None] for k, (ax, kw) in cases.items()}
        return rings, {k: jax.lax.psum(v, ax)[None] for k, (ax, _) in cases.items()}

    spec = P(("a", "b"))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))
    rings, psums = fn(jax.device_put(x, NamedSharding(mesh, spec)))
    for k in cases:
        np.testing.assert_array_equal(np.asarray(rings[k]), np.asarray(psums[k]), err_msg=k)


@pytest.mark.parametrize("direction", [1, -1])
def test_reduce_scatter_and_all_gather_alone(direction):
    """The two halves: device i ends the reduce-scatter with segment i summed over the ring
    (`psum_scatter`), and the all-gather gives every device every segment (`all_gather`)."""
    n, c = 4, 3
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    x = np.random.default_rng(2).integers(-8, 9, (n, n, c)).astype(np.float32)
    ring = Ring(("x",), n, direction=direction)

    def local(v):
        segment = ring_reduce_scatter(v[0], ring)
        want = jax.lax.psum_scatter(v[0], "x", scatter_dimension=0, tiled=True)
        gathered = ring_all_gather(segment, ring)
        return segment[None], want, gathered[None], jax.lax.all_gather(segment, "x")[None]

    specs = (P("x"), P("x"), P("x"), P("x"))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=specs))
    segment, want, gathered, want_gathered = fn(jax.device_put(x, NamedSharding(mesh, P("x"))))
    np.testing.assert_array_equal(np.asarray(segment).reshape(n * c), np.asarray(want).ravel())
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(want_gathered))
    np.testing.assert_array_equal(np.asarray(gathered)[0], x.sum(0))


def test_gradient_through_the_ring_is_psums():
    """`invariant` transposes to an even split, so the ring's gradient is `psum`'s (the sum of
    every device's cotangent)."""
    n = 4
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    x = jax.device_put(
        np.random.default_rng(3).normal(size=(n, 6)).astype(np.float32),
        NamedSharding(mesh, P("x")),
    )

    def loss(reduce):
        local = lambda v: jnp.sum(jnp.sin(reduce(v[0])) * jnp.arange(6.0))
        return lambda v: jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P())(v)

    ring = jax.jit(jax.grad(loss(lambda v: ring_all_reduce(v, "x"))))(x)
    psum = jax.jit(jax.grad(loss(lambda v: jax.lax.psum(v, "x"))))(x)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(psum), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ bucketed reduce_grads


def test_group_into_buckets():
    keys = ["a", "a", None, "b", "a", "a", "b"]
    sizes = [40, 40, 99, 10, 30, 100, 10]
    assert group_into_buckets(sizes, keys, 0) == [[0], [1], [3], [4], [5], [6]]
    assert group_into_buckets(sizes, keys, 100) == [[0, 1], [3, 6], [4], [5]]
    assert group_into_buckets(sizes, keys, 110) == [[0, 1, 4], [3, 6], [5]]
    assert group_into_buckets(sizes, keys, 10**6) == [[0, 1, 4, 5], [3, 6]]


# The engine's data axes with replicated tensor sharding: (replica, rts_outer, rts_inner,
# pipeline); leaves that are split over some of them are not reduced over those.
RTS_AXES = ("replica", "rts_outer", "rts_inner", "pipeline")
GRAD_SPECS = {
    "embed": P(None, "tensor"),  # reduced over all four data axes
    "layer_w": P("pipeline", None, "tensor"),  # over replica and the RTS axes
    "layer_b": P("pipeline", None),
    "rts_w": P("pipeline", ("rts_outer", "rts_inner"), None),  # over replica only
    "norm": P(None),
    "small": P(None, None),
}
# read off GRAD_SPECS: the data axes each leaf's spec does not name
REDUCED_OVER = {
    "embed": RTS_AXES,
    "layer_w": ("replica", "rts_outer", "rts_inner"),
    "layer_b": ("replica", "rts_outer", "rts_inner"),
    "rts_w": ("replica",),
    "norm": RTS_AXES,
    "small": RTS_AXES,
}
GRAD_SHAPES = {
    "embed": (6, 4),
    "layer_w": (2, 5, 4),
    "layer_b": (2, 3),
    "rts_w": (2, 8, 3),
    "norm": (7,),
    "small": (1, 1),
}


TENSOR_LEAVES = ("embed", "layer_w")  # varying over tensor too: never in a bucket with the rest


# (allreduce, bucket_bytes) away from the default (psum, 0)
REDUCE_OPTIONS = [("ring", 0), ("psum", 64), ("ring", 64), ("ring", 10**6), ("psum", 10**6)]


@functools.cache
def reduced_grads(mesh_shape):
    """(inputs, the default `reduce_grads`, {option: its result}) on `mesh_shape`: the default
    and every option of `REDUCE_OPTIONS` in one jit of the mesh (each option's cases read
    their own result)."""
    mesh = jax.make_mesh(mesh_shape, (*RTS_AXES, "tensor"))
    data, t = int(np.prod(mesh_shape[:4])), mesh_shape[4]
    specs = {k: P(RTS_AXES, "tensor" if k in TENSOR_LEAVES else None) for k in GRAD_SHAPES}

    def global_shape(k):
        s = GRAD_SHAPES[k]
        return (data, s[0] * t, *s[1:]) if k in TENSOR_LEAVES else (data, *s)

    def local(grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        default = reduce_grads(grads, GRAD_SPECS, RTS_AXES)
        options = [
            reduce_grads(grads, GRAD_SPECS, RTS_AXES, allreduce=a, bucket_bytes=b)
            for a, b in REDUCE_OPTIONS
        ]
        return jax.tree.map(lambda a: a[None], (default, options))

    rng = np.random.default_rng(4)
    grads = {k: rng.integers(-8, 9, global_shape(k)).astype(np.float32) for k in GRAD_SHAPES}
    out_specs = (specs, [specs] * len(REDUCE_OPTIONS))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs))
    shardings = {k: NamedSharding(mesh, specs[k]) for k in specs}
    default, options = jax.device_get(fn(jax.device_put(grads, shardings)))
    return grads, default, dict(zip(REDUCE_OPTIONS, options, strict=True))


@pytest.mark.parametrize("mesh_shape", [(2, 1, 2, 2, 1), (2, 2, 1, 1, 2)], ids=str)
@pytest.mark.parametrize("allreduce, bucket_bytes", REDUCE_OPTIONS)
def test_bucketed_reduce_grads_equal_psum_per_leaf(mesh_shape, allreduce, bucket_bytes):
    """On meshes of the RTS data axes and tensor, the default `reduce_grads` (a psum per
    leaf) sums each leaf over the data axes its spec does not name (numpy's sum of the
    integer-valued inputs), and every option returns the default's gradients bit for bit,
    with the same varying axes (the out_specs leave tensor off the leaves that do not vary
    over it). One program a mesh computes the default and every option (`reduced_grads`)."""
    grads, default, options = reduced_grads(mesh_shape)
    option = options[(allreduce, bucket_bytes)]
    for k in GRAD_SHAPES:
        g = grads[k].reshape(*mesh_shape[:4], *grads[k].shape[1:])
        summed = g.sum(tuple(RTS_AXES.index(a) for a in REDUCED_OVER[k]), keepdims=True)
        want = np.broadcast_to(summed, g.shape).reshape(grads[k].shape)
        np.testing.assert_array_equal(np.asarray(default[k]), want, err_msg=k)
        np.testing.assert_array_equal(np.asarray(option[k]), np.asarray(default[k]), err_msg=k)
