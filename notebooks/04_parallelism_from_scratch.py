# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Parallelism from scratch: the ring all-reduce, a tensor-parallel MLP, a pipeline
#
# The three ways a pod splits a training step, each written here in a few lines of
# `jax.shard_map` with one explicit collective, and each checked against the same computation
# on one device:
#
# 1. **Data parallelism.** Every device holds the whole model and a slice of the batch; the
#    gradients are summed across devices with an **all-reduce**. We build the all-reduce
#    itself, as a **ring** of `ppermute`s, draw which segment moves where at each step, and
#    count its bytes in the compiled program: every device sends 2(n−1)/n of the gradient,
#    whatever n is.
# 2. **Tensor (model) parallelism.** One MLP's weights are split across devices: the first
#    matrix by columns, the second by rows, so one `psum` per MLP combines the partial outputs.
# 3. **Pipeline parallelism.** The layers are split into stages; micro-batches flow from
#    stage to stage with `ppermute`, and the stages idle while the pipe fills and drains.
#
# XLA pretends the CPU is 8 devices; the flag must be set **before** jax is imported.

# %%
import os

import jaxpod  # imports no jax until an entry point needs it (docs/api.md)

jaxpod.use_virtual_cpu_devices(8)  # before importing jax: 8 devices, jaxpod's XLA flags
os.environ["JAX_PLATFORMS"] = "cpu"

import re
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.parallel.collectives import ring_all_reduce

# %matplotlib inline
T0 = time.perf_counter()
print("jax", jax.__version__, "sees", len(jax.devices()), "devices")


def mesh_of(n: int, name: str):
    """A 1-D mesh of the first n devices, its axis called `name`."""
    return jax.make_mesh((n,), (name,), devices=jax.devices()[:n])


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


# %% [markdown]
# ## 1. The ring all-reduce
#
# Device *i* of *n* holds `x_i` (B numbers) and wants `x_0 + … + x_{n−1}`. Cut each `x_i` into
# n segments. **Reduce-scatter**, n−1 steps: in each step every device sends one segment's
# running sum to its right-hand neighbour and adds its own copy of the segment it receives;
# after n−1 steps device *i* holds segment *i* summed over all devices. **All-gather**, n−1
# more steps: the finished segments go round the ring once. Each step every device sends B/n
# numbers, so 2(n−1)·B/n in all: no device is a hot spot, and the cost per device barely grows
# with n.
#
# Here it is from `ppermute` alone (`jaxpod.parallel.collectives` is the same algorithm with
# padding, several mesh axes, 16-bit inputs, two directions and two levels). It also returns
# what it sent at every step, for the picture below.

# %%
def my_ring_all_reduce(x, axis):
    """Inside shard_map: (sum of x over `axis`, what each step sent)."""
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    segments = x.reshape(n, -1)
    segment = lambda j: jax.lax.dynamic_index_in_dim(segments, j % n, keepdims=False)
    to_right = [(k, (k + 1) % n) for k in range(n)]
    sent, acc = [], segment(i - 1)
    for s in range(n - 1):  # reduce-scatter: receive a running sum, add my copy, pass it on
        sent.append(acc)
        acc = jax.lax.ppermute(acc, axis, to_right) + segment(i - s - 2)
    out = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(segments), acc, i, 0)
    for s in range(n - 1):  # all-gather: pass the finished segments round once
        sent.append(acc)
        acc = jax.lax.ppermute(acc, axis, to_right)
        out = jax.lax.dynamic_update_index_in_dim(out, acc, (i - s - 1) % n, 0)
    return out.reshape(x.shape), jnp.stack(sent)


n = 8
mesh = mesh_of(n, "data")
x = np.random.default_rng(0).normal(size=(n, 64)).astype(np.float32)  # row i: device i's x_i


def both(v):
    ring, _ = my_ring_all_reduce(v[0], "data")
    return ring[None], jax.lax.psum(v[0], "data")[None]


