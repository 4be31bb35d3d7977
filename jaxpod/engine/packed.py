"""Packed stages: models whose pipeline stages differ, each packed into rows of its device.

A CNN's stages are not identical layers (stage 0: stem + early blocks on big, thin
activations; stage 1: late blocks + head), so they cannot be one stack. Instead
(`jaxpod.parallel.packing.StagePacking`):

    params   {dtype: [S, n_max]}  P("pipeline", None)   row s = stage s's tree, flattened
    batch    (images uint8[G, H, W, 3], labels int32[G])  P("replica"); normalised on device
    carry    float32 [mb, A]: A = the largest per-image activation crossing a stage boundary
    stage    lax.switch(stage index, [stage_0, ..., stage_S-1]) on the carry, per GPipe tick
    head     cross-entropy of the last stage's logits (and the correct count)
    update   inside `shard_map`: each stage's optax chain on its own unpacked tree (trust
             ratios over whole parameters: a stage's parameters are whole on its devices),
             the new rows rounded back in one go (stochastic rounding for 16-bit rows)

Every replica computes the same update (same reduced grads, same rounding keys).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config
from jaxpod.engine.loss import Examples
from jaxpod.engine.state import OptState, TrainState, compile_once, put_global, with_shardings
from jaxpod.models.family import family
from jaxpod.models.params import masks
from jaxpod.optim.chains import make_optimizer
from jaxpod.optim.guarded import guarded_update, unscaled_sum_squares
from jaxpod.optim.precision import (
    LossScaleState,
    cast_tree_like,
    compute_dtype,
    init_loss_scale,
    master_dtype,
    param_dtype,
    select_tree,
    sum_squares,
    to_float32,
)
from jaxpod.parallel.packing import StagePacking
from jaxpod.parallel.remat import remat

ROW = P("pipeline", None)
_NOTHING = jax.checkpoint_policies.nothing_saveable


def _stage_modules(cfg: Config) -> list:
    pr = cfg.precision
    return family(cfg.model.name).build(
        cfg.model,
        rngs=nnx.Rngs(cfg.train.seed),
        dtype=compute_dtype(pr),
        param_dtype=master_dtype(pr),
    )


class PackedStages:
    """A packed-stage model on a mesh: its stage rows, optimizers and the pieces of its loss."""

    def __init__(self, cfg: Config, mesh: Mesh, *, unroll: bool = False):
        self.cfg, self.mesh, self.unroll = cfg, mesh, unroll
        abstract = nnx.eval_shape(lambda: nnx.List(_stage_modules(cfg)))
        split = [nnx.split(stage) for stage in abstract]
        self.graphdefs = [g for g, _ in split]
        trees = [nnx.to_pure_dict(s) for _, s in split]
        self.masks = [masks(s) for _, s in split]
        self.optimizers = [
            make_optimizer(cfg.optim, cfg.train.steps, decay_mask=m.decay, clip=False)[0]
            for m in self.masks
        ]
        self.lr_schedule = make_optimizer(cfg.optim, cfg.train.steps)[1]
        self.packing = StagePacking(trees)
        inits = zip(self.optimizers, trees, strict=True)
        self.opt_packing = StagePacking([jax.eval_shape(opt.init, t) for opt, t in inits])
        self.io_shapes = self._io_shapes(trees)
        self.carry_size = max(max(math.prod(i), math.prod(o)) for i, o in self.io_shapes)
        self.params_count = sum(leaf.size for leaf in jax.tree.leaves(trees))
        self.data_axes = ("replica", "pipeline")
        self.stored_specs = {k: ROW for k in self.packing.row_sizes}
        self.batch_specs = (P("replica"), P("replica"))
        self.stage_fns = [self._stage_fn(k) for k in range(self.packing.num_stages)]

    def _io_shapes(self, trees) -> list:
        """Per stage, (input shape, output shape) of one image (no batch dimension)."""
        size = self.cfg.model.image_size
        shape, out = (size, size, 3), []
        for graphdef, tree in zip(self.graphdefs, trees, strict=True):
            x = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
            y = jax.eval_shape(lambda t, x, g=graphdef: nnx.merge(g, t)(x), tree, x)
            out.append((shape, tuple(y.shape[1:])))
            shape = tuple(y.shape[1:])
        return out

    # ------------------------------------------------------------------ state and shardings
    def _specs(self) -> TrainState:
        rows = lambda packing: {k: ROW for k in packing.row_sizes}  # noqa: E731
        ls = LossScaleState(P(), P(), P())
        return TrainState(P(), rows(self.packing), OptState(rows(self.opt_packing), ls))

    def state_shardings(self) -> TrainState:
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._specs(), is_leaf=is_spec)

    def abstract_state(self) -> TrainState:
        ls = jax.eval_shape(lambda: init_loss_scale(self.cfg.precision))
        step = jax.ShapeDtypeStruct((), jnp.int32)
        tx = self.opt_packing.abstract()
        shapes = TrainState(step, self.packing.abstract(), OptState(tx, ls))
        return with_shardings(shapes, self.state_shardings())

    def init_state(self) -> TrainState:
        """Params (and optimizer state) initialised straight into their stage rows."""
        sharding = self.state_shardings()

        def init_rows():
            trees = [nnx.to_pure_dict(nnx.split(s)[1]) for s in _stage_modules(self.cfg)]
            opt = [o.init(t) for o, t in zip(self.optimizers, trees, strict=True)]
            return self.packing.pack(trees), self.opt_packing.pack(opt)

        params, tx = compile_once(init_rows, (sharding.params, sharding.opt_state.tx))()
        ls = put_global(init_loss_scale(self.cfg.precision), sharding.opt_state.loss_scale)
        step = put_global(jnp.zeros((), jnp.int32), sharding.step)
        return TrainState(step, params, OptState(tx, ls))

    layer_order = None  # the stages' rows hold their blocks in network order

    def reordered(self, state: TrainState, saved_order: list[int] | None) -> TrainState:
        """`state` as is: packed stages are never stored in another order."""
        return state

    # ------------------------------------------------------------------ inside shard_map
    def examples(self, params, batch: tuple, step, stream: int) -> Examples:
        images, labels = batch
        micro, mb = self.cfg.part_micro, self.cfg.train.micro_batch
        inputs = images.reshape(micro, mb, *images.shape[1:])
        return Examples(inputs, labels.reshape(micro, mb), None, self.cfg.global_batch)

    def _stage_fn(self, k: int):
        """Stage k: `(params row {dtype: [n]}, carry f32[mb, A]) -> f32[mb, A]`."""
        (shape_in, _), graphdef = self.io_shapes[k], self.graphdefs[k]
        work = param_dtype(self.cfg.precision)

        def stage(row, carry):
            tree = jax.tree.map(lambda a: a.astype(work), self.packing.unpack(row, k))
            x = carry[:, : math.prod(shape_in)].reshape(carry.shape[0], *shape_in)
            y = nnx.merge(graphdef, tree)(x).astype(jnp.float32).reshape(carry.shape[0], -1)
            return jnp.pad(y, ((0, 0), (0, self.carry_size - y.shape[1])))

        return remat(stage, self.cfg.model.remat)

    def _embed(self, images):
        """uint8 `[..., H, W, 3]` -> the float32 carry `[..., A]` (normalised, zero padded)."""
        x = family(self.cfg.model.name).prepare_inputs(images, jnp.float32)
        x = x.reshape(*images.shape[:-3], -1)
        pad = [(0, 0)] * (x.ndim - 1) + [(0, self.carry_size - x.shape[-1])]
        return jnp.pad(x, pad)

    def _head(self, carry, labels, weights, denominator):
        logits = carry[..., : self.cfg.model.num_classes]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        correct = jnp.sum(jnp.argmax(logits, -1) == labels)
        return jnp.sum(ce) / denominator, {"correct": correct}

    def forward(self, params, pipelined: bool):
        """`(embed, stage, head)`. Pipelined, every tick runs `lax.switch` over the stages,
        recomputed from its input in the backward pass (otherwise autodiff saves the union
        of every branch's residuals, zeros for the branches not taken, for every tick), and
        only the last stage's head counts."""
        rows = {k: v[0] for k, v in params.items()}
        if not pipelined:
            return self._embed, partial(self.stage_fns[0], rows), self._head
        stage = jax.lax.axis_index("pipeline")
        branches = [partial(fn, rows) for fn in self.stage_fns]
        switched = jax.checkpoint(
            lambda a: jax.lax.switch(stage, branches, a), policy=_NOTHING, prevent_cse=False
        )
        tick = lambda a, r=0: switched(a)  # noqa: E731 (no virtual stages)
        last = stage == self.packing.num_stages - 1

        def pipelined_head(ys, labels, weights, denominator):
            loss, aux = self._head(ys, labels, weights, denominator)
            return jnp.where(last, loss, 0.0), {"correct": jnp.where(last, aux["correct"], 0)}

        return self._embed, tick, pipelined_head

    def pipeline_functions(self, params):
        """For schedules that differentiate stage by stage (1F1B): `(embed(p, images),
        stage(p, carry), head(p, carry, labels, weights, denominator), params)`."""

        def stage(p, carry):
            rows = {k: v[0] for k, v in p.items()}
            branches = [partial(fn, rows) for fn in self.stage_fns]
            return jax.lax.switch(jax.lax.axis_index("pipeline"), branches, carry)

        embed = lambda p, images: self._embed(images)  # noqa: E731
        head = lambda p, *a: self._head(*a)  # noqa: E731
        return embed, stage, head, params

    def weight_split(self, params) -> None:
        """Packed stages differ by stage (a `lax.switch` of them): no per-layer split; their
        W recomputes the stage and takes its vjp with respect to the parameters."""
        return None

    # ------------------------------------------------------------------ the update
    def _stage_update(self, k, rows, grads, opt_rows, key):
        """Stage k's optax update on its unpacked trees; the new rows are rounded back in one
        go (stochastic rounding of the whole row for 16-bit buffers, exact for float32)."""
        f32, stages = jnp.float32, self.packing.num_stages
        p = self.packing.unpack(rows, k)
        g = to_float32(self.packing.unpack(grads, k))
        o = self.opt_packing.unpack(opt_rows, k)
        updates, new_o = self.optimizers[k].update(g, to_float32(o), to_float32(p))
        u_row = self.packing.pack_row(updates, k, float_dtype=f32)
        new_p32 = {n: rows[n].astype(f32) + u_row[n] for n in rows}
        new_rows = cast_tree_like(new_p32, rows, jax.random.fold_in(key, k))
        new_o_row = self.opt_packing.pack_row(new_o, k, float_dtype=f32)
        new_opt = cast_tree_like(new_o_row, opt_rows, jax.random.fold_in(key, stages + k))
        return new_rows, new_opt, sum_squares(u_row)

    def update(self, grads, tx, params, loss_scale, key):
        """The guarded update inside `shard_map`, each stage on its own devices (module
        docstring). Returns `(params, tx, loss_scale, info)` like `StackedStages.update`."""
        cfg, stages = self.cfg, self.packing.num_stages
        first = lambda tree: {k: v[0] for k, v in tree.items()}  # noqa: E731
        total = lambda x: jax.lax.psum(x, "pipeline")  # noqa: E731

        def apply(ready, finite, grads, opt_rows, rows, key):
            index = jax.lax.axis_index("pipeline")
            branches = [partial(self._stage_update, k) for k in range(stages)]
            args = (rows, ready(grads), opt_rows, key)
            new_rows, new_opt, u2 = jax.lax.switch(index, branches, *args)
            new_rows = select_tree(finite, new_rows, rows)
            new_opt = select_tree(finite, new_opt, opt_rows)
            return new_rows, new_opt, total(jnp.where(finite, u2, 0.0))

        def local_update(grads, tx, params, loss_scale, key):
            rows, opt_rows, ls, info = guarded_update(
                apply,
                first(grads),
                first(tx),
                first(params),
                loss_scale,
                key,
                cfg.precision,
                max_norm=cfg.optim.grad_clip,
                grad_sum_squares=unscaled_sum_squares,
                total=total,
            )
            info["param_norm"] = jnp.sqrt(total(sum_squares(rows)))
            stack = lambda tree: {k: v[None] for k, v in tree.items()}  # noqa: E731
            return stack(rows), stack(opt_rows), ls, info

        specs = self._specs()
        return jax.shard_map(
            local_update,
            mesh=self.mesh,
            in_specs=(specs.params, specs.opt_state.tx, specs.params, P(), P()),
            out_specs=(specs.params, specs.opt_state.tx, P(), P()),
        )(grads, tx, params, loss_scale, key)
