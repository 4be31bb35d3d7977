"""The pure, jitted training step on the (replica, pipeline, tensor) mesh.

Data flow of one optimizer step (global batch G = micro_batch * replica * grad_accum):

    tokens[G, T+1] sharded P("replica")  ->  shard_map over the whole mesh:
        model.inputs_and_targets: GPT next tokens; BERT masked bytes (keys from seed, step, row)
        params: pcast to varying over their reduction axes (once); fetched from host and
                all-gathered over the RTS group right before use; cast to precision.compute
        pipeline == 1: scan over grad_accum micro-batches, value_and_grad each, accumulate
        pipeline  > 1: per pass of train.pipeline_group micro-batches (default: all), embed
                       them, GPipe scan (ppermute between stages), reduce-scatter the last
                       stage's outputs so each stage computes 1/S of the final norm +
                       vocab-parallel loss; value_and_grad per pass, accumulated
        the loss is multiplied by the loss scale before differentiation
        grads: one psum over the reduction axes   -> grads with the params' shardings
    -> under GSPMD (whole-parameter norms): unscale in float32, skip the step if any gradient
       is not finite, optax update, `precision.apply_updates` (stochastic rounding for 16-bit
       master weights, key fold_in(key(train.seed), step)) -> new params, same shardings;
       16-bit masters are updated one layer per stage at a time (`jaxpod.optim.per_layer`)

Precision: params are held in the master dtype (`precision.master_dtype`) and cast to
`precision.compute` for the forward pass (LayerNorm statistics, softmax and cross-entropy in
float32); the float32 defaults are bit-identical to an engine without any of this.

Memory (`jaxpod.parallel.replica`, `jaxpod.parallel.offload`): `memory.rts`/`rts_optimizer`
split weights/optimizer state over replica groups; `memory.offload` and `memory.phases`
(which implies host-resident layers) keep state in host memory and stream it — with
`pipeline == 1` each phase's weights right before it runs, forward and backward (with
`memory.stream=matrix` each step's blocks right before the step: the RTS plan then never
splits the dimension a block is taken along, so blocks are taken before the gather); with
`pipeline > 1` once per step before the GPipe ticks (a transfer inside the tick scan makes
its transpose accumulate host-typed cotangents, which jax 0.10.2 rejects). Sequence
parallelism and `model.sequence_chunks` live in the model (`jaxpod.models.layers`); the
engine gathers the sequence for the loss head, which runs in chunks too. With
`memory.vocab_blocks = k` GPT's token tables are left as stored: the embedding and the loss
head cast and all-gather them a block of rows at a time (`VocabBlocks`).

The state is donated, so params and optimizer state are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config.load import Config, ModelConfig
from jaxpod.engine.layout import TABLES, Layout, make_layout
from jaxpod.models import mlm
from jaxpod.models.layers import token_loss_in_chunks
from jaxpod.optim.chains import STACKED_KEY, make_optimizer
from jaxpod.optim.per_layer import make_update
from jaxpod.optim.precision import LossScaleState, compute_dtype, init_loss_scale, master_dtype
from jaxpod.parallel import offload
from jaxpod.parallel.mesh import param_specs, shardings
from jaxpod.parallel.pipeline import gpipe, spread_over_stages, vary_like
from jaxpod.parallel.replica import gather, reduce_grads, vary_params
from jaxpod.parallel.tensor import VocabBlocks, gather_sequence

F32 = jnp.float32
BATCH_SPEC = P("replica", None)


class OptState(NamedTuple):
    """`tx`: the optax chain's state; `loss_scale`: the `LossScaleState`."""

    tx: optax.OptState
    loss_scale: LossScaleState


class TrainState(NamedTuple):
    """`step` int32[] (optimizer steps taken), `params` (nested dicts, master dtype) and
    `opt_state` (`OptState`)."""

    step: jax.Array
    params: dict
    opt_state: Any


def build_model(cfg: ModelConfig, seed: int) -> nnx.Module:
    """The transformer named by `cfg.name` (gpt or bert), initialised from `seed`."""
    if cfg.name == "bert":
        from jaxpod.models.bert import BERT as Model
    else:
        from jaxpod.models.gpt import GPT as Model
    return Model(cfg, rngs=nnx.Rngs(seed))


def _cast(tree, dtype):
    """Floating leaves in `dtype` (leaves already in it are returned as they are)."""
    return jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), tree)


