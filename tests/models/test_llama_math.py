"""The math of GPT's Llama options on one device, against plain references written here:
RoPE rotates (norms kept, scores depend only on the offset of query and key, a pinned
rotation), grouped-query attention is multi-head attention whose query heads share their
group's key and value, SwiGLU is silu(gate)·up, and each option gives the model the
parameters it should have."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import make_tiny_cfg

from jaxpod.models.attention import SelfAttention
from jaxpod.models.family import build_model
from jaxpod.models.layers import Mlp
from jaxpod.models.rope import rotate

D, HEADS, HD = 32, 4, 8


def test_rope_keeps_norms_and_is_identity_at_position_0():
    """Each head vector keeps its length (a rotation per pair); position 0 is not moved."""
    x = jax.random.normal(jax.random.key(0), (2, 16, 3, HD))
    y = rotate(x, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), 1e-6)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])
    assert float(jnp.max(jnp.abs(y[:, 1:] - x[:, 1:]))) > 0.1


def test_rope_pinned_rotation():
    """hd = 2: one pair at frequency base^0 = 1, so position p turns (1, 0) by p radians."""
    x = jnp.tile(jnp.array([1.0, 0.0]), (1, 3, 1, 1))  # [B=1, T=3, H=1, 2]
    y = rotate(x, 10000.0)[0, :, 0]
    want = np.array([[1.0, 0.0], [np.cos(1.0), np.sin(1.0)], [np.cos(2.0), np.sin(2.0)]])
    np.testing.assert_allclose(y, want, atol=1e-7)


def test_rope_score_depends_only_on_the_offset():
    """q at m and k at n rotated: q·k is the same for (m, n) and (m + s, n + s), and differs
    for another offset."""
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, HD))
    score = lambda m, n: float(
        jnp.sum(rotate(q, 500000.0, jnp.array([m])) * rotate(k, 500000.0, jnp.array([n])))
    )
    for m, n in [(5, 2), (0, 7), (100, 100)]:
        for s in (1, 13, 1000):
            assert score(m + s, n + s) == pytest.approx(score(m, n), rel=1e-4, abs=1e-5)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def reference_attention(x, p, heads: int, kv_heads: int):
    """Causal attention head by head, float64 numpy: query head h = g·r + j is slot j of KV
    head g in `W_qkv[D, r + 2, KV·hd]`, its key slot r and value slot r + 1 of head g."""
    x = np.asarray(x, np.float64)
    w, b = np.asarray(p["w_qkv"], np.float64), np.asarray(p["b_qkv"], np.float64)
    r, t = heads // kv_heads, x.shape[1]
    proj = lambda slot, g: x @ w[:, slot, g * HD : (g + 1) * HD] + b[slot, g * HD : (g + 1) * HD]
    out = []
    for h in range(heads):
        g, j = divmod(h, r)
        q, k, v = proj(j, g), proj(r, g), proj(r + 1, g)
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(HD)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        out.append((e / e.sum(-1, keepdims=True)) @ v)
    o = np.concatenate(out, -1)
    return o @ np.asarray(p["w_o"], np.float64) + np.asarray(p["b_o"], np.float64)


def attention_and_params(kv_heads: int | None):
    layer = SelfAttention(D, HEADS, rngs=nnx.Rngs(3), kv_heads=kv_heads)
    x = jax.random.normal(jax.random.key(4), (2, 8, D))
    return layer(x, None), nnx.to_pure_dict(nnx.state(layer)), x


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_attention_equals_the_head_by_head_reference(kv_heads):
    """Multi-head (kv_heads = heads), grouped (2) and multi-query (1) attention equal the
    plain per-head computation."""
    y, p, x = attention_and_params(kv_heads)
    assert p["w_qkv"].shape == (D, HEADS // kv_heads + 2, kv_heads * HD)
    np.testing.assert_allclose(y, reference_attention(x, p, HEADS, kv_heads), atol=2e-6)


def test_kv_heads_equal_to_heads_is_the_default_attention():
    """kv_heads = heads builds the default (multi-head) layer: same parameters, same output."""
    (y, p, _), (y0, p0, _) = attention_and_params(HEADS), attention_and_params(None)
    assert p["w_qkv"].shape == (D, 3, HEADS * HD)
    jax.tree.map(np.testing.assert_array_equal, p, p0)
    np.testing.assert_array_equal(y, y0)


def test_gqa_is_mha_with_shared_keys_and_values():
    """A GQA layer (2 KV heads) equals the multi-head layer whose 4 heads' keys and values
    are their group's, copied: the MHA weights built from the GQA ones give its output."""
    y, p, x = attention_and_params(2)
    r = HEADS // 2
    mha = SelfAttention(D, HEADS, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(mha)
    per_head = lambda a: a.reshape(*a.shape[:-1], 2, HD)  # [..., KV, hd]
    q = jnp.swapaxes(per_head(p["w_qkv"][:, :r]), 1, 2).reshape(D, -1)  # heads g·r + j
    kv = [jnp.repeat(per_head(p["w_qkv"][:, s]), r, axis=-2).reshape(D, -1) for s in (r, r + 1)]
    bq = jnp.swapaxes(per_head(p["b_qkv"][:r]), 0, 1).reshape(-1)
    bkv = [jnp.repeat(per_head(p["b_qkv"][s]), r, axis=-2).reshape(-1) for s in (r, r + 1)]
    weights = {
        "w_qkv": jnp.stack([q, *kv], axis=1),
        "b_qkv": jnp.stack([bq, *bkv]),
        "w_o": p["w_o"],
        "b_o": p["b_o"],
    }
    nnx.replace_by_pure_dict(state, weights)
    np.testing.assert_allclose(nnx.merge(graphdef, state)(x, None), y, atol=1e-6)


def test_swiglu_is_silu_gate_times_up():
    """`Mlp(kind="swiglu")`: `(silu(x W_gate + b_gate) * (x W_up + b_up)) W_out + b_out`."""
    mlp = Mlp(D, 48, rngs=nnx.Rngs(5), kind="swiglu")
    mlp.b_in[...] = jax.random.normal(jax.random.key(7), (2, 48))
    x = jax.random.normal(jax.random.key(6), (2, 8, D))
    w, b = mlp.w_in[...], mlp.b_in[...]
    assert w.shape == (D, 2, 48)
    gate, up = x @ w[:, 0] + b[0], x @ w[:, 1] + b[1]
    want = (gate / (1 + jnp.exp(-gate)) * up) @ mlp.w_out[...] + mlp.b_out[...]
    np.testing.assert_allclose(mlp(x, None), want, atol=2e-6)


@pytest.mark.parametrize(
    ("overrides", "shapes"),
    [
        (("model.kv_heads=2",), {"w_qkv": (4, 64, 4, 32), "w_in": (4, 64, 256)}),
        (("model.mlp=swiglu",), {"w_qkv": (4, 64, 3, 64), "w_in": (4, 64, 2, 256)}),
        (("model.positions=rope",), {"wpe": None}),
        ((), {"wpe": (64, 64), "w_qkv": (4, 64, 3, 64), "w_in": (4, 64, 256)}),
    ],
    ids=["gqa", "swiglu", "rope", "default"],
)
def test_options_shape_the_parameters(overrides, shapes):
    """The tiny GPT's parameters under each option (RoPE: no position table)."""
    cfg = make_tiny_cfg(*overrides, mesh=(1, 1, 1))
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, 0))))
    layer = params["layers"]
    found = {"w_qkv": layer["attn"]["w_qkv"].shape, "w_in": layer["mlp"]["w_in"].shape}
    found["wpe"] = params["wpe"].shape if "wpe" in params else None
    assert {k: found[k] for k in shapes} == shapes
