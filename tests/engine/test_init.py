"""The state's init compiles as a program that runs once (`compile_once`: LLVM -O1 on CPU,
~40 % less compile time) and computes exactly what the default compile computes: every bit of
the params and the optimizer state of the tiny GPT (float32 and float16 masters), BERT and
EfficientNet configs (test_pinned's one-device cases, whose inits the compilation cache
serves).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FP16_LARS, GPT16, TINY_VISION, grouped_cases

CASES = {
    "gpt": GPT16,
    "gpt-fp16": (*GPT16, *FP16_LARS),
    "bert": (*GPT16, "model.name=bert", "model.vocab=264"),
    "effnet": (*TINY_VISION, "model.pipeline_splits=[]"),
}


@pytest.mark.parametrize("name", grouped_cases(CASES))
def test_the_init_computes_the_default_compiles_bits(name, tiny_cfg, mesh_for, monkeypatch):
    from jaxpod.engine import build_engine
    from jaxpod.engine import state as state_module

    cfg = tiny_cfg(*CASES[name], mesh=(1, 1, 1))
    _, once = build_engine(cfg, mesh_for(cfg))
    monkeypatch.setattr(state_module, "INIT_OPTIONS", {})
    _, default = build_engine(cfg, mesh_for(cfg))
    got, want = (
        jax.device_get((once.params, once.opt_state)),
        jax.device_get((default.params, default.opt_state)),
    )
    paths = jax.tree_util.tree_leaves_with_path(want)
    assert len(paths) == len(jax.tree.leaves(got))
    assert sum(np.size(w) for _, w in paths) > 20_000  # the whole model, not an empty tree
    for (path, w), g in zip(paths, jax.tree.leaves(got), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_the_init_options_reach_the_compiler():
    """`compile_once` builds another executable than the default (the option took effect)
    with the same values."""
    from jaxpod.engine.state import compile_once

    fn = lambda: jax.random.truncated_normal(jax.random.key(0), -2.0, 2.0, (256,), jnp.float32)
    once, default = compile_once(fn, None), jax.jit(fn).lower().compile()
    assert once.runtime_executable().serialize() != default.runtime_executable().serialize()
    np.testing.assert_array_equal(once(), default())
