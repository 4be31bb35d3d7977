"""Self-attention in Flax NNX: multi-head or grouped-query, learned or rotary positions.
Math only: no mesh, no device logic (`tp`: the mesh axis of the collectives, None = plain).

One weight layout serves both kinds. `W_qkv[D, r + 2, KVD]` holds, for each of the KV
heads, its r = heads/kv_heads query heads (slots 0..r-1), its key (slot r) and its value
(slot r + 1); KVD = kv_heads · head_dim is split over `tensor`, so a shard holds whole KV
heads together with the query heads that read them (Megatron's layout, which needs
`mesh.tensor` to divide `kv_heads`). Query head g·r + j is slot j of KV head g, and `W_o`'s
rows follow that order. With kv_heads = heads (r = 1) this is `W_qkv[D, 3, HD]`, multi-head
attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpod.models.chunks import map_chunks
from jaxpod.models.params import layer_param
from jaxpod.models.rope import rotate
from jaxpod.parallel.tensor import (
    ATTENTION_OUT,
    ATTENTION_QKV,
    column_dense,
    gather_sequence,
    row_dense,
)

F32 = jnp.float32


class SelfAttention(nnx.Module):
    """Attention with heads split over the tensor axis; causal (GPT) or not (BERT).

    `W_qkv[D, r + 2, KVD_tensor]` (column-parallel, the local KV heads' queries, keys and
    values), `W_o[HD_tensor, D]` (row-parallel, one psum). `x[B, T, D] -> [B, T, D]`.
    `kv_heads`: None = `heads`. `rope_base`: rotate q and k per head (`jaxpod.models.rope`),
    None = no rotation (the model adds learned positions). With `chunks=C` the queries go
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
        kv_heads: int | None = None,
        rope_base: float | None = None,
    ):
        self.causal = causal
        self.chunks = chunks
        self.sequence_parallel = sequence_parallel
        self.rope_base = rope_base
        self.head_dim = d_model // heads
        self.group = heads // (kv_heads or heads)  # r: query heads per KV head
        slots, kvd, hd = self.group + 2, (kv_heads or heads) * self.head_dim, heads * self.head_dim
        axes = ("embed", None, "heads")
        self.w_qkv = layer_param(rngs, (d_model, slots, kvd), axes, layers, panel_axis=1)
        self.b_qkv = layer_param(None, (slots, kvd), axes[1:], layers, fill=0.0, panel_axis=0)
        self.w_o = layer_param(rngs, (hd, d_model), ("heads", "embed"), layers)
        self.b_o = layer_param(None, (d_model,), ("embed",), layers, fill=0.0)

    @property
    def slots(self) -> int:
        """`W_qkv`'s slots per KV head: r queries, a key, a value (the panels of `steps`)."""
        return self.group + 2

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
        """`x[B, T, D] @ W_qkv -> [B, T, n, KVD_tensor]` (`n` = r + 2, or 1 for a panel of
        `W_qkv[D, 1, KVD_tensor]`: one slot alone)."""
        qkv = column_dense(x, self.w_qkv[...], self.b_qkv[...])
        return checkpoint_name(qkv, ATTENTION_QKV)

    def split_heads(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`qkv[B, T, r + 2, KVD_tensor] -> q[B, T, H_tensor, hd], k, v[B, T, KV_tensor, hd]`,
        query head g·r + j from slot j of KV head g; q and k rotated with RoPE."""
        b, t, r = *qkv.shape[:2], self.group
        qkv = qkv.reshape(b, t, r + 2, -1, self.head_dim)  # [B, T, r + 2, KV_tensor, hd]
        if r == 1:
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = jnp.swapaxes(qkv[:, :, :r], 2, 3).reshape(b, t, -1, self.head_dim)
            k, v = qkv[:, :, r], qkv[:, :, r + 1]
        if self.rope_base is not None:
            q, k = rotate(q, self.rope_base), rotate(k, self.rope_base)
        return q, k, v

    def attend_qkv(self, qkv: jax.Array) -> jax.Array:
        """`qkv[B, T, r + 2, KVD_tensor] -> o[B, T, HD_tensor]`, the queries in `chunks`
        chunks."""
        b, t = qkv.shape[:2]
        q, k, v = self.split_heads(qkv)
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
    `k, v[B, T, KV, hd]` -> `[B, Tq, H, hd]`; query head g·r + j reads KV head g (r = H/KV;
    KV = H: multi-head). The scores `[B, H, Tq, T]` are the big temporary."""
    tq, t, kv = q.shape[1], k.shape[1], k.shape[2]
    grouped = kv != q.shape[2]
    if grouped:  # [B, Tq, KV, r, hd]: the group's queries meet their one key
        q = q.reshape(*q.shape[:2], kv, -1, q.shape[-1])
    spec = "bqgrd,bkgd->bgrqk" if grouped else "bqhd,bkhd->bhqk"
    scores = jnp.einsum(spec, q, k) * (q.shape[-1] ** -0.5)
    if causal:
        allowed = (start + jnp.arange(tq))[:, None] >= jnp.arange(t)[None, :]
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(F32), axis=-1).astype(v.dtype)
    if grouped:
        return jnp.einsum("bgrqk,bkgd->bqgrd", probs, v).reshape(*q.shape[:2], -1, q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