ring, psum = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
    put(x, mesh, P("data"))
)
ring, psum = np.asarray(ring), np.asarray(psum)
assert np.all(ring == ring[:1]), "every device ends with the same sum"
np.testing.assert_allclose(ring[0], x.sum(0), rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(ring, psum, rtol=1e-5, atol=1e-5)
print("ring == psum == numpy sum on all", n, "devices; max |ring - psum| =", abs(ring - psum).max())

# %% [markdown]
# ### Which segment moves where
#
# Give device *k* the number 2^k in every element of every segment, plus the segment's index
# in a second column: a running sum then spells out *which devices* it contains (its bits) and
# *which segment* it is. Each cell is one device at one step: the segment it sends to the
# right and whose contributions that message carries, read from what `ppermute` actually
# moved.

# %%
n = 4
mesh4 = mesh_of(n, "data")
tags = np.zeros((n, n, 2), np.float32)  # [device, segment, (2^device, segment index)]
tags[:, :, 0] = 2.0 ** np.arange(n)[:, None]
tags[:, :, 1] = np.arange(n)[None, :]


def traced(v):
    _, sent = my_ring_all_reduce(v[0], "data")
    return sent[None]


sent = np.asarray(
    jax.jit(jax.shard_map(traced, mesh=mesh4, in_specs=P("data"), out_specs=P("data")))(
        put(tags.reshape(n, -1), mesh4, P("data"))
    )
).reshape(n, 2 * (n - 1), 2)  # [device, step, (bits, count * segment)]

fig, ax = plt.subplots(figsize=(8, 5.5))
colors = plt.cm.Set2(np.arange(n))
for d in range(n):
    for s in range(2 * (n - 1)):
        bits, weighted = sent[d, s]
        members = [k for k in range(n) if int(bits) >> k & 1]
        j = int(round(weighted / len(members)))  # every member added the segment index once
        ax.add_patch(plt.Rectangle((d, -s - 1), 0.92, 0.88, color=colors[j]))
        label = "+".join(f"x{k}" for k in members) if len(members) < n else "sum"
        ax.text(d + 0.46, -s - 0.55, f"segment {j}\n{label}", ha="center", va="center", fontsize=8)
        ax.annotate("", (d + 1.0, -s - 0.3), (d + 0.8, -s - 0.3),
                    arrowprops=dict(arrowstyle="->", lw=1.2))  # fmt: skip
ax.axhline(-(n - 1) - 0.04, color="k", lw=1, ls="--")
ax.text(n + 0.05, -(n - 1) / 2, "reduce-scatter", rotation=90, va="center")
ax.text(n + 0.05, -(n - 1) * 1.5, "all-gather", rotation=90, va="center")
ax.set_xlim(-0.1, n + 0.4), ax.set_ylim(-2 * (n - 1) - 0.2, 0.1)
ax.set_xticks(np.arange(n) + 0.46, [f"device {d}" for d in range(n)])
ax.set_yticks(-np.arange(2 * (n - 1)) - 0.55, [f"step {s + 1}" for s in range(2 * (n - 1))])
ax.set_title(f"Ring all-reduce on {n} devices: what each sends to its right ({n - 1} → 0)")
plt.show()

# the picture's facts: after n-1 steps device d received the full sum of segment d; every
# all-gather message is a complete sum
for d in range(n):
    last_in = sent[(d - 1) % n, n - 2]  # what the left neighbour sent in the last RS step
    assert int(last_in[0]) | 2**d == 2**n - 1 and round(last_in[1] / (n - 1)) == d
assert np.all(sent[:, n - 1 :, 0] == 2**n - 1)

# %% [markdown]
# ### The bytes on the wire, read from the compiled program
#
# Every `collective-permute` in the compiled HLO sends its operand from each device to its
# neighbour, so the bytes a device sends are the sum of those operands. A `psum` compiles to
# a single `all-reduce` instead: how it moves the data is up to the runtime.

# %%
def compiled_text(fn, n, size):
    m = mesh_of(n, "data")
    arg = jax.ShapeDtypeStruct((n, size), jnp.float32, sharding=NamedSharding(m, P("data")))
    mapped = jax.shard_map(lambda v: fn(v[0]), mesh=m, in_specs=P("data"), out_specs=P())
    return jax.jit(mapped).lower(arg).compile().as_text()


size = 1 << 12  # float32 numbers per device: 16 KiB
for n in (2, 4, 8):
    hlo = compiled_text(lambda v: ring_all_reduce(v, "data"), n, size)
    sent = [int(np.prod([int(d) for d in dims.split(",")])) * 4
            for dims in re.findall(r"= f32\[([\d,]+)\][^ ]* collective-permute\(", hlo)]  # fmt: skip
    assert sum(sent) == 2 * (n - 1) * 4 * size // n
    print(f"n={n}: {len(sent)} collective-permutes, {sum(sent):6d} bytes sent per device "
          f"= 2(n-1)/n x {4 * size} bytes")  # fmt: skip
psum_hlo = compiled_text(lambda v: jax.lax.psum(v, "data"), 8, size)
print("psum:", re.findall(r"all-reduce\(", psum_hlo).__len__(), "all-reduce,",
      psum_hlo.count("collective-permute("), "collective-permutes")  # fmt: skip

# %% [markdown]
# ### Data parallelism with the ring
#
# A small MLP regression, the batch split over 8 devices. Inside `shard_map` the parameters
# are first cast to *varying* over the data axis (`pcast`, no data moves): otherwise autodiff
# would insert a `psum` of the gradients by itself. Each device's gradient is then a partial
# sum over its rows, and our ring adds them up. One SGD step must equal the one-device step.

# %%
rng = np.random.default_rng(1)
B, D, F = 64, 16, 32
X = rng.normal(size=(B, D)).astype(np.float32)
Y = rng.normal(size=(B, 1)).astype(np.float32)
params = {"w1": rng.normal(size=(D, F)).astype(np.float32) / 4,
          "w2": rng.normal(size=(F, 1)).astype(np.float32) / 4}  # fmt: skip


def loss(p, x, y):  # summed over the rows it sees, divided by the *global* batch
    return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2) / B


def sgd_step(p, g, lr=0.1):
    return jax.tree.map(lambda a, b: a - lr * b, p, g)


one_device = sgd_step(params, jax.grad(loss)(params, X, Y))


