"""The pure, jitted training step on the (replica, pipeline, tensor) mesh.

Data flow of one optimizer step (global batch G = micro_batch * replica * grad_accum):

    tokens[G, T+1] sharded P("replica")  ->  shard_map over the whole mesh:
        params: pcast to varying over their reduction axes (once)
        pipeline == 1: scan over grad_accum micro-batches, value_and_grad each, accumulate
        pipeline  > 1: embed all micro-batches, GPipe scan (ppermute between stages),
                       reduce-scatter the last stage's outputs so each stage computes 1/S of
                       the final norm + vocab-parallel loss; one value_and_grad over it all
        grads: one psum over the reduction axes   -> grads with the params' shardings
    -> optax update under GSPMD (whole-parameter norms) -> new params, same shardings

The state is donated, so params and optimizer state are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config, ModelConfig
from jaxpod.mesh import param_specs, shardings
from jaxpod.models.gpt import GPT
from jaxpod.optim import make_optimizer
from jaxpod.parallel.pipeline import gpipe, spread_over_stages, vary_like
from jaxpod.parallel.replica import DATA_AXES, reduce_grads, vary_params

BATCH_SPEC = P("replica", None)


class TrainState(NamedTuple):
    """`step` int32[] (optimizer steps taken), `params` and `opt_state` (nested dicts)."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    return GPT(cfg, rngs=nnx.Rngs(seed))


def abstract_params(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, dict, dict]:
    """`(graphdef, params as ShapeDtypeStructs, PartitionSpecs)` without materialising weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed)))
    return graphdef, nnx.to_pure_dict(state), param_specs(state)


def init_params(cfg: ModelConfig, seed: int, mesh: Mesh) -> tuple[nnx.GraphDef, dict, dict]:
    """Create the parameters already sharded on `mesh` (jitted init with `out_shardings`).

    The values depend only on `seed` (threefry is partitionable), never on the mesh, and no
    device ever holds more than its own shards.
    """
    graphdef, _, specs = abstract_params(cfg, seed)
    make = lambda: nnx.to_pure_dict(nnx.split(build_model(cfg, seed))[1])
    params = jax.jit(make, out_shardings=shardings(mesh, specs))()
    return graphdef, params, specs


def _local_functions(
    graphdef: nnx.GraphDef, specs: dict, cfg: Config, mesh: Mesh, bubble_fill: float, unroll: bool
):
    """Per-device `(loss, loss_and_grads)` for the inside of `shard_map`."""
    tp = "tensor"  # a size-1 axis costs nothing: XLA drops single-device collectives
    stages, micro, micro_batch = mesh.shape["pipeline"], cfg.train.grad_accum, cfg.train.micro_batch
    total_tokens = cfg.train.global_batch * cfg.model.seq_len

    def micro_loss(params, tokens):  # tokens[mb, T+1] -> summed loss / all tokens of the step
        model = nnx.merge(graphdef, params)
        h = model.layers(model.embed(tokens[:, :-1], tp), tp, unroll)
        return jnp.sum(model.token_loss(h, tokens[:, 1:], tp)) / total_tokens

    def accumulate(params, tokens):  # pipeline == 1: an accumulation loop over micro-batches
        def body(acc, mb_tokens):
            loss, grads = jax.value_and_grad(micro_loss)(params, mb_tokens)
            return jax.tree.map(jnp.add, acc, grads), loss

        zeros = jax.tree.map(lambda p: vary_like(jnp.zeros_like(p), p), params)
        grads, losses = jax.lax.scan(body, zeros, tokens, unroll=unroll)
        return jnp.sum(losses), grads

    def pipeline_loss(params, tokens):  # pipeline > 1: GPipe over the micro-batches
        model = nnx.merge(graphdef, params)
        x = model.embed(tokens[..., :-1], tp)  # [M, mb, T, D]
        ys = gpipe(lambda a: model.layers(a, tp, unroll), x, bubble_fill=bubble_fill, unroll=unroll)
        h = spread_over_stages(ys.reshape(-1, x.shape[-1]))  # [M*mb*T / S, D]
        targets = tokens[..., 1:].reshape(stages, -1)[jax.lax.axis_index("pipeline")]
        return jnp.sum(model.token_loss(h, targets, tp)) / total_tokens

    def loss(params, tokens):
        tokens = tokens.reshape(micro, micro_batch, -1)
        params = vary_params(params, specs)
        if stages == 1:
            losses = jax.lax.map(lambda t: micro_loss(params, t), tokens)
            return jax.lax.psum(jnp.sum(losses), DATA_AXES)
        return jax.lax.psum(pipeline_loss(params, tokens), DATA_AXES)

    def loss_and_grads(params, tokens):
        tokens = tokens.reshape(micro, micro_batch, -1)
        params = vary_params(params, specs)
        if stages == 1:
            loss, grads = accumulate(params, tokens)
        else:
            loss, grads = jax.value_and_grad(pipeline_loss)(params, tokens)
        return jax.lax.psum(loss, DATA_AXES), reduce_grads(grads, specs)

    return loss, loss_and_grads


def make_loss_and_grads(
    graphdef: nnx.GraphDef,
    specs: dict,
    cfg: Config,
    mesh: Mesh,
    *,
    bubble_fill: float = 0.0,
    unroll: bool = False,
) -> Callable[[dict, jax.Array], tuple[jax.Array, dict]]:
    """`(params, tokens[G, T+1] P("replica")) -> (mean loss, grads)`, one `shard_map`.

    `grads` have exactly the params' shardings. `bubble_fill` is for tests: the value the
    pipeline carry holds in bubble ticks (it must not matter). `unroll` unrolls every loop
    so that `cost_analysis()` counts the FLOPs of every iteration (benchmarks).
    """
    _, local = _local_functions(graphdef, specs, cfg, mesh, bubble_fill, unroll)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, BATCH_SPEC), out_specs=(P(), specs))


def make_eval_loss(
    graphdef: nnx.GraphDef, specs: dict, cfg: Config, mesh: Mesh
) -> Callable[[dict, jax.Array], jax.Array]:
    """`(params, tokens[G, T+1] P("replica")) -> mean loss`: forward only, same sharding."""
    local, _ = _local_functions(graphdef, specs, cfg, mesh, 0.0, False)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, BATCH_SPEC), out_specs=P())


def optimizer_shardings(optimizer: optax.GradientTransformation, params: dict, other):
    """Shardings of `optimizer.init(params)`: per-parameter leaves (moments) take their
    parameter's sharding; everything else (step counts) gets `other`."""
    abstract = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(
        optimizer,
        lambda _, p: p.sharding,
        abstract,
        params,
        transform_non_params=lambda _: other,
    )


