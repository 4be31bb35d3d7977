"""Transformer layers in Flax NNX. Math only: no mesh, no device logic.

Parameters carry logical axis names and roles (`jaxpod.models.params`); `jaxpod.parallel.mesh`
maps the names onto mesh axes. Every module can be created *stacked*: with `layers=L` each
parameter gets a leading `[L]` axis named `"layers"`, and the forward is applied to one
layer's slice inside a `scan` (`apply_layers`; `jaxpod.parallel.stack` for the sharded run).

The tensor-parallel collectives come from `jaxpod.parallel.tensor`; the `tp` argument is
the mesh axis to use (`None` = plain single-device math). Because shapes are read off the
arrays, the same code runs on a full layer or on one tensor shard of it.

Dtypes: layers compute in the dtype of their inputs and (already cast) weights, i.e.
`precision.compute`; LayerNorm statistics and the attention softmax are taken in float32
and cast back (a no-op for float32 models).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpod.models.params import LAYERS, NO_DECAY, panel_axis_of_layer, param
from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.tensor import (
    ATTENTION_OUT,
    ATTENTION_QKV,
    column_dense,
    gather_sequence,
    reduce_rows,
    row_dense,
)

INIT_STD = 0.02
F32 = jnp.float32


def _param(
    rngs: nnx.Rngs | None,
    shape,
    axes,
    layers: int | None,
    fill: float | None = None,
    panel_axis: int | None = None,
):
    """A parameter of `shape` (leading `[layers]` axis if stacked): normal(0.02) weights, or
    `fill` for biases and norm parameters (role `NO_DECAY`). `panel_axis`: the dimension of
    `shape` that `Layer.steps` cuts into panels."""
    if layers is not None:
        shape, axes = (layers, *shape), (LAYERS, *axes)
        panel_axis = None if panel_axis is None else panel_axis + 1
    if fill is None:
        value, roles = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32), ()
    else:
        value, roles = jnp.full(shape, fill, jnp.float32), (NO_DECAY,)
    return param(value, axes, *roles, panel_axis=panel_axis)


def map_chunks(fn: Callable, x: jax.Array, chunks: int, axis: int) -> jax.Array:
    """`fn(chunk, i)` on each of `chunks` equal chunks of `x` along `axis`, one after
    another (a scan), each chunk a checkpoint: only one chunk's intermediates are ever
    alive, forward or backward (they are recomputed, never saved). The chunks' outputs are
    written back in place along `axis`. `chunks=1` is `fn(x, 0)`.

    The serialisation factor of pod recipes (attention queries, MLP tokens, the loss head):
    the same math, 1/chunks of the working memory, a little recomputation.
    """
    if chunks == 1:
        return fn(x, 0)
    axis %= x.ndim
    n = x.shape[axis] // chunks
    chunk = jax.checkpoint(lambda i: fn(jax.lax.dynamic_slice_in_dim(x, i * n, n, axis), i))
    like = jax.eval_shape(chunk, 0)

    def body(out, i):  # each chunk's output written into place: no stacked copies
        return jax.lax.dynamic_update_slice_in_dim(out, chunk(i), i * like.shape[axis], axis), None

    shape = (*like.shape[:axis], chunks * like.shape[axis], *like.shape[axis + 1 :])
    out = vary_like(jnp.zeros(shape, like.dtype), like)
    return jax.lax.scan(body, out, jnp.arange(chunks))[0]


def token_loss_in_chunks(
    model: nnx.Module, h: jax.Array, targets: jax.Array, tp: str | None, chunks: int, **kw
) -> jax.Array:
    """`model.token_loss` of `h[..., D]` against `targets[...]` -> `loss[N]` (tokens
    flattened), the N tokens in `gcd(chunks, N)` chunks (`map_chunks`): one chunk's logits
    `[N/chunks, V_tensor]` alive at a time instead of all of them. `kw`: passed on to
    `token_loss`."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    chunks = math.gcd(chunks, targets.shape[0])
    n = targets.shape[0] // chunks
    chunk_loss = lambda hc, i: model.token_loss(
        hc, jax.lax.dynamic_slice_in_dim(targets, i * n, n), tp, **kw
    )
    return map_chunks(chunk_loss, h, chunks, axis=0)


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, `x[..., D] -> [..., D]`; params `scale[D]`, `bias[D]`."""

    def __init__(self, dim: int, *, layers: int | None = None, eps: float = 1e-5):
        self.scale = _param(None, (dim,), ("embed",), layers, fill=1.0)
        self.bias = _param(None, (dim,), ("embed",), layers, fill=0.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype, x = x.dtype, x.astype(F32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(F32)
        return (y + self.bias[...].astype(F32)).astype(dtype)


class SelfAttention(nnx.Module):
    """Multi-head attention, heads split over the tensor axis; causal (GPT) or not (BERT).

    `W_qkv[D, 3, HD_tensor]` (column-parallel, q/k/v of the local heads), `W_o[HD_tensor, D]`
    (row-parallel, one psum). `x[B, T, D] -> [B, T, D]`. With `chunks=C` the queries go
    through in C chunks of T/C (`map_chunks`): only one chunk's scores `[B, H_tensor, T/C, T]`
    are ever alive, forward or backward. Same math for any C.
    `sequence_parallel`: `x[B, T_tensor, D] -> [B, T_tensor, D]` (see
    `jaxpod.parallel.tensor`): all-gather T in, reduce-scatter T out.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        rngs: nnx.Rngs,
        layers: int | None = None,
        causal: bool = True,
        chunks: int = 1,
        sequence_parallel: bool = False,
    ):
        self.causal = causal
        self.chunks = chunks
        self.sequence_parallel = sequence_parallel
        self.head_dim = d_model // heads
        hd = heads * self.head_dim
        self.w_qkv = _param(rngs, (d_model, 3, hd), ("embed", None, "heads"), layers, panel_axis=1)
        self.b_qkv = _param(None, (3, hd), (None, "heads"), layers, fill=0.0, panel_axis=0)
        self.w_o = _param(rngs, (hd, d_model), ("heads", "embed"), layers)
        self.b_o = _param(None, (d_model,), ("embed",), layers, fill=0.0)

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        return self.project(self.mix(x, tp), tp)

    def mix(self, x: jax.Array, tp: str | None) -> jax.Array:
        """The attention before its output projection (reads `W_qkv`, `b_qkv` only):
        `x[B, T, D]` (`[B, T_tensor, D]` sequence-parallel) -> `o[B, T, HD_tensor]`."""
        return self.attend_qkv(self.qkv(self.gather_input(x, tp)))

    def gather_input(self, x: jax.Array, tp: str | None) -> jax.Array:
        """`x[B, T, D]` as the matmul needs it (sequence-parallel: all-gathered over T)."""
        return gather_sequence(x, tp) if self.sequence_parallel else x

    def qkv(self, x: jax.Array) -> jax.Array:
        """`x[B, T, D] @ W_qkv -> [B, T, n, HD_tensor]` (`n` = 3, or 1 for a panel of
        `W_qkv[D, 1, HD_tensor]`: queries, keys or values alone)."""
        qkv = column_dense(x, self.w_qkv[...], self.b_qkv[...])
        return checkpoint_name(qkv, ATTENTION_QKV)

    def attend_qkv(self, qkv: jax.Array) -> jax.Array:
        """`qkv[B, T, 3, HD_tensor] -> o[B, T, HD_tensor]`, the queries in `chunks` chunks."""
        b, t = qkv.shape[:2]
        qkv = qkv.reshape(b, t, 3, -1, self.head_dim)  # [B, T, 3, H_tensor, hd]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        n = t // self.chunks  # queries per chunk
        attend_chunk = lambda qc, i: attend(qc, k, v, self.causal, i * n)
        out = map_chunks(attend_chunk, q, self.chunks, axis=1)
        return checkpoint_name(out.reshape(b, t, -1), ATTENTION_OUT)

    def project(self, o: jax.Array, tp: str | None) -> jax.Array:
        """The output projection (reads `W_o`, `b_o` only): `o[B, T, HD_tensor]` ->
        `[B, T, D]` (`[B, T_tensor, D]` sequence-parallel), summed over `tp`."""
        return row_dense(o, self.w_o[...], self.b_o[...], tp, self.sequence_parallel)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, start: jax.Array | int = 0
) -> jax.Array:
    """Softmax attention of queries `q[B, Tq, H, hd]` at positions `start..start+Tq-1` over
    `k, v[B, T, H, hd]` -> `[B, Tq, H, hd]`; the scores `[B, H, Tq, T]` are the big temporary.
    """
    tq, t = q.shape[1], k.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    if causal:
        allowed = (start + jnp.arange(tq))[:, None] >= jnp.arange(t)[None, :]
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(F32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Mlp(nnx.Module):
    """GELU MLP: `W_in[D, F_tensor]` column-parallel, `W_out[F_tensor, D]` row-parallel;
    `chunks`: the tokens go through in chunks (`map_chunks`: one chunk's `[B, T/C, F_tensor]`
    hidden activations alive at a time); `sequence_parallel` as in `SelfAttention`."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        rngs: nnx.Rngs,
        layers: int | None = None,
        chunks: int = 1,
        sequence_parallel: bool = False,
    ):
        self.chunks = chunks
        self.sequence_parallel = sequence_parallel
        self.w_in = _param(rngs, (d_model, d_ff), ("embed", "mlp"), layers, panel_axis=1)
        self.b_in = _param(None, (d_ff,), ("mlp",), layers, fill=0.0, panel_axis=0)
        self.w_out = _param(rngs, (d_ff, d_model), ("mlp", "embed"), layers, panel_axis=0)
        self.b_out = _param(None, (d_model,), ("embed",), layers, fill=0.0)

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        return self.reduce(self.partial(self.gather_input(x, tp)), tp)

    def gather_input(self, x: jax.Array, tp: str | None) -> jax.Array:
        """`x[B, T, D]` as the matmul needs it (sequence-parallel: all-gathered over T)."""
        return gather_sequence(x, tp) if self.sequence_parallel else x

    def partial(self, x: jax.Array) -> jax.Array:
        """`x[B, T, D] -> [B, T, D]`, this shard's hidden units only (reads `W_in`, `b_in`,
        `W_out`, or one panel of each): both matmuls per chunk of tokens, one chunk's hidden
        activations alive at a time."""
        w_in, b_in, w_out = self.w_in[...], self.b_in[...], self.w_out[...]

        def partial_sums(xc, _):  # [B, n, D] -> [B, n, D], this shard's F columns only
            h = jax.nn.gelu(column_dense(xc, w_in, b_in), approximate=True)
            return jnp.tensordot(h, w_out, axes=1)

        return map_chunks(partial_sums, x, self.chunks, axis=1)

    def reduce(self, y: jax.Array, tp: str | None, bias: bool = True) -> jax.Array:
        """Sum the partial sums `y[B, T, D]` over `tp` (reduce-scatter over T when
        sequence-parallel) and add `b_out` (unless `bias=False`)."""
        return reduce_rows(y, self.b_out[...] if bias else None, tp, self.sequence_parallel)


class Layer(nnx.Module):
    """A transformer layer. Pre-LayerNorm (GPT, `norm="pre"`): `x + attn(ln1(x))`, then
    `x + mlp(ln2(x))`. Post-LayerNorm (original BERT, `norm="post"`): `ln1(x + attn(x))`,
    then `ln2(x + mlp(x))`. `causal=False` lets every position attend to every other;
    `sequence_chunks`, `sequence_parallel` (then `x` is `[B, T_tensor, D]` in and out): see
    `SelfAttention`."""

    def __init__(
        self,
        d_model,
        heads,
        d_ff,
        *,
        rngs: nnx.Rngs,
        layers: int | None = None,
        causal: bool = True,
        norm: str = "pre",
        sequence_chunks: int = 1,
        sequence_parallel: bool = False,
    ):
        if norm not in ("pre", "post"):
            raise ValueError(f"norm={norm!r} must be 'pre' or 'post'")
        self.post_norm = norm == "post"
        self.ln1 = LayerNorm(d_model, layers=layers)
        sp = sequence_parallel
        self.attn = SelfAttention(
            d_model,
            heads,
            rngs=rngs,
            layers=layers,
            causal=causal,
            chunks=sequence_chunks,
            sequence_parallel=sp,
        )
        self.ln2 = LayerNorm(d_model, layers=layers)
        self.mlp = Mlp(
            d_model, d_ff, rngs=rngs, layers=layers, chunks=sequence_chunks, sequence_parallel=sp
        )

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        if self.post_norm:
            x = self.ln1(x + self.attn(x, tp))
            return self.ln2(x + self.mlp(x, tp))
        x = x + self.attn(self.ln1(x), tp)
        return x + self.mlp(self.ln2(x), tp)

    def steps(
        self, tp: str | None, mlp_panels: int = 1
    ) -> list[tuple[tuple[str | tuple, ...], Callable]]:
        """The layer as a sequence of steps that each read at most one weight matrix, or one
        panel of one: `(reads, step)`, with `reads` the parameters the step uses (`"ln1"`: a
        sub-module's all; `("attn/w_qkv", 1, j, 3)`: panel j of 3 along axis 1, index None:
        each panel in turn, `jaxpod.parallel.matrix_stream.Panel`'s fields) and
        `step(layer, carry) -> carry` a function of the layer it is given (whose parameters
        are the `reads`, already sliced), not of `self`. The carry starts as `(x,)` and ends
        as `(y,)` with `y = self(x, tp)`; in between it holds only residual-stream-sized
        values (x, q, k, v, the attention output, the MLP's partial sums), so that what a
        layer's backward pass keeps of its steps' inputs stays small.

        Attention: queries, keys and values, one `W_qkv` panel each (each step makes its
        input ready again: LayerNorm, sequence all-gather), the attention itself (no
        weights), `W_o`. MLP: one step run once per panel of the hidden units (panel
        index None; `mlp_panels` panels: a column panel of `W_in`, `b_in` and the matching
        row panel of `W_out` each; the input made ready and the partial sums reduced over
        `tp` per panel, so k panels cost k times the MLP's activation traffic), then
        `b_out`. The same math as `__call__`, summed in another order."""
        pre = not self.post_norm
        norm = lambda m, name, x: getattr(m, name)(x) if pre else x
        # the residual connection with the sub-layer's output u
        post = lambda m, name, x, u: x + u if pre else getattr(m, name)(x + u)
        ln1, ln2 = (("ln1",), ("ln2",)) if pre else ((), ())
        out: list = []

        def cut(path: str, index: int | None, count: int) -> tuple:  # its declared axis
            group, name = path.split("/")
            axis = panel_axis_of_layer(getattr(getattr(self, group), name))
            return (path, axis, index, count)

        for j in range(3):  # carry (x[, q[, k]]) -> + this panel's [B, T, 1, HD_tensor]
            reads = (*ln1, cut("attn/w_qkv", j, 3), cut("attn/b_qkv", j, 3))
            ready = lambda m, x: m.attn.gather_input(norm(m, "ln1", x), tp)
            out.append((reads, lambda m, c, r=ready: (*c, m.attn.qkv(r(m, c[0])))))
        out.append(((), lambda m, c: (c[0], m.attn.attend_qkv(jnp.concatenate(c[1:], 2)))))
        reads = ("attn/w_o", "attn/b_o", *(() if pre else ("ln1",)))
        out.append((reads, lambda m, c: (post(m, "ln1", c[0], m.attn.project(c[1], tp)),)))
        k = mlp_panels
        ready = lambda m, x: m.mlp.gather_input(norm(m, "ln2", x), tp)
        partial = lambda m, x: m.mlp.reduce(m.mlp.partial(ready(m, x)), tp, bias=False)
        add = lambda c, y: y if len(c) == 1 else c[1] + y
        # carry (x[, the reduced partial sums so far]), once per panel (index None: a loop)
        reads = (*ln2, cut("mlp/w_in", None, k), cut("mlp/b_in", None, k))
        reads += (cut("mlp/w_out", None, k),)
        out.append((reads, lambda m, c: (c[0], add(c, partial(m, c[0])))))
        reads = ("mlp/b_out", *(() if pre else ("ln2",)))
        out.append((reads, lambda m, c: (post(m, "ln2", c[0], c[1] + m.mlp.b_out[...]),)))
        return out


def apply_layers(layers: Layer, x: jax.Array, tp: str | None = None) -> jax.Array:
    """The plain run of a stacked `Layer` (`[L, ...]` params) over `x`: every layer in turn
    (the single-device reference; `jaxpod.parallel.stack` runs it sharded)."""
    graphdef, stacked = nnx.split(layers)
    layer = lambda h, p: (nnx.merge(graphdef, p)(h, tp), None)
    return jax.lax.scan(layer, x, nnx.to_pure_dict(stacked))[0]