def data_parallel_step(p, x, y):
    p_local = jax.lax.pcast(p, "data", to="varying")
    g = jax.grad(loss)(p_local, x, y)  # this device's rows only
    g = jax.tree.map(lambda a: ring_all_reduce(a, "data"), g)  # sum over the devices
    return sgd_step(p, g)


mesh = mesh_of(8, "data")
step = jax.jit(jax.shard_map(data_parallel_step, mesh=mesh,
                             in_specs=(P(), P("data"), P("data")), out_specs=P()))  # fmt: skip
eight_devices = step(params, put(X, mesh, P("data")), put(Y, mesh, P("data")))
for k in params:
    np.testing.assert_allclose(eight_devices[k], one_device[k], rtol=1e-5, atol=1e-6)
print("data parallel (8 devices, ring) == one device: max |diff| =",
      max(float(np.abs(eight_devices[k] - one_device[k]).max()) for k in params))  # fmt: skip

# %% [markdown]
# ## 2. Tensor parallelism: a column / row split MLP
#
# `y = gelu(x @ W1) @ W2` with `W1[D, F_model]` split by **columns** and `W2[F_model, D]` by
# **rows** over 4 devices: device *m* computes `gelu(x @ W1[:, m]) @ W2[m, :]`, a partial
# sum of y over its quarter of the hidden units (gelu acts elementwise, so no communication
# is needed between the two matmuls), and one `psum` adds the four partials.

# %%
t, D, F = 4, 16, 64
x = rng.normal(size=(8, D)).astype(np.float32)
W1 = rng.normal(size=(D, F)).astype(np.float32) / 4
W2 = rng.normal(size=(F, D)).astype(np.float32) / 8


def mlp_shard(x, w1, w2):  # w1: [D, F/t], w2: [F/t, D]
    return jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "model")


mesh = mesh_of(t, "model")
tp = jax.jit(jax.shard_map(mlp_shard, mesh=mesh,
                           in_specs=(P(), P(None, "model"), P("model", None)), out_specs=P()))  # fmt: skip
sharded = tp(x, put(W1, mesh, P(None, "model")), put(W2, mesh, P("model", None)))
reference = jax.nn.gelu(x @ W1) @ W2
np.testing.assert_allclose(sharded, reference, rtol=1e-5, atol=1e-5)
print(f"tensor parallel MLP on {t} devices == one device; each holds",
      W1.size // t + W2.size // t, "of", W1.size + W2.size, "weights")  # fmt: skip

# %% [markdown]
# ## 3. Pipeline parallelism: two stages, GPipe
#
# Two stages, each owning one layer (`W[2, D, D]` split over the `stage` axis), and M
# micro-batches. At tick *t* stage 0 works on micro-batch *t* and stage 1 on micro-batch
# *t − 1*, which `ppermute` handed over from stage 0 at the end of the previous tick: M + 1
# ticks in all, of which one per stage is idle (the bubble: (S − 1)/(M + S − 1) of the time).

# %%
S, M, D = 2, 4, 16
xs = rng.normal(size=(M, 8, D)).astype(np.float32)  # M micro-batches of 8 rows
W = rng.normal(size=(S, D, D)).astype(np.float32) / 4
layer = lambda h, w: jnp.tanh(h @ w)


def pipeline(xs, w):  # w: this stage's [1, D, D]
    stage = jax.lax.axis_index("stage")
    carry, outs = jnp.zeros_like(xs[0]), []
    for tick in range(M + S - 1):
        inp = jnp.where(stage == 0, xs[min(tick, M - 1)], carry)  # stage 0 reads the input
        h = layer(inp, w[0])
        if tick >= S - 1:
            outs.append(h)  # on the last stage: micro-batch tick - (S - 1), done
        carry = jax.lax.ppermute(h, "stage", [(0, 1)])  # hand over to the next stage
    return jnp.stack(outs)[None]


mesh = mesh_of(S, "stage")
pp = jax.jit(jax.shard_map(pipeline, mesh=mesh, in_specs=(P(), P("stage")),
                           out_specs=P("stage")))  # fmt: skip
ys = np.asarray(pp(xs, put(W, mesh, P("stage"))))[S - 1]  # the last stage's outputs
reference = np.stack([layer(layer(xb, W[0]), W[1]) for xb in xs])
np.testing.assert_allclose(ys, reference, rtol=1e-5, atol=1e-6)
print(f"{S}-stage pipeline over {M} micro-batches == one device; bubble "
      f"(S-1)/(M+S-1) = {(S - 1) / (M + S - 1):.0%} of the ticks")  # fmt: skip

# %% [markdown]
# ## In jaxpod
#
# The engine does all three at once on its `(replica, pipeline, tensor)` mesh. Its gradient
# all-reduce is `psum` per parameter by default; `parallel.grad_allreduce: ring` switches to
# the ring above and `parallel.grad_bucket_bytes` fuses small gradients into flat buckets
# first (docs/mesh-and-pipeline.md; measured in docs/benchmarks.md).

# %%
print(f"notebook ran in {time.perf_counter() - T0:.1f} s")