class Engine(NamedTuple):
    """Everything needed to run steps: jitted functions and the shardings they expect."""

    graphdef: nnx.GraphDef
    specs: dict
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_sharding: TrainState
    batch_sharding: NamedSharding
    train_step: Callable  # (state, tokens) -> (state, metrics)
    eval_loss: Callable  # (params, tokens) -> loss


def build_engine(cfg: Config, mesh: Mesh) -> tuple[Engine, TrainState]:
    """Initialise sharded params + optimizer state and compile-ready step functions."""
    graphdef, params, specs = init_params(cfg.model, cfg.train.seed, mesh)
    optimizer, lr = make_optimizer(cfg.optim, cfg.train.steps)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.jit(
        optimizer.init, out_shardings=optimizer_shardings(optimizer, params, replicated)
    )(params)
    state = TrainState(jax.device_put(jnp.zeros((), jnp.int32), replicated), params, opt_state)
    state_sharding = jax.tree.map(lambda a: a.sharding, state)
    loss_and_grads = make_loss_and_grads(graphdef, specs, cfg, mesh)

    def step(state: TrainState, tokens: jax.Array):
        loss, grads = loss_and_grads(state.params, tokens)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "param_norm": optax.tree.norm(params),
            "lr": lr(state.step),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sharding = NamedSharding(mesh, BATCH_SPEC)
    train_step = jax.jit(
        step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
        donate_argnums=0,
    )
    eval_loss = jax.jit(make_eval_loss(graphdef, specs, cfg, mesh))
    engine = Engine(
        graphdef, specs, optimizer, lr, state_sharding, batch_sharding, train_step, eval_loss
    )
    return engine, state
