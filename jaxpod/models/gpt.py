"""Decoder-only GPT in Flax NNX: pre-LayerNorm blocks, learned positions, tied or untied
embeddings, no dropout (a step is a deterministic function of parameters and batch).

The layer parameters are one stacked `Block` with a leading `[L]` axis, applied with
`lax.scan`, so compile time does not grow with depth. The model exposes the three pieces a
pipeline needs — `embed`, `layers` (applied to whatever slice of the stack it holds) and
`token_loss` — and `__call__`, the plain single-device loss every sharded step is tested
against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpod.config.load import ModelConfig
from jaxpod.models.layers import INIT_STD, Block, LayerNorm
from jaxpod.parallel.stream import apply_stack
from jaxpod.parallel.tensor import VocabBlocks, position_rows, vocab_cross_entropy, vocab_embed


class GPT(nnx.Module):
    """GPT with params `wte[V, D]` (vocab-parallel), `wpe[T, D]`, `blocks[L, ...]`,
    `ln_f`, and `unembed[V, D]` when embeddings are untied."""

    masked = False  # targets are the next tokens of every position (BERT: masked positions)

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, v = cfg.d_model, cfg.vocab
        normal = lambda shape: INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)
        self.wte = nnx.Param(normal((v, d)), axes=("vocab", "embed"))
        rows = "positions" if cfg.sequence_parallel else None  # split over tensor with SP
        self.wpe = nnx.Param(normal((cfg.seq_len, d)), axes=(rows, "embed"))
        self.blocks = Block(
            d,
            cfg.heads,
            cfg.d_ff,
            rngs=rngs,
            layers=cfg.layers,
            sequence_chunks=cfg.sequence_chunks,
            sequence_parallel=cfg.sequence_parallel,
        )
        self.sequence_parallel = cfg.sequence_parallel
        self.ln_f = LayerNorm(d)
        self.unembed = (
            None if cfg.tie_embeddings else nnx.Param(normal((v, d)), axes=("vocab", "embed"))
        )
        self.remat_policy = cfg.remat

    def embed(
        self, tokens: jax.Array, tp: str | None = None, vocab: VocabBlocks | None = None
    ) -> jax.Array:
        """`tokens[..., T] int32 -> x[..., T, D]` (token + position embedding); with
        sequence parallelism this shard's positions only, `x[..., T_tensor, D]`. `vocab`: the
        token table as stored, used a block of rows at a time (`VocabBlocks`)."""
        t, sp = tokens.shape[-1], self.sequence_parallel
        positions = position_rows(self.wpe[...], t, tp, sp)
        return vocab_embed(tokens, self.wte[...], tp, scatter=sp, vocab=vocab) + positions

    def inputs_and_targets(self, tokens: jax.Array, keys=None):
        """`tokens[..., T+1] -> (inputs[..., T], targets[..., T], None)`: every position
        predicts the next token, all with weight 1 (`keys` unused)."""
        return tokens[..., :-1], tokens[..., 1:], None

    def layers(self, x: jax.Array, tp: str | None = None, unroll: bool = False, **hooks):
        """Apply every layer of the (local slice of the) stack: `x[B, T, D] -> [B, T, D]`.

        `unroll=True` unrolls the layer scan (for FLOP accounting only: XLA's cost analysis
        counts a loop body once, whatever its trip count). `hooks`: the engine's
        `phases`/`fetch`/`prepare`/`offload_activations` (see `stack.apply_stack`)."""
        return apply_stack(self.blocks, self.remat_policy, x, tp, unroll, **hooks)

    def token_loss(
        self,
        h: jax.Array,
        targets: jax.Array,
        tp: str | None = None,
        vocab: VocabBlocks | None = None,
    ) -> jax.Array:
        """Final norm + vocab-parallel cross-entropy: `h[..., D], targets[...] -> loss[...]`.
        `vocab`: the output table as stored, used a block of rows at a time."""
        table = self.wte if self.unembed is None else self.unembed
        return vocab_cross_entropy(self.ln_f(h), table[...], targets, tp, vocab)

    def __call__(self, tokens: jax.Array, keys=None) -> jax.Array:
        """Plain single-device mean next-token loss of `tokens[B, T+1]` (the reference)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        return jnp.mean(self.token_loss(self.layers(self.embed(inputs)), targets))
