"""A model family is a plug-in: a toy family defined here (a stack of residual MLP layers over
a token table) reaches the engine through `jaxpod.models.family.register` alone, and trains on
a (1, 2, 2) mesh (two pipeline stages, tensor-parallel MLPs and vocabulary) equal to the plain
model on one device, from the same initial parameters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.lab import (
    BASE,
    GRAD_TOL,
    OPTIM,
    assert_loss_close,
    assert_params_close,
    assert_trees_close,
    batch,
    copy_tree,
    put,
    reference_optimizer,
    update_bound,
)

from jaxpod.config.kinds import ModelKind
from jaxpod.engine import build_engine
from jaxpod.models.family import Family, build_model, family, register
from jaxpod.models.layers import apply_layers
from jaxpod.models.params import NO_DECAY, TABLE, param
from jaxpod.parallel.tensor import column_dense, row_dense, vocab_cross_entropy, vocab_embed

pytestmark = pytest.mark.engine  # compiles whole train steps
NAME = "toy-mlp"
STEPS = 2


class ToyLayer(nnx.Module):
    """`x + relu(x @ w_in + b_in) @ w_out`: `w_in[L, D, F]`, `w_out[L, F, D]` split over the
    hidden units (`mlp`), the one `psum` in `row_dense`."""

    def __init__(self, d: int, f: int, layers: int, rngs: nnx.Rngs):
        normal = lambda *shape: 0.05 * jax.random.normal(rngs.params(), shape)  # noqa: E731
        self.w_in = param(normal(layers, d, f), ("layers", "embed", "mlp"))
        self.b_in = param(jnp.zeros((layers, f)), ("layers", "mlp"), NO_DECAY)
        self.w_out = param(normal(layers, f, d), ("layers", "mlp", "embed"))

    def __call__(self, x: jax.Array, tp: str | None = None) -> jax.Array:
        h = jax.nn.relu(column_dense(x, self.w_in[...], self.b_in[...]))
        return x + row_dense(h, self.w_out[...], None, tp)


class ToyModel(nnx.Module):
    """A token table `wte[V, D]` (vocab-parallel, tied to the output) around the stack."""

    masked = False

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        table = 0.05 * jax.random.normal(rngs.params(), (cfg.vocab, cfg.d_model))
        self.wte = param(table, ("vocab", "embed"), TABLE)
        self.layers = ToyLayer(cfg.d_model, cfg.d_ff, cfg.layers, rngs)

    def embed(self, tokens, tp=None):
        return vocab_embed(tokens, self.wte[...], tp)

    def inputs_and_targets(self, tokens, keys=None):
        return tokens[..., :-1], tokens[..., 1:], None

    def token_loss(self, h, targets, tp=None):
        return vocab_cross_entropy(h, self.wte[...], targets, tp)

    def __call__(self, tokens):
        """The plain mean next-token loss of `tokens[B, T+1]` on one device."""
        inputs, targets, _ = self.inputs_and_targets(tokens)
        return jnp.mean(self.token_loss(apply_layers(self.layers, self.embed(inputs)), targets))


@pytest.fixture(scope="module")
def toy_cfg(tiny_cfg):
    register(NAME, Family(ModelKind("tokens", "stacked", True, True), ToyModel))
    assert family(NAME).build is ToyModel
    cfg = tiny_cfg(*BASE, *OPTIM["sgd"], "optim.lr=0.5", mesh=(1, 2, 2))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=NAME))


def test_the_toy_family_trains_on_a_mesh_equal_to_one_device(toy_cfg, mesh_for):
    engine, state = build_engine(toy_cfg, mesh_for(toy_cfg))
    params = jax.device_get(state.params)
    graphdef = nnx.graphdef(build_model(toy_cfg.model, toy_cfg.train.seed))
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, t: nnx.merge(graphdef, p)(t)))
    opt, _ = reference_optimizer(toy_cfg)
    opt_state = opt.init(params)
    for k in range(STEPS):
        loss, grads = value_and_grad(params, batch(k))
        updates, opt_state = opt.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        if k == 0:  # the sharded gradients, before any update
            _, _, got = engine.loss_and_grads(copy_tree(state.params), put(engine, batch(k)))
            assert_trees_close(jax.device_get(got), grads, GRAD_TOL, "toy grads")
        state, metrics = engine.train_step(state, put(engine, batch(k)))
        assert_loss_close(metrics["loss"], loss, f"toy loss, step {k}")
        bound = update_bound("sgd", grads, toy_cfg.optim.lr)
        assert_params_close(jax.device_get(state.params), new, params, bound, f"toy step {k}")
        params = new
    assert np.isfinite(float(metrics["loss"]))
