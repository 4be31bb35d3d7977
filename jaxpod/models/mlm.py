"""Masked-language-model examples from token windows, on the device, deterministic.

BERT trains on the same corpora as GPT, as bytes or tokenized (`data.tokenizer`: the BPE
jaxpod trains for BERT holds `[MASK]` as a special id, `model.mask_id` names it in a
tokenizer.json); each window of `seq_len + 1` ids gives one example of its first `seq_len`.
In every row exactly `round(0.15 * seq_len)` positions (at least 1) are chosen; of those,
80 % are replaced by the `[MASK]` id (`model.mask_id`, resolved by the config), 10 % by a
random id (a byte with the byte tokenizer, any id of the vocabulary otherwise), 10 % kept
(each chosen position draws its fate independently). The loss is taken on the chosen
positions only.

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

MASK_ID = BYTE_VOCAB  # with the byte tokenizer: 256, the first id after the byte values
MASK_FRACTION = 0.15


def check_vocab(vocab: int, mask_id: int = MASK_ID) -> None:
    """BERT's vocabulary must hold its `[MASK]` id (256 after the bytes by default)."""
    if vocab <= mask_id:
        raise ConfigError(
            f"model.vocab={vocab} has no room for the [MASK] id {mask_id} of model.name=bert; "
            f"use model.vocab>={mask_id + 1} rounded up to a multiple of mesh.tensor (e.g. 264)"
        )


def random_ids(vocab: int, mask_id: int) -> int:
    """How many ids a random replacement draws from: the bytes when `[MASK]` is the byte
    tokenizer's, else the whole vocabulary."""
    return BYTE_VOCAB if mask_id == MASK_ID else vocab


def masked_count(seq_len: int) -> int:
    """Positions chosen per row: round(0.15 * seq_len), at least 1."""
    return max(1, round(MASK_FRACTION * seq_len))


def mask_tokens(
    tokens: jax.Array, keys: jax.Array, mask_id: int = MASK_ID, replace_ids: int = BYTE_VOCAB
):
    """`tokens[B, T]` int, `keys[B]` -> `(inputs[B, T], targets[B, T], weights f32[B, T])`.

    `targets` are the original tokens, `weights` 1.0 at the chosen positions, 0 elsewhere;
    masked positions hold `mask_id`, randomized ones an id below `replace_ids`.
    """

    def mask_row(row, key):
        choose, fate, rand = jax.random.split(key, 3)
        t = row.shape[0]
        picked = jax.lax.top_k(jax.random.uniform(choose, (t,)), masked_count(t))[1]
        chosen = jnp.zeros((t,), bool).at[picked].set(True)
        u = jax.random.uniform(fate, (t,))
        random_id = jax.random.randint(rand, (t,), 0, replace_ids, row.dtype)
        inputs = jnp.where(chosen & (u < 0.8), mask_id, row)
        inputs = jnp.where(chosen & (u >= 0.8) & (u < 0.9), random_id, inputs)
        return inputs.astype(row.dtype), row, chosen.astype(jnp.float32)

    return jax.vmap(mask_row)(tokens, keys)
