"""BERT's masking (`jaxpod.models.mlm`): exact, deterministic, independent of the mesh; and a
vocabulary without room for the [MASK] id is refused when the config is loaded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpod.errors import ConfigError
from jaxpod.models import mlm
from jaxpod.models.family import row_keys


def test_masking_rule():
    """Exactly round(0.15 T) positions per row; of them ~80 % [MASK], ~10 % random, ~10 %
    kept (binomial 5-sigma bounds over 64k chosen positions); unchosen positions untouched;
    deterministic in (seed, step, row) and different across steps and rows."""
    t, rows = 64, 4096
    tokens = np.random.default_rng(0).integers(0, 256, (rows, t), np.int32)
    keys = row_keys(0, 5, jnp.arange(rows))
    inputs, targets, weights = map(np.asarray, jax.jit(mlm.mask_tokens)(tokens, keys))
    n = mlm.masked_count(t)
    assert n == 10 and np.all(weights.sum(1) == n)
    np.testing.assert_array_equal(targets, tokens)
    chosen = weights > 0
    np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])
    total = chosen.sum()
    for frac, what in [(0.8, inputs == mlm.MASK_ID), (0.1, (inputs == tokens) & chosen)]:
        got = float((what & chosen).sum()) / total
        sigma = np.sqrt(frac * (1 - frac) / total)
        assert abs(got - (frac + (0.1 * 1 / 256 if frac == 0.1 else 0))) <= 5 * sigma, (frac, got)
    assert np.all(inputs <= mlm.MASK_ID)
    again = np.asarray(mlm.mask_tokens(tokens[:8], row_keys(0, 5, jnp.arange(8)))[2])
    np.testing.assert_array_equal(again, weights[:8])
    other_step = np.asarray(mlm.mask_tokens(tokens[:8], row_keys(0, 6, jnp.arange(8)))[2])
    assert not np.array_equal(other_step, weights[:8])
    assert not np.array_equal(weights[0], weights[1])


def test_vocab_without_mask_id_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match=r"model.vocab=256: BERT .*\[MASK\]"):
        tiny_cfg("model.name=bert", mesh=(1, 1, 1))  # refused when the config is loaded


def test_a_tokenizers_mask_and_random_ids():
    """With a BPE's `[MASK]` (id 1) the masked positions hold 1 and the random ones draw from
    the whole vocabulary; with the bytes' (256) only bytes: `random_ids` decides."""
    vocab, t, rows = 1024, 64, 2048
    tokens = np.random.default_rng(1).integers(2, vocab, (rows, t), np.int32)
    keys = row_keys(0, 3, jnp.arange(rows))
    replace = mlm.random_ids(vocab, 1)
    inputs, _, weights = map(
        np.asarray, jax.jit(mlm.mask_tokens, static_argnums=(2, 3))(tokens, keys, 1, replace)
    )
    chosen = weights > 0
    masked = chosen & (inputs == 1)
    assert replace == vocab and 0.75 < masked.sum() / chosen.sum() < 0.85
    randomized = chosen & ~masked & (inputs != tokens)
    assert inputs[randomized].max() >= 256  # drawn beyond the bytes
    assert mlm.random_ids(vocab, mlm.MASK_ID) == 256
