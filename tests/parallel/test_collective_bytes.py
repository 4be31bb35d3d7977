"""Bytes on the wire, read from the program: a ring all-reduce sends 2(n-1)/n of the bytes.

Each `collective-permute` in the program sends its operand from every device of the ring to
its neighbour, so the bytes a device sends are the sum of the operands' sizes. Counted in the
compiled HLO of `ring_all_reduce` alone (one ring, two rings, two levels, padded, 16-bit) and
in the lowered `loss_and_grads` of the engine with `parallel.grad_allreduce=ring`; against
what `psum` lowers to: one `all-reduce` per reduced array, carrying all of it, whose algorithm
(and so its bytes on the wire) is the runtime's choice.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.inspect.compile import compile_to_inspect
from jaxpod.parallel.collectives import ring_all_reduce
from jaxpod.parallel.replica import group_into_buckets, reduction_axes

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}
# compiled HLO: `%name = f32[125]{0} collective-permute(%x), ..., source_target_pairs={{0,1},...}`
HLO_PERMUTE = re.compile(
    r"= (\w+)\[([\d,]*)\][^ ]* collective-permute\(.*?source_target_pairs=\{(\{[\d,{}]*\})\}"
)
HLO_ALL_REDUCE = re.compile(r"= (\(?[\w\[\]{}, ]*?\)?) all-reduce\(")  # one array or a tuple
HLO_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
# lowered StableHLO: `"stablehlo.collective_permute"(%x) <{...}> : (tensor<125xf32>) -> ...`
MLIR_PERMUTE = re.compile(r'"stablehlo\.collective_permute"\(.*?: \(tensor<([^>]*)>\)')
MLIR_ALL_REDUCE = re.compile(
    r'"stablehlo\.all_reduce"\(.*?replica_groups = dense<(\[\[[\d, \[\]]*\]\])>.*?\}\) : '
    r"\(tensor<([^>]*)>\)",
    re.S,
)


def hlo_bytes(dtype: str, dims: str) -> int:
    return BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)


def mlir_bytes(tensor: str) -> int:
    """`125x4xf32` -> 2000."""
    *dims, dtype = tensor.split("x")
    return BYTES[dtype] * math.prod(int(d) for d in dims)


def compiled(fn, n: int, shape, dtype=jnp.float32) -> str:
    """The compiled HLO of `fn(x)` on each device of a ring of n, `x[shape]` per device."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    arg = jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P("x")))
    local = lambda v: fn(v[0])
    mapped = jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P())
    return compile_to_inspect(jax.jit(mapped).lower(arg)).as_text()


def permutes(text: str) -> list[tuple[int, list[tuple[int, int]]]]:
    """(operand bytes, source-target pairs) of every collective-permute in compiled HLO."""
    out = []
    for dtype, dims, pairs in HLO_PERMUTE.findall(text):
        pairs = [tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)\}", pairs)]
        out.append((hlo_bytes(dtype, dims), pairs))
    return out


CASES = [  # (n, keyword arguments): every device sends 2(n-1)/n of the bytes
    (2, {}),
    (4, {}),
    (8, {}),
    (8, {"bidirectional": True}),
    (8, {"hosts": 2}),
    (8, {"hosts": 4}),
    (6, {"hosts": 3}),
]


