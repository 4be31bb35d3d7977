"""Decoder-only GPT in Flax NNX: pre-LayerNorm layers, learned or rotary positions
(`model.positions`), multi-head or grouped-query attention (`model.kv_heads`), a GELU or
SwiGLU MLP (`model.mlp`), tied or untied embeddings, no dropout (a step is a deterministic
function of parameters and batch).

The layer parameters are one stacked `Layer` with a leading `[L]` axis (`self.layers`),
applied with `lax.scan`, so compile time does not grow with depth. A pipeline needs three
pieces — `embed`, the layers (run by `jaxpod.parallel.stack` on whatever part of the stack
a stage holds) and `token_loss` — and `__call__` is the plain single-device loss every
sharded step is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.config import ModelConfig
from jaxpod.config.kinds import KINDS
from jaxpod.models.family import Family
from jaxpod.models.layers import Layer, LayerNorm, apply_layers
from jaxpod.models.params import INIT_STD, TABLE, param
from jaxpod.parallel.tensor import position_rows, vocab_cross_entropy, vocab_embed


class GPT(nnx.Module):
    """GPT with params `wte[V, D]` (vocab-parallel), `wpe[T, D]` (learned positions only),
    `layers[L, ...]`, `ln_f`, and `unembed[V, D]` when embeddings are untied. The token
    tables have role `TABLE`."""

    masked = False  # targets are the next tokens of every position (BERT: masked positions)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, v = cfg.d_model, cfg.vocab
        normal = lambda shape: INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
        self.wte = param(normal((v, d)), ("vocab", "embed"), TABLE)
        rows = "positions" if cfg.sequence_parallel else None  # split over tensor with SP
        rope = cfg.positions == "rope"
        self.wpe = None if rope else param(normal((cfg.seq_len, d)), (rows, "embed"))
        self.layers = Layer(
            d,
            cfg.heads,
            cfg.d_ff,
            rngs=rngs,
            layers=cfg.layers,
            sequence_chunks=cfg.sequence_chunks,
            sequence_parallel=cfg.sequence_parallel,
            kv_heads=cfg.kv_heads,
            mlp=cfg.mlp,
            rope_base=cfg.rope_base if rope else None,
        )
        self.sequence_parallel = cfg.sequence_parallel
        self.ln_f = LayerNorm(d)
        self.unembed = (
            None if cfg.tie_embeddings else param(normal((v, d)), ("vocab", "embed"), TABLE)
        )

    def embed(self, tokens: jax.Array, tp: str | None = None) -> jax.Array:
        """`tokens[..., T] int32 -> x[..., T, D]` (token + learned position embedding; RoPE
        rotates inside attention instead); with sequence parallelism this shard's positions
        only, `x[..., T_tensor, D]`."""
        t, sp = tokens.shape[-1], self.sequence_parallel
        x = vocab_embed(tokens, self.wte[...], tp, scatter=sp)
        return x if self.wpe is None else x + position_rows(self.wpe[...], t, tp, sp)

    def inputs_and_targets(self, tokens: jax.Array, keys=None):
        """`tokens[..., T+1] -> (inputs[..., T], targets[..., T], None)`: every position
        predicts the next token, all with weight 1 (`keys` unused)."""
        return tokens[..., :-1], tokens[..., 1:], None

    def token_loss(self, h: jax.Array, targets: jax.Array, tp: str | None = None) -> jax.Array:
        """Final norm + vocab-parallel cross-entropy: `h[..., D], targets[...] -> loss[...]`."""
        table = self.wte if self.unembed is None else self.unembed
        return vocab_cross_entropy(self.ln_f(h), table[...], targets, tp)

    def __call__(self, tokens: jax.Array, keys=None) -> jax.Array:
        """Plain single-device mean next-token loss of `tokens[B, T+1]` (the reference)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        h = apply_layers(self.layers, self.embed(inputs))
        return jnp.mean(self.token_loss(h, targets))


FAMILY = Family(KINDS["gpt"], GPT)
