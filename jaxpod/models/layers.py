"""Transformer building blocks in Flax NNX. Math only: no mesh, no device logic.

Parameters carry logical axis names in their `axes` metadata (`"embed"`, `"heads"`,
`"mlp"`, `"vocab"`, `"layers"`); `jaxpod.mesh` maps those names onto mesh axes. Every
module can be created *stacked*: with `layers=L` each parameter gets a leading `[L]` axis
named `"layers"`, and the forward is applied to one layer's slice inside a `scan`.

The tensor-parallel collectives come from `jaxpod.parallel.tensor`; the `tp` argument is
the mesh axis to use (`None` = plain single-device math). Because shapes are read off the
arrays, the same code runs on a full layer or on one tensor shard of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpod.parallel.tensor import column_dense, row_dense

INIT_STD = 0.02


def _param(rngs: nnx.Rngs | None, shape, axes, layers: int | None, fill: float | None = None):
    """A `nnx.Param` of `shape` (leading `[layers]` axis if stacked): normal(0.02) or `fill`."""
    if layers is not None:
        shape, axes = (layers, *shape), ("layers", *axes)
    if fill is None:
        value = INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
    else:
        value = jnp.full(shape, fill, jnp.float32)
    return nnx.Param(value, axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, `x[..., D] -> [..., D]`; params `scale[D]`, `bias[D]`."""

    def __init__(self, dim: int, *, layers: int | None = None, eps: float = 1e-5):
        self.scale = _param(None, (dim,), ("embed",), layers, fill=1.0)
        self.bias = _param(None, (dim,), ("embed",), layers, fill=0.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]


class CausalSelfAttention(nnx.Module):
    """Multi-head causal attention, heads split over the tensor axis.

    `W_qkv[D, 3, HD_tensor]` (column-parallel, q/k/v of the local heads), `W_o[HD_tensor, D]`
    (row-parallel, one psum). `x[B, T, D] -> [B, T, D]`.
    """

    def __init__(self, d_model: int, heads: int, *, rngs: nnx.Rngs, layers: int | None = None):
        self.head_dim = d_model // heads
        hd = heads * self.head_dim
        self.w_qkv = _param(rngs, (d_model, 3, hd), ("embed", None, "heads"), layers)
        self.b_qkv = _param(None, (3, hd), (None, "heads"), layers, fill=0.0)
        self.w_o = _param(rngs, (hd, d_model), ("heads", "embed"), layers)
        self.b_o = _param(None, (d_model,), ("embed",), layers, fill=0.0)

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        b, t, _ = x.shape
        qkv = checkpoint_name(column_dense(x, self.w_qkv[...], self.b_qkv[...]), "qkv")
        qkv = qkv.reshape(b, t, 3, -1, self.head_dim)  # [B, T, 3, H_tensor, hd]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (self.head_dim**-0.5)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)
        out = checkpoint_name(out, "attn_out")
        return row_dense(out, self.w_o[...], self.b_o[...], tp)


class Mlp(nnx.Module):
    """GELU MLP: `W_in[D, F_tensor]` column-parallel, `W_out[F_tensor, D]` row-parallel."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, layers: int | None = None):
        self.w_in = _param(rngs, (d_model, d_ff), ("embed", "mlp"), layers)
        self.b_in = _param(None, (d_ff,), ("mlp",), layers, fill=0.0)
        self.w_out = _param(rngs, (d_ff, d_model), ("mlp", "embed"), layers)
        self.b_out = _param(None, (d_model,), ("embed",), layers, fill=0.0)

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        h = jax.nn.gelu(column_dense(x, self.w_in[...], self.b_in[...]), approximate=True)
        return row_dense(h, self.w_out[...], self.b_out[...], tp)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`."""

    def __init__(self, d_model, heads, d_ff, *, rngs: nnx.Rngs, layers: int | None = None):
        self.ln1 = LayerNorm(d_model, layers=layers)
        self.attn = CausalSelfAttention(d_model, heads, rngs=rngs, layers=layers)
        self.ln2 = LayerNorm(d_model, layers=layers)
        self.mlp = Mlp(d_model, d_ff, rngs=rngs, layers=layers)

    def __call__(self, x: jax.Array, tp: str | None) -> jax.Array:
        x = x + self.attn(self.ln1(x), tp)
        return x + self.mlp(self.ln2(x), tp)
