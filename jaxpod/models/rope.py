"""Rotary position embedding (RoPE): each head's dimensions, as pairs `(i, i + hd/2)`, are
rotated by the angle `position * base^(-2i/hd)`, so a query at position m and a key at n
meet with a score that depends on m - n only. Applied to queries and keys per head, after
their projection; no learned position table. Math only, computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rotate(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
    """`x[B, T, H, hd]` rotated pairwise by the angles of `positions[T]` (default
    `0..T-1`): halves `x1, x2 = x[..., :hd/2], x[..., hd/2:]` become `x1 cos - x2 sin`,
    `x1 sin + x2 cos` (the half-split pairing of GPT-NeoX and Llama). Same shape and dtype."""
    t, hd = x.shape[1], x.shape[-1]
    if positions is None:
        positions = jnp.arange(t, dtype=F32)
    freqs = base ** (-jnp.arange(hd // 2, dtype=F32) * 2 / hd)  # [hd/2]
    angles = positions.astype(F32)[:, None] * freqs[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, hd/2]
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)
