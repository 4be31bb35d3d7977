"""Transformer layers in Flax NNX. Math only: no mesh, no device logic.

Parameters carry logical axis names and roles (`jaxpod.models.params`); `jaxpod.parallel.mesh`
maps the names onto mesh axes. Every module can be created *stacked*: with `layers=L` each
parameter gets a leading `[L]` axis named `"layers"`, and the forward is applied to one
layer's slice inside a `scan` (`apply_layers`; `jaxpod.parallel.stack` for the sharded run).

The tensor-parallel collectives come from `jaxpod.parallel.tensor`; the `tp` argument is
the mesh axis to use (`None` = plain single-device math). Because shapes are read off the
arrays, the same code runs on a full layer or on one tensor shard of it. The attention is
`jaxpod.models.attention`'s.

Dtypes: layers compute in the dtype of their inputs and (already cast) weights, i.e.
`precision.compute`; LayerNorm statistics and the attention softmax are taken in float32
and cast back (a no-op for float32 models).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.models.attention import SelfAttention
from jaxpod.models.chunks import map_chunks
from jaxpod.models.params import layer_param, panel_axis_of_layer
from jaxpod.parallel.tensor import column_dense, gather_sequence, reduce_rows

F32 = jnp.float32


class LayerNorm(nnx.Module):
    """LayerNorm over the last dim, `x[..., D] -> [..., D]`; params `scale[D]`, `bias[D]`."""

    def __init__(self, dim: int, *, layers: int | None = None, eps: float = 1e-5):
        self.scale = layer_param(None, (dim,), ("embed",), layers, fill=1.0)
        self.bias = layer_param(None, (dim,), ("embed",), layers, fill=0.0)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype, x = x.dtype, x.astype(F32)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(F32)
        return (y + self.bias[...].astype(F32)).astype(dtype)


class Mlp(nnx.Module):
    """GELU MLP: `W_in[D, F_tensor]` column-parallel, `W_out[F_tensor, D]` row-parallel.
    SwiGLU (`kind="swiglu"`): `W_in[D, 2, F_tensor]` holds the gate and the up projection,
    each of width F, both column-parallel; `silu(gate) * up` meets `W_out`. `chunks`: the
    tokens go through in chunks (`map_chunks`: one chunk's `[B, T/C, F_tensor]` hidden
    activations alive at a time); `sequence_parallel` as in `SelfAttention`."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        rngs: nnx.Rngs,
        layers: int | None = None,
        chunks: int = 1,
        sequence_parallel: bool = False,
        kind: str = "gelu",
    ):
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"kind={kind!r} must be 'gelu' or 'swiglu'")
        self.chunks = chunks
        self.sequence_parallel = sequence_parallel
        self.gated = kind == "swiglu"
        shape, axes = ((2, d_ff), (None, "mlp")) if self.gated else ((d_ff,), ("mlp",))
        cut = len(shape) - 1  # panels split the hidden units
        self.w_in = layer_param(
            rngs, (d_model, *shape), ("embed", *axes), layers, panel_axis=cut + 1
        )
        self.b_in = layer_param(None, shape, axes, layers, fill=0.0, panel_axis=cut)
        self.w_out = layer_param(rngs, (d_ff, d_model), ("mlp", "embed"), layers, panel_axis=0)
        self.b_out = layer_param(None, (d_model,), ("embed",), layers, fill=0.0)

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
            h = column_dense(xc, w_in, b_in)  # [B, n, F_tensor], gated: [B, n, 2, F_tensor]
            if self.gated:
                h = jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
            else:
                h = jax.nn.gelu(h, approximate=True)
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
    `sequence_chunks`, `sequence_parallel` (then `x` is `[B, T_tensor, D]` in and out),
    `kv_heads`, `rope_base`: see `SelfAttention`; `mlp`: `Mlp`'s kind."""

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
        kv_heads: int | None = None,
        mlp: str = "gelu",
        rope_base: float | None = None,
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
            kv_heads=kv_heads,
            rope_base=rope_base,
        )
        self.ln2 = LayerNorm(d_model, layers=layers)
        self.mlp = Mlp(
            d_model,
            d_ff,
            rngs=rngs,
            layers=layers,
            chunks=sequence_chunks,
            sequence_parallel=sp,
            kind=mlp,
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

        Attention: queries, keys and values, one `W_qkv` panel (slot) each (each step makes its
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

        n = self.attn.slots
        for j in range(n):  # carry (x, slots 0..j-1) -> + this slot's [B, T, 1, KVD_tensor]
            reads = (*ln1, cut("attn/w_qkv", j, n), cut("attn/b_qkv", j, n))
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