def abstract_params(cfg: ModelConfig, seed: int = 0, dtype=F32) -> tuple[nnx.GraphDef, dict, dict]:
    """`(graphdef, params as ShapeDtypeStructs, PartitionSpecs)` without materialising weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, seed)))
    params = nnx.to_pure_dict(state)
    if jnp.dtype(dtype) != jnp.dtype(F32):
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), params)
    return graphdef, params, param_specs(state)


def init_params(
    cfg: ModelConfig, seed: int, mesh: Mesh, *, dtype=F32, out_shardings=None
) -> tuple[nnx.GraphDef, dict, dict]:
    """Create the parameters already sharded on `mesh` (jitted init with `out_shardings`).

    The values depend only on `seed` (threefry is partitionable), never on the mesh, and no
    device ever holds more than its own shards. `dtype`: the master dtype (a cast of the
    float32 init); `out_shardings`: where they live (default: the model's specs on `mesh`).
    Returns the model's specs (the layout inside `shard_map`).
    """
    graphdef, _, specs = abstract_params(cfg, seed)
    make = lambda: _cast(nnx.to_pure_dict(nnx.split(build_model(cfg, seed))[1]), dtype)
    out = shardings(mesh, specs) if out_shardings is None else out_shardings
    return graphdef, jax.jit(make, out_shardings=out)(), specs


def _local_functions(
    graphdef: nnx.GraphDef, lay: Layout, cfg: Config, bubble_fill: float, unroll: bool
):
    """Per-device `(loss, loss_and_grads)` for the inside of `shard_map`."""
    tp = "tensor"  # a size-1 axis costs nothing: XLA drops single-device collectives
    stages, micro, micro_batch = (
        lay.mesh.shape["pipeline"],
        cfg.train.grad_accum,
        cfg.train.micro_batch,
    )
    passes = cfg.pipeline_passes  # GPipe passes per step (pipeline > 1)
    total_tokens = cfg.train.global_batch * cfg.model.seq_len
    dtype = compute_dtype(cfg.precision)
    scaling = cfg.precision.loss_scale != "none"
    any_host = any(jax.tree.leaves(lay.host))
    blocks_host = any(jax.tree.leaves(lay.host[STACKED_KEY]))
    rest_host = {k: v for k, v in lay.host.items() if k != STACKED_KEY}
    cast = lambda tree: _cast(tree, dtype)
    sp = cfg.model.sequence_parallel
    # memory.vocab_blocks: GPT's tables stay as stored; embed and head prepare a block at a time
    tables = TABLES if cfg.memory.vocab_blocks > 1 else ()

    def table(name: str) -> dict:  # the `vocab` keyword of embed/token_loss for table `name`
        if name not in tables:
            return {}
        plan = {name: lay.plan[name]}
        prepare = lambda rows: gather(cast({name: rows}), plan, lay.rts_axes)[name]
        return {"vocab": VocabBlocks(cfg.memory.vocab_blocks, prepare)}

    out_table = table("wte" if cfg.model.tie_embeddings else "unembed")
    head = lambda m, h, y: token_loss_in_chunks(m, h, y, tp, cfg.model.sequence_chunks, **out_table)
    embed = lambda m, tokens: m.embed(tokens, tp, **table("wte"))

    def prepare_layer(layer_params, blocks=None):  # a layer's stored slice -> computed with
        layer_params = cast(layer_params)
        return gather(layer_params, lay.plan[STACKED_KEY], lay.rts_axes, leading=1, blocks=blocks)

    def layer_hooks(fetched: bool) -> dict:
        """`model.layers` hooks; `fetched`: the stack is already on the device (pipelined)."""
        hooks = {}
        if lay.rts_axes or dtype != master_dtype(cfg.precision):
            hooks["prepare"] = prepare_layer
        if lay.phases > 1 or blocks_host:  # stream=matrix: each step fetches its own weights
            fetch = offload.to_device if blocks_host and not fetched else None
            hooks.update(phases=lay.phases, fetch=fetch)
        if lay.offload_activations:
            hooks["offload_activations"] = True
        if cfg.memory.stream != "layer":
            hooks.update(stream=cfg.memory.stream, mlp_blocks=cfg.memory.mlp_blocks)
        return hooks

    def model_of(params):  # stored local params -> the model, non-layer weights ready
        rest = {k: v for k, v in params.items() if k != STACKED_KEY}
        rest = jax.tree.map(lambda a, h: offload.to_device(a) if h else a, rest, rest_host)
        plan = {k: v for k, v in lay.plan.items() if k != STACKED_KEY and k not in tables}
        ready = gather(cast({k: v for k, v in rest.items() if k in plan}), plan, lay.rts_axes)
        return nnx.merge(graphdef, {**rest, **ready, STACKED_KEY: params[STACKED_KEY]})

    def examples(params, tokens, step, stream):
        """Local `tokens[B, T+1]` -> micro-batched `(inputs, targets, weights, denominator)`."""
        model = nnx.merge(graphdef, params)
        keys = None
        if model.masked:
            rows = jax.lax.axis_index(lay.batch_axes) * tokens.shape[0]
            keys = mlm.row_keys(cfg.train.seed, step, rows + jnp.arange(tokens.shape[0]), stream)
        inputs, targets, weights = model.inputs_and_targets(tokens, keys)
        split = lambda a: None if a is None else a.reshape(micro, micro_batch, *a.shape[1:])
        if weights is None:
            return split(inputs), split(targets), None, total_tokens
        return (
            split(inputs),
            split(targets),
            split(weights),
            jax.lax.psum(jnp.sum(weights), lay.batch_axes),
        )

    def summed(loss, weights, denominator):
        weighted = loss if weights is None else loss * weights.reshape(loss.shape)
        return jnp.sum(weighted) / denominator

    def micro_loss(params, inputs, targets, weights, denominator):
        model = model_of(params)
        h = model.layers(embed(model, inputs), tp, unroll, **layer_hooks(fetched=False))
        if sp:  # the head's vocab-parallel loss needs every position on every tensor shard
            h = gather_sequence(h, tp)
        return summed(head(model, h, targets), weights, denominator)

    def pipeline_loss(params, inputs, targets, weights, denominator):
        if blocks_host:  # see the module docstring: fetched once per step before the ticks
            params = {**params, STACKED_KEY: offload.to_device(params[STACKED_KEY])}
        model = model_of(params)
        x = embed(model, inputs)  # [M, mb, T, D]; sequence-parallel: [M, mb, T_tensor, D]
        tick_hooks = layer_hooks(fetched=True)
        layers = lambda a: model.layers(a, tp, unroll, **tick_hooks)
        ys = gpipe(layers, x, bubble_fill=bubble_fill, unroll=unroll)
        h = spread_over_stages(ys.reshape(-1, x.shape[-1]))  # [M*mb*T / S, D] (/t with SP)
        stage = jax.lax.axis_index("pipeline")

        def share(a):  # this stage's targets/weights [M, mb, T], in h's order
            if a is None:
                return None
            if not sp:
                return a.reshape(stages, -1)[stage]
            # h will be the concatenation over tensor shards i of (shard i's positions,
            # flattened, this stage's slice): the same permutation, without communication.
            shards = jax.lax.axis_size(tp)
            a = jnp.moveaxis(a.reshape(*a.shape[:-1], shards, -1), -2, 0)  # [t, M, mb, T/t]
            return a.reshape(shards, stages, -1)[:, stage].reshape(-1)

        targets, weights = share(targets), share(weights)
        if sp:  # every tensor shard needs every token for the vocab-parallel head
            h = gather_sequence(h, tp, dim=0)
        return summed(head(model, h, targets), weights, denominator)

    def value_and_grad(fn, scale, *args):
        """(loss, grads of loss * scale), grads on the device."""
        if scaling:
            scaled = lambda *a: (lambda v: (v * scale.astype(v.dtype), v))(fn(*a))
            (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
        else:
            loss, grads = jax.value_and_grad(fn)(*args)
        return loss, offload.to_device(grads) if any_host else grads

    def accumulate(fn, params, scale, batches, denominator):
        """Sum `value_and_grad(fn)` over the leading axis of `batches` (one micro-batch,
        or one pipeline pass of `cfg.pipeline_group` micro-batches, per iteration)."""

        def body(acc, batch):
            loss, grads = value_and_grad(fn, scale, params, *batch, denominator)
            return jax.tree.map(jnp.add, acc, grads), loss

        def zero(p):
            z = jnp.zeros(p.shape, p.dtype)
            return vary_like(z, p)

        zeros = jax.tree.map(zero, params)
        grads, losses = jax.lax.scan(body, zeros, batches, unroll=unroll)
        return jnp.sum(losses), grads

    def loss(params, tokens, scale, step):
        inputs, targets, weights, denominator = examples(params, tokens, step, mlm.EVAL_STREAM)
        params = vary_params(params, lay.store, lay.data_axes)
        if stages == 1:
            losses = jax.lax.map(
                lambda b: micro_loss(params, *b, denominator), (inputs, targets, weights)
            )
            return jax.lax.psum(jnp.sum(losses), lay.data_axes)
        return jax.lax.psum(
            pipeline_loss(params, inputs, targets, weights, denominator), lay.data_axes
        )

    def loss_and_grads(params, tokens, scale, step):
        inputs, targets, weights, denominator = examples(params, tokens, step, mlm.TRAIN_STREAM)
        params = vary_params(params, lay.store, lay.data_axes)
        batches = (inputs, targets, weights)
        if stages == 1:
            loss, grads = accumulate(micro_loss, params, scale, batches, denominator)
        elif passes == 1:
            loss, grads = value_and_grad(pipeline_loss, scale, params, *batches, denominator)
        else:  # [M, ...] -> [passes, M / passes, ...]: one GPipe schedule per pass
            batches = jax.tree.map(lambda a: a.reshape(passes, -1, *a.shape[1:]), batches)
            loss, grads = accumulate(pipeline_loss, params, scale, batches, denominator)
        return jax.lax.psum(loss, lay.data_axes), reduce_grads(grads, lay.store, lay.data_axes)

    return loss, loss_and_grads


def _layout_for(graphdef, specs, cfg: Config, mesh: Mesh) -> Layout:
    _, params, _ = abstract_params(cfg.model, cfg.train.seed)
    return make_layout(cfg, mesh, params, specs)


def make_loss_and_grads(
    graphdef: nnx.GraphDef,
    specs: dict,
    cfg: Config,
    mesh: Mesh,
    *,
    bubble_fill: float = 0.0,
    unroll: bool = False,
    layout: Layout | None = None,
) -> Callable[..., tuple[jax.Array, dict]]:
    """`(params, tokens[G, T+1] P("replica"), scale=1, step=0) -> (mean loss, grads)`, one
    `shard_map`. `grads` (of `scale * loss`) have exactly the params' shardings.

    `step` picks BERT's masks. `bubble_fill` is for tests: the value the pipeline carry
    holds in bubble ticks (it must not matter). `unroll` unrolls every loop so that
    `cost_analysis()` counts the FLOPs of every iteration (benchmarks). `layout`: where the
    params live (default: from `cfg.memory` on `mesh`).
    """
    lay = _layout_for(graphdef, specs, cfg, mesh) if layout is None else layout
    _, local = _local_functions(graphdef, lay, cfg, bubble_fill, unroll)
    fn = jax.shard_map(
        local,
        mesh=lay.mesh,
        in_specs=(lay.store, lay.batch_spec, P(), P()),
        out_specs=(P(), lay.store),
    )

    def loss_and_grads(params, tokens, scale=None, step=None):
        scale = jnp.ones((), F32) if scale is None else scale
        step = jnp.zeros((), jnp.int32) if step is None else step
        return fn(params, tokens, scale, step)

    return loss_and_grads


def make_eval_loss(
    graphdef: nnx.GraphDef, specs: dict, cfg: Config, mesh: Mesh, layout: Layout | None = None
) -> Callable[[dict, jax.Array], jax.Array]:
    """`(params, tokens[G, T+1] P("replica")) -> mean loss`: forward only, same sharding."""
    lay = _layout_for(graphdef, specs, cfg, mesh) if layout is None else layout
    local, _ = _local_functions(graphdef, lay, cfg, 0.0, False)
    fn = jax.shard_map(
        local, mesh=lay.mesh, in_specs=(lay.store, lay.batch_spec, P(), P()), out_specs=P()
    )
    return lambda params, tokens: fn(params, tokens, jnp.ones((), F32), jnp.zeros((), jnp.int32))


def optimizer_shardings(optimizer: optax.GradientTransformation, params: dict, other, like=None):
    """Shardings of `optimizer.init(params)`: per-parameter leaves (moments) take their
    parameter's sharding (or the matching leaf of `like`, a tree of shardings); everything
    else (step counts) gets `other`."""
    abstract = jax.eval_shape(optimizer.init, params)
    like = jax.tree.map(lambda p: p.sharding, params) if like is None else like
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        abstract,
        like,
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
    layout: Layout | None = None


def _state_shardings(cfg: Config, lay: Layout, optimizer, params) -> TrainState:
    replicated = NamedSharding(lay.mesh, P())
    opt_kind = offload.HOST if lay.host_optimizer else None
    moments = shardings(lay.mesh, lay.opt_store, opt_kind)
    tx = optimizer_shardings(optimizer, params, replicated, like=moments)
    ls = LossScaleState(replicated, replicated, replicated)
    return TrainState(replicated, lay.param_shardings(), OptState(tx, ls))


def abstract_engine(cfg: Config, mesh: Mesh) -> tuple[Engine, TrainState]:
    """The engine and its state as `ShapeDtypeStruct`s with shardings: nothing is
    materialised, so any config can be lowered and compiled ahead of time."""
    graphdef, params, specs = abstract_params(
        cfg.model, cfg.train.seed, master_dtype(cfg.precision)
    )
    lay = make_layout(cfg, mesh, params, specs)
    optimizer, lr = make_optimizer(cfg.optim, cfg.train.steps)
    sharding = _state_shardings(cfg, lay, optimizer, params)
    ls = jax.eval_shape(lambda: init_loss_scale(cfg.precision))
    shapes = TrainState(
        jax.ShapeDtypeStruct((), jnp.int32),
        params,
        OptState(jax.eval_shape(optimizer.init, params), ls),
    )
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, sharding
    )
    loss_and_grads = make_loss_and_grads(graphdef, specs, cfg, mesh, layout=lay)
    device_params = offload.with_memory_kind(sharding.params, offload.DEVICE)
    device_tx = offload.with_memory_kind(sharding.opt_state.tx, offload.DEVICE)
    update = make_update(cfg, optimizer)  # layer by layer for 16-bit master weights

    def step(state: TrainState, tokens: jax.Array):
        ls = state.opt_state.loss_scale
        loss, grads = loss_and_grads(state.params, tokens, ls.scale, state.step)
        params, tx = state.params, state.opt_state.tx
        if any(jax.tree.leaves(lay.host)):
            params = jax.device_put(params, device_params)
        if lay.host_optimizer:
            tx = jax.device_put(tx, device_tx)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step)
        params, tx, new_ls, info = update(grads, tx, params, ls, key)
        metrics = {
            "loss": loss,
            "grad_norm": info["grad_norm"],
            "update_norm": jnp.where(info["finite"], info["update_norm"], 0.0),
            "param_norm": optax.tree.norm(params),
            "lr": lr(state.step),
            "loss_scale": ls.scale,
            "skipped_steps": new_ls.skipped,
        }
        params = jax.device_put(params, sharding.params)
        tx = jax.device_put(tx, sharding.opt_state.tx)
        return TrainState(state.step + 1, params, OptState(tx, new_ls)), metrics

    batch_sharding = NamedSharding(lay.mesh, lay.batch_spec)
    train_step = jax.jit(
        step,
        in_shardings=(sharding, batch_sharding),
        out_shardings=(sharding, None),
        donate_argnums=0,
    )
    eval_loss = jax.jit(make_eval_loss(graphdef, specs, cfg, mesh, layout=lay))
    engine = Engine(
        graphdef, specs, optimizer, lr, sharding, batch_sharding, train_step, eval_loss, lay
    )
    return engine, state


def build_engine(cfg: Config, mesh: Mesh) -> tuple[Engine, TrainState]:
    """Initialise sharded params + optimizer state and compile-ready step functions."""
    engine, abstract = abstract_engine(cfg, mesh)
    sharding = engine.state_sharding
    _, params, _ = init_params(
        cfg.model,
        cfg.train.seed,
        mesh,
        dtype=master_dtype(cfg.precision),
        out_shardings=sharding.params,
    )
    tx = jax.jit(engine.optimizer.init, out_shardings=sharding.opt_state.tx)(params)
    ls = jax.device_put(init_loss_scale(cfg.precision), sharding.opt_state.loss_scale)
    step = jax.device_put(jnp.zeros((), jnp.int32), sharding.step)
    return engine, TrainState(step, params, OptState(tx, ls))