@pytest.mark.parametrize("n, kw", CASES, ids=lambda c: str(c))
def test_ring_sends_2_n_minus_1_over_n(n, kw):
    size = 48 * n  # float32 elements per device: a multiple of 2n, no padding
    ops = permutes(compiled(lambda v: ring_all_reduce(v, "x", **kw), n, (size,)))
    rings = 2 if kw.get("bidirectional") else 1
    sent = sum(b for b, _ in ops)
    print(f"n={n} {kw}: {len(ops)} collective-permutes, {sent} of {4 * size} bytes sent")
    assert sent == 2 * (n - 1) * 4 * size // n
    for _, pairs in ops:  # every device sends once per step
        assert sorted(s for s, _ in pairs) == list(range(n))
    if "hosts" not in kw:
        assert len(ops) == 2 * (n - 1) * rings
        return
    hosts = kw["hosts"]
    local = n // hosts
    crossing = sum(b for b, pairs in ops if any(s // local != d // local for s, d in pairs))
    assert all(  # a step is either all inside the hosts or all between them
        len({s // local == d // local for s, d in pairs}) == 1 for _, pairs in ops
    )
    assert crossing == 2 * (hosts - 1) * 4 * size // n  # only the 1/local chunk crosses
    assert len(ops) == 2 * (local - 1) + 2 * (hosts - 1)


def lowered(fn, n: int, shape, dtype=jnp.float32) -> str:
    """The lowered StableHLO of `fn` as in `compiled` (what the program asks for)."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    arg = jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P("x")))
    mapped = jax.shard_map(lambda v: fn(v[0]), mesh=mesh, in_specs=P("x"), out_specs=P())
    return jax.jit(mapped).lower(arg).as_text()


def test_padding_and_16_bit():
    """A leaf of m elements sends 2(n-1) chunks of ceil(m/n); a 16-bit one sends its partial
    sums in float32 (reduce-scatter) and the rounded sums in 16 bits (all-gather). XLA's CPU
    compiler has no bfloat16 arithmetic and widens the bfloat16 permutes to float32 (float16
    ones stay 16-bit): on CPU a bfloat16 ring sends float32 bytes throughout."""
    n, m = 8, 1001
    chunk = -(-m // n)
    ring = lambda v: ring_all_reduce(v, "x")
    ops = permutes(compiled(ring, n, (m,)))
    assert [b for b, _ in ops] == [4 * chunk] * (2 * (n - 1))
    mixed = [4 * chunk] * (n - 1) + [2 * chunk] * (n - 1)
    for dtype in (jnp.bfloat16, jnp.float16):
        asked = [mlir_bytes(t) for t in MLIR_PERMUTE.findall(lowered(ring, n, (m,), dtype))]
        assert asked == mixed, dtype
    assert [b for b, _ in permutes(compiled(ring, n, (m,), jnp.float16))] == mixed
    widened = [b for b, _ in permutes(compiled(ring, n, (m,), jnp.bfloat16))]
    assert widened == [4 * chunk] * (2 * (n - 1)), "XLA CPU now keeps bfloat16 permutes"


def all_reduces(text: str) -> list[list[int]]:
    """The operand bytes of each all-reduce in compiled HLO (a tuple all-reduce: several)."""
    return [[hlo_bytes(*a) for a in HLO_ARRAY.findall(t)] for t in HLO_ALL_REDUCE.findall(text)]


def test_what_psum_lowers_to():
    """`psum` is one all-reduce of the whole array and no collective-permute: the runtime
    picks the algorithm. XLA's all-reduce combiner fuses independent psums into one tuple
    all-reduce by itself: three psums of leaves compile to one collective."""
    n, size = 8, 384
    text = compiled(lambda v: jax.lax.psum(v, "x"), n, (size,))
    assert "collective-permute" not in text
    assert all_reduces(text) == [[4 * size]]
    three = compiled(lambda v: [jax.lax.psum(v[i], "x") for i in range(3)], n, (3, size))
    print(f"3 psums of {4 * size} bytes compile to all-reduces of {all_reduces(three)} bytes")
    assert all_reduces(three) == [[4 * size] * 3]


def lowered_step(tiny_cfg, mesh_for, *extra):
    """(lowered StableHLO of `engine.loss_and_grads` on 8x1x1, specs, data axes)."""
    from jaxpod.engine import abstract_engine

    cfg = tiny_cfg("train.micro_batch=2", "train.grad_accum=1", *extra, mesh=(8, 1, 1))
    engine, state = abstract_engine(cfg, mesh_for(cfg))
    rows = (cfg.global_batch, cfg.model.seq_len + 1)
    tokens = jax.ShapeDtypeStruct(rows, jnp.int32, sharding=engine.batch_sharding[0])
    text = jax.jit(engine.loss_and_grads).lower(state.params, (tokens,)).as_text()
    return text, state.params, engine.stages.stored_specs, engine.stages.data_axes


def test_the_engine_step_sends_2_n_minus_1_over_n(tiny_cfg, mesh_for):
    """On 8 replicas every device holds (and reduces) all the gradients, B bytes: the ring
    step's collective-permutes send 2(n-1)/n B (every tiny leaf is a multiple of 8
    elements: no padding), 2(n-1) per bucket; the default step has one all-reduce of every
    leaf over the 8 devices (and one of the loss)."""
    n, bucket = 8, 65536
    ring, params, specs, data_axes = lowered_step(
        tiny_cfg, mesh_for, "parallel.grad_allreduce=ring", f"parallel.grad_bucket_bytes={bucket}"
    )
    leaves = jax.tree.leaves(params)
    specs = jax.tree.structure(params).flatten_up_to(specs)
    grad_bytes = sum(p.size * p.dtype.itemsize for p in leaves)
    keys = [(reduction_axes(s, data_axes), frozenset(jax.tree.leaves(tuple(s)))) for s in specs]
    buckets = group_into_buckets([p.size * p.dtype.itemsize for p in leaves], keys, bucket)
    sent = [mlir_bytes(t) for t in MLIR_PERMUTE.findall(ring)]
    print(f"{len(leaves)} leaves, {grad_bytes} bytes, {len(buckets)} buckets: {sum(sent)} sent")
    assert len(sent) == 2 * (n - 1) * len(buckets)
    assert sum(sent) == 2 * (n - 1) * grad_bytes // n

    default, *_ = lowered_step(tiny_cfg, mesh_for)
    assert "collective_permute" not in default
    everyone = str([list(range(n))]).replace(" ", "")
    reduced = [
        mlir_bytes(t)
        for groups, t in MLIR_ALL_REDUCE.findall(default)
        if groups.replace(" ", "") == everyone
    ]
    assert sorted(reduced) == sorted([4] + [p.size * p.dtype.itemsize for p in leaves])
