"""Masked-language-model examples from byte windows, on the device, deterministic.

BERT trains on the same byte corpora as GPT (`jaxpod.data.text`: stdlib-code, synthetic,
text-files; `data.tokenizer=bytes` only, the config refuses a BPE); each window of
`seq_len + 1` bytes gives one example of its first `seq_len` bytes. In every row exactly
`round(0.15 * seq_len)` positions (at least 1) are chosen; of those, 80 % are replaced by the
`[MASK]` id, 10 % by a random byte, 10 % kept (each chosen position draws its fate
independently). The loss is taken on the chosen positions only.

Randomness: row `r` (its index in the *global* batch) of optimizer step `k` is masked with
`jaxpod.models.family.row_keys(seed, k, r)`: the masks depend on (seed, step, row), never on
the mesh or on how rows are split over replicas. Evaluation uses its own stream (step 0 of
`EVAL_STREAM`): every validation batch masks the same positions of a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpod.config import BYTE_VOCAB
from jaxpod.errors import ConfigError

MASK_ID = BYTE_VOCAB  # 256: the first id after the byte values
MASK_FRACTION = 0.15


def check_vocab(vocab: int) -> None:
    """BERT's vocabulary must hold the 256 bytes and `[MASK]` (id 256)."""
    if vocab <= MASK_ID:
        raise ConfigError(
            f"model.vocab={vocab} has no room for the [MASK] id {MASK_ID} of model.name=bert; "
            f"use model.vocab>={MASK_ID + 1} rounded up to a multiple of mesh.tensor (e.g. 264)"
        )


def masked_count(seq_len: int) -> int:
    """Positions chosen per row: round(0.15 * seq_len), at least 1."""
    return max(1, round(MASK_FRACTION * seq_len))


def mask_tokens(tokens: jax.Array, keys: jax.Array):
    """`tokens[B, T]` int, `keys[B]` -> `(inputs[B, T], targets[B, T], weights f32[B, T])`.

    `targets` are the original tokens, `weights` 1.0 at the chosen positions, 0 elsewhere.
    """

    def mask_row(row, key):
        choose, fate, rand = jax.random.split(key, 3)
        t = row.shape[0]
        picked = jax.lax.top_k(jax.random.uniform(choose, (t,)), masked_count(t))[1]
        chosen = jnp.zeros((t,), bool).at[picked].set(True)
        u = jax.random.uniform(fate, (t,))
        random_byte = jax.random.randint(rand, (t,), 0, BYTE_VOCAB, row.dtype)
        inputs = jnp.where(chosen & (u < 0.8), MASK_ID, row)
        inputs = jnp.where(chosen & (u >= 0.8) & (u < 0.9), random_byte, inputs)
        return inputs.astype(row.dtype), row, chosen.astype(jnp.float32)

    return jax.vmap(mask_row)(tokens, keys)
