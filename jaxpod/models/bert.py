"""BERT encoder in Flax NNX for masked-language modelling: bidirectional (non-causal)
attention, pre- or post-LayerNorm blocks (`model.norm`), learned positions, a token-type
embedding, and the MLM head (dense + GELU + LayerNorm, then logits against the tied,
vocab-parallel embedding plus an output bias).

The layer stack and the pipeline pieces are GPT's (`embed`, `layers`, `token_loss`), so the
one engine trains both; `inputs_and_targets` turns byte windows into masked examples
(`jaxpod.models.mlm`) and the loss counts only the masked positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.config import ModelConfig
from jaxpod.config.kinds import KINDS
from jaxpod.models.family import Family
from jaxpod.models.layers import Layer, LayerNorm, apply_layers
from jaxpod.models.mlm import MASK_ID, check_vocab, mask_tokens, random_ids
from jaxpod.models.params import INIT_STD, NO_DECAY, TABLE, param
from jaxpod.parallel.tensor import (
    column_dense,
    position_rows,
    vocab_cross_entropy,
    vocab_embed,
)

TOKEN_TYPES = 2  # segments A/B; the byte corpora have one segment, so every id is 0


class BERT(nnx.Module):
    """Params `wte[V, D]` (vocab-parallel), `wpe[T, D]`, `wtt[2, D]`, `ln_emb`,
    `layers[L, ...]`, `ln_f` (pre-LN only), MLM head `w_head[D, D]`, `b_head[D]`, `ln_head`,
    output bias `b_out[V]` (vocab-parallel), and `unembed[V, D]` when untied."""

    masked = True  # the loss is on masked positions only (weights from inputs_and_targets)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.mask_id = MASK_ID if cfg.mask_id is None else cfg.mask_id
        check_vocab(cfg.vocab, self.mask_id)
        self.replace_ids = random_ids(cfg.vocab, self.mask_id)
        d, v = cfg.d_model, cfg.vocab
        normal = lambda shape: INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
        self.wte = param(normal((v, d)), ("vocab", "embed"), TABLE)
        rows = "positions" if cfg.sequence_parallel else None  # split over tensor with SP
        self.wpe = param(normal((cfg.seq_len, d)), (rows, "embed"))
        self.wtt = param(normal((TOKEN_TYPES, d)), (None, "embed"))
        self.ln_emb = LayerNorm(d)
        self.layers = Layer(
            d,
            cfg.heads,
            cfg.d_ff,
            rngs=rngs,
            layers=cfg.layers,
            causal=False,
            norm=cfg.norm,
            sequence_chunks=cfg.sequence_chunks,
            sequence_parallel=cfg.sequence_parallel,
        )
        self.sequence_parallel = cfg.sequence_parallel
        self.ln_f = LayerNorm(d) if cfg.norm == "pre" else None
        self.w_head = param(normal((d, d)), ("embed", None))
        self.b_head = param(jnp.zeros((d,), jnp.float32), (None,), NO_DECAY)
        self.ln_head = LayerNorm(d)
        self.b_out = param(jnp.zeros((v,), jnp.float32), ("vocab",), NO_DECAY)
        self.unembed = (
            None if cfg.tie_embeddings else param(normal((v, d)), ("vocab", "embed"), TABLE)
        )

    def inputs_and_targets(self, tokens: jax.Array, keys: jax.Array):
        """`tokens[B, T+1]` id windows, `keys[B]` -> `(inputs[B, T], targets[B, T],
        weights f32[B, T])`: the first T ids, masked (`jaxpod.models.mlm.mask_tokens`)."""
        return mask_tokens(tokens[..., :-1], keys, self.mask_id, self.replace_ids)

    def embed(self, tokens: jax.Array, tp: str | None = None) -> jax.Array:
        """`tokens[..., T] -> x[..., T, D]`: LayerNorm(token + position + token type 0)."""
        t, sp = tokens.shape[-1], self.sequence_parallel
        positions = position_rows(self.wpe[...], t, tp, sp)  # SP: this shard's, [T_tensor, D]
        x = vocab_embed(tokens, self.wte[...], tp, scatter=sp) + positions + self.wtt[...][0]
        return self.ln_emb(x)

    def token_loss(self, h: jax.Array, targets: jax.Array, tp: str | None = None) -> jax.Array:
        """MLM head + vocab-parallel cross-entropy: `h[..., D], targets[...] -> loss[...]`.

        The output bias rides along as one more column of the (local) output table against
        a constant-1 feature, so `vocab_cross_entropy` computes `h @ table.T + b_out` without
        gathering anything: `[h, 1] @ [table, b_out].T`.
        """
        if self.ln_f is not None:
            h = self.ln_f(h)
        h = jax.nn.gelu(column_dense(h, self.w_head[...], self.b_head[...]), approximate=True)
        h = self.ln_head(h)
        table = (self.wte if self.unembed is None else self.unembed)[...]
        table = jnp.concatenate([table, self.b_out[...][:, None].astype(table.dtype)], axis=1)
        h = jnp.concatenate([h, jnp.ones((*h.shape[:-1], 1), h.dtype)], axis=-1)
        return vocab_cross_entropy(h, table, targets, tp)

    def __call__(self, tokens: jax.Array, keys: jax.Array) -> jax.Array:
        """Plain single-device mean MLM loss over the masked positions of `tokens[B, T+1]`
        with row keys `keys[B]` (the reference)."""
        inputs, targets, weights = self.inputs_and_targets(tokens, keys)
        loss = self.token_loss(apply_layers(self.layers, self.embed(inputs)), targets)
        return jnp.sum(loss * weights) / jnp.sum(weights)


FAMILY = Family(KINDS["bert"], BERT)
