"""Ring collectives from `jax.lax.ppermute`, for the inside of `shard_map`.

A ring all-reduce of `x[B]` over n devices is a reduce-scatter then an all-gather, each n-1
steps of one `ppermute` to the ring neighbour: cut `x` into n segments `x[n, B/n]`; in step s
device i adds the partial sum it receives to its own segment and passes it on, so after n-1
steps device i holds segment i summed over the ring; the all-gather then passes the finished
segments round once more. Every device sends 2(n-1)/n of `x`'s bytes, whatever n is.

- `axis` is a mesh axis or a tuple of them: the ring runs over their flattened product
  (row-major, as `lax.axis_index(axes)` numbers devices); axes of size 1 are skipped.
- `bidirectional=True`: two half-size rings in opposite directions (both links of a ring).
- `hosts=h`: two levels for a (hosts, devices-per-host) split of the ring: reduce-scatter
  among the n/h devices of each host, all-reduce each 1/(n/h) segment over the h hosts, then
  all-gather within the host. The same 2(n-1)/n bytes per device, but only 2(h-1)/n of them
  cross between hosts.
- Leaves of any shape are flattened and zero-padded to a multiple of n.
- 16-bit floats: partial sums travel in float32 (reduce-scatter), each sum is rounded once,
  and the all-gather moves the rounded 16-bit values.

JAX types a `ppermute` result as varying over the ring's axes (it cannot know every copy is
equal), so `ring_all_reduce` ends with `invariant`, a free cast that drops the axes from the
value's type: the result can leave `shard_map` replicated, like a `psum`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from jaxpod.parallel.manual import varying_axes

AxisName = str | tuple[str, ...]
F32 = jnp.float32


# -------------------------------------------------------------------------- the type cast
def invariant(x: jax.Array, axis: AxisName) -> jax.Array:
    """`x`, typed invariant over `axis`: the caller promises it is equal on every device of
    the axes (no check, no data moves). Its transpose spreads the cotangent evenly."""
    axes = tuple(a for a in _names(axis) if a in varying_axes(x))
    if not axes:
        return x
    return invariant_p.bind(x, axes=axes, size=math.prod(jax.lax.axis_size(a) for a in axes))


def _invariant_abstract_eval(aval, *, axes, size):
    mat = aval.manual_axis_type
    return aval.update(manual_axis_type=mat.update(varying=mat.varying - frozenset(axes)))


def _invariant_transpose(ct, x, *, axes, size):
    ct = jax.lax.pcast(ct, tuple(a for a in axes if a not in varying_axes(ct)), to="varying")
    return [ct / jnp.asarray(size, ct.dtype)]  # the cast is the mean of n equal copies


invariant_p = Primitive("ring_invariant")
invariant_p.def_abstract_eval(_invariant_abstract_eval)
mlir.register_lowering(invariant_p, lambda ctx, x, **_: [x])
ad.deflinear2(invariant_p, _invariant_transpose)


# ------------------------------------------------------------------------------- rings
@dataclass(frozen=True)
class Ring:
    """A ring over the devices of `axes` (numbered k row-major, in the mesh's axis order): the
    devices `stride` apart in k, `size` of them; each sends to the next (`direction=1`) or previous
    (`-1`) one. `Ring(axes, n)` is every device; with `stride > 1` or `size < n` there are
    n / size disjoint rings, one per group, all stepping at once."""

    axes: tuple[str, ...]
    size: int
    stride: int = 1
    direction: int = 1

    def position(self) -> jax.Array:
        """This device's place on its ring, 0..size-1."""
        return (jax.lax.axis_index(_mesh_order(self.axes)) // self.stride) % self.size

    def perm(self) -> list[tuple[int, int]]:
        """(source, destination) pairs of one step, for every device of the axes."""
        n = math.prod(jax.lax.axis_size(a) for a in self.axes)
        step = lambda k, p: k + ((p + self.direction) % self.size - p) * self.stride
        return [(k, step(k, (k // self.stride) % self.size)) for k in range(n)]

    def shift(self, x: jax.Array) -> jax.Array:
        """One step: send `x` to the neighbour, receive the other neighbour's."""
        return jax.lax.ppermute(x, _mesh_order(self.axes), self.perm())


def ring_reduce_scatter(segments: jax.Array, ring: Ring) -> jax.Array:
    """`segments[size, c]` -> this device's segment `[c]`, summed over the ring, in size-1
    steps.

    In step s device i receives the partial sum of segment i - d(s+2) from device i - d, adds
    its own and passes it on in step s+1; segment j starts at device j + d and ends at j."""
    i, d, n = ring.position(), ring.direction, ring.size
    own = lambda j: jax.lax.dynamic_index_in_dim(segments, j % n, keepdims=False)
    acc = own(i - d)
    for s in range(n - 1):
        acc = ring.shift(acc) + own(i - d * (s + 2))
    return acc


def ring_all_gather(segment: jax.Array, ring: Ring) -> jax.Array:
    """This device's `segment[c]` -> every device's `[size, c]` (row j from position j), in
    size-1 steps: in step s each device passes on the segment it received in step s-1."""
    i, d, n = ring.position(), ring.direction, ring.size
    out = jnp.zeros((n, *segment.shape), segment.dtype)
    out = jax.lax.dynamic_update_index_in_dim(out, segment, i, 0)
    for s in range(n - 1):
        segment = ring.shift(segment)
        out = jax.lax.dynamic_update_index_in_dim(out, segment, (i - d * (s + 1)) % n, 0)
    return out


def _ring_all_reduce(flat: jax.Array, ring: Ring, dtype) -> jax.Array:
    """`flat[size * c]` (in the summation dtype) -> the sum over the ring, rounded to `dtype`."""
    segment = ring_reduce_scatter(flat.reshape(ring.size, -1), ring).astype(dtype)
    return ring_all_gather(segment, ring).reshape(-1)


def _hierarchical(flat: jax.Array, axes, n: int, hosts: int, dtype) -> jax.Array:
    """Reduce-scatter within each host, all-reduce each segment across the hosts, all-gather
    within the host. Device k is local device k % (n/hosts) of host k // (n/hosts)."""
    local = n // hosts
    inside, across = Ring(axes, local), Ring(axes, hosts, stride=local)
    part = ring_reduce_scatter(flat.reshape(local, -1), inside)  # [hosts * c]
    summed = _ring_all_reduce(part, across, dtype)
    return ring_all_gather(summed, inside).reshape(-1)


# ---------------------------------------------------------------------------- all-reduce
def ring_all_reduce(
    x: jax.Array, axis: AxisName, *, bidirectional: bool = False, hosts: int = 1
) -> jax.Array:
    """`psum(x, axis)` as a ring (see the module docstring), typed invariant over `axis`."""
    axes = _mesh_order(a for a in _names(axis) if jax.lax.axis_size(a) > 1)
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    if n == 1:
        return invariant(x, axis)
    if hosts < 1 or n % hosts:
        raise ValueError(f"hosts={hosts} does not divide the ring's {n} devices")
    if hosts > 1 and bidirectional:
        raise ValueError("choose one of bidirectional=True and hosts > 1")
    dtype = x.dtype
    wide = F32 if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype
    rings = 2 if bidirectional else 1
    pieces = n * rings
    flat = x.reshape(-1).astype(wide)
    flat = jnp.pad(flat, (0, -flat.size % pieces))
    if bidirectional:
        halves = flat.reshape(2, -1)
        out = jnp.concatenate(
            [
                _ring_all_reduce(h, Ring(axes, n, direction=d), dtype)
                for h, d in zip(halves, (1, -1), strict=True)
            ]
        )
    elif hosts > 1:
        out = _hierarchical(flat, axes, n, hosts, dtype)
    else:
        out = _ring_all_reduce(flat, Ring(axes, n), dtype)
    return invariant(out[: x.size].reshape(x.shape), axis)


def _names(axis: AxisName) -> tuple[str, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


def _mesh_order(axes) -> tuple[str, ...]:
    """`axes` in the mesh's order: `ppermute` numbers devices over a tuple of axes in that
    order whatever the tuple's, `axis_index` in the tuple's."""
    names = jax.sharding.get_abstract_mesh().axis_names
    return tuple(sorted(axes, key=names.index))
