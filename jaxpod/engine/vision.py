"""The image-classifier train step: a heterogeneous pipeline with the whole step in shard_map.

A CNN's pipeline stages differ (stage 0: stem + early blocks on big, thin activations;
stage 1: late blocks + head), so they cannot be one stacked layer scanned like the
transformer's. Instead (see `jaxpod.parallel.stages`):

    params  {dtype: [S, n_max]}  P("pipeline", None)   row s = stage s's tree, flattened
    images  uint8[G, H, W, 3]    P("replica")          normalised on the device
    labels  int32[G]             P("replica")

    shard_map over the mesh, per device (stage s = axis_index("pipeline")):
      loss: GPipe over the grad_accum micro-batches (in passes of train.pipeline_group,
            gradients summed over the passes); each tick runs
            lax.switch(s, [stage_0, ..., stage_S-1]) on a float32 carry [mb, A]
            (A = the largest per-image activation crossing a stage boundary, or the image);
            the last stage's logits give the cross-entropy; with S == 1 an accumulation loop
      grads: unscaled (loss scaling), psum over `replica` (one all-reduce per dtype buffer)
      update: finite check and global norm psum'd over `pipeline`, then
            lax.switch(s, [update_0, ...]) unpacks the stage's params + optimizer state, runs
            the optax chain (LARS trust ratios per whole parameter: a stage's parameters are
            whole on its devices), and applies the update with stochastic rounding when the
            master weights are 16-bit; an overflowing step leaves everything unchanged.

Every replica computes the same update (same reduced grads, same rounding keys).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config.load import Config
from jaxpod.models.efficientnet import build_stages
from jaxpod.optim.chains import clip_by_norm, make_optimizer
from jaxpod.optim.precision import (
    LossScaleState,
    all_finite,
    cast_tree_like,
    compute_dtype,
    init_loss_scale,
    master_dtype,
    param_dtype,
    select_tree,
    sum_squares,
    to_float32,
    update_loss_scale,
)
from jaxpod.parallel.pipeline import gpipe, vary_like
from jaxpod.parallel.remat import remat
from jaxpod.parallel.stages import StagePacking
from jaxpod.run.images import normalize

ROW = P("pipeline", None)
_NOTHING = jax.checkpoint_policies.nothing_saveable
BATCH = P("replica")


class VisionState(NamedTuple):
    """`step` int32[]; `params`/`opt_state` per-dtype stage buffers `[S, n]`; loss scale."""

    step: jax.Array
    params: dict
    opt_state: dict  # {"tx": {dtype: [S, m]}, "loss_scale": LossScaleState}


class VisionModel(NamedTuple):
    """The static description of the pipelined network (no arrays)."""

    graphdefs: list  # per stage
    packing: StagePacking  # params layout
    opt_packing: StagePacking  # optimizer-state layout
    io_shapes: list  # per stage (input shape, output shape) of one image, no batch dim
    carry_size: int  # A: per-image floats the pipeline carry holds
    params: int  # real parameter count (no padding)


def _stages(cfg: Config) -> list:
    md, pr = cfg.model, cfg.precision
    return build_stages(
        md.variant,
        splits=list(md.pipeline_splits),
        num_classes=md.num_classes,
        g16=md.g16,
        groups=md.norm_groups,
        width_mult=md.width_mult,
        depth_mult=md.depth_mult,
        dtype=compute_dtype(pr),
        param_dtype=master_dtype(pr),
        rngs=nnx.Rngs(cfg.train.seed),
    )


def _split(stages: list) -> tuple[list, list]:
    pairs = [nnx.split(stage) for stage in stages]
    return [g for g, _ in pairs], [nnx.to_pure_dict(s) for _, s in pairs]


def vision_model(cfg: Config, optimizer: optax.GradientTransformation) -> VisionModel:
    """Shapes only (nothing materialised): graphdefs, layouts, stage I/O shapes."""
    graphdefs, trees = _split(nnx.eval_shape(lambda: nnx.List(_stages(cfg))))
    size = cfg.model.image_size
    shape = (size, size, 3)
    io_shapes = []
    for graphdef, tree in zip(graphdefs, trees, strict=True):
        x = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
        out = jax.eval_shape(lambda t, x, g=graphdef: nnx.merge(g, t)(x), tree, x)
        io_shapes.append((shape, tuple(out.shape[1:])))
        shape = tuple(out.shape[1:])
    carry = max(max(math.prod(i), math.prod(o)) for i, o in io_shapes)
    opt_packing = StagePacking([jax.eval_shape(optimizer.init, t) for t in trees])
    count = sum(leaf.size for leaf in jax.tree.leaves(trees))
    return VisionModel(graphdefs, StagePacking(trees), opt_packing, io_shapes, carry, count)


def init_vision_state(cfg: Config, vm: VisionModel, optimizer, mesh: Mesh) -> VisionState:
    """Params (and optimizer state) initialised straight into their stage rows."""
    row = NamedSharding(mesh, ROW)
    replicated = NamedSharding(mesh, P())

    def make():
        _, trees = _split(_stages(cfg))
        return vm.packing.pack(trees), vm.opt_packing.pack([optimizer.init(t) for t in trees])

    params, opt = jax.jit(make, out_shardings=(row, row))()
    loss_scale = jax.device_put(init_loss_scale(cfg.precision), replicated)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return VisionState(step, params, {"tx": opt, "loss_scale": loss_scale})


def _stage_fns(cfg: Config, vm: VisionModel) -> list[Callable]:
    """Per stage: (params row {dtype: [n]}, carry f32[mb, A]) -> f32[mb, A]."""
    work = param_dtype(cfg.precision)

    def make(k):
        (shape_in, _), graphdef = vm.io_shapes[k], vm.graphdefs[k]

        def run(row, carry):
            tree = jax.tree.map(lambda a: a.astype(work), vm.packing.unpack(row, k))
            x = carry[:, : math.prod(shape_in)].reshape(carry.shape[0], *shape_in)
            y = nnx.merge(graphdef, tree)(x).astype(jnp.float32).reshape(carry.shape[0], -1)
            return jnp.pad(y, ((0, 0), (0, vm.carry_size - y.shape[1])))

        return remat(run, cfg.model.remat)

    return [make(k) for k in range(vm.packing.num_stages)]


def _local_loss_and_grads(cfg: Config, vm: VisionModel, bubble_fill: float = 0.0):
    """Per device: `(rows {dtype: [n]}, images uint8[B, H, W, 3], labels[B], scale) ->
    ((loss, correct), grads of scale * loss)`; loss is this device's share of the mean CE
    (psum over replica and pipeline totals it), grads are this replica's partial grads.
    Also returns the forward-only `(loss, correct)` function for evaluation."""
    stages, fns = vm.packing.num_stages, _stage_fns(cfg, vm)
    micro, mb = cfg.train.grad_accum, cfg.train.micro_batch
    passes = cfg.pipeline_passes  # GPipe passes per step (pipeline > 1)
    classes, total = cfg.model.num_classes, cfg.global_batch

    def head(logits, labels):  # logits f32[..., C]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(ce) / total, jnp.sum(jnp.argmax(logits, -1) == labels)

    def inputs(images):  # uint8 [B, H, W, 3] -> f32 [B / mb, mb, A]
        x = normalize(images, jnp.float32).reshape(-1, mb, images[0].size)
        return jnp.pad(x, ((0, 0), (0, 0), (0, vm.carry_size - x.shape[-1])))

    def forward(rows, images, labels):  # -> (loss share, correct share)
        labels = labels.reshape(-1, mb)
        if stages == 1:
            losses, correct = jax.lax.map(
                lambda xl: head(fns[0](rows, xl[0])[:, :classes], xl[1]), (inputs(images), labels)
            )
            return jnp.sum(losses), jnp.sum(correct)
        stage = jax.lax.axis_index("pipeline")
        branches = [partial(fn, rows) for fn in fns]
        # The tick is recomputed from its input in the backward pass: otherwise autodiff saves
        # the union of every branch's residuals (zeros for the branches not taken) for every
        # tick, which multiplies memory and compile time by the number of stages.
        tick = jax.checkpoint(
            lambda a: jax.lax.switch(stage, branches, a), policy=_NOTHING, prevent_cse=False
        )
        ys = gpipe(tick, inputs(images), bubble_fill=bubble_fill)
        loss, correct = head(ys[..., :classes], labels)
        last = stage == stages - 1
        return jnp.where(last, loss, 0.0), jnp.where(last, correct, 0)

    def scaled(fn, scale):
        def f(*args):
            loss, correct = fn(*args)
            return loss * scale, (loss, correct)

        return f

    def loss_and_grads(rows, images, labels, scale):
        if stages > 1 and passes == 1:
            (_, aux), grads = jax.value_and_grad(scaled(forward, scale), has_aux=True)(
                rows, images, labels
            )
            return aux, grads

        def micro_loss(r, x, y):
            return head(fns[0](r, x)[:, :classes], y)

        def body(acc, xl):  # one micro-batch, or one GPipe pass of `group` micro-batches
            (_, aux), g = jax.value_and_grad(scaled(fn, scale), has_aux=True)(rows, *xl)
            return jax.tree.map(jnp.add, acc, g), aux

        if stages == 1:
            fn, batches = micro_loss, (inputs(images), labels.reshape(micro, mb))
        else:  # the local batch in `passes` contiguous groups of micro-batches
            fn = forward
            batches = (images.reshape(passes, -1, *images.shape[1:]), labels.reshape(passes, -1))
        zeros = jax.tree.map(lambda r: vary_like(jnp.zeros_like(r), r), rows)
        grads, (losses, correct) = jax.lax.scan(body, zeros, batches)
        return (jnp.sum(losses), jnp.sum(correct)), grads

    return forward, loss_and_grads


def _local_step(cfg: Config, vm: VisionModel, optimizer, schedule, bubble_fill: float = 0.0):
    """The whole optimizer step for the inside of `shard_map` (see the module docstring)."""
    stages = vm.packing.num_stages
    _, loss_and_grads = _local_loss_and_grads(cfg, vm, bubble_fill)
    clip = cfg.optim.grad_clip

    def update(k, rows, grads, opt_rows, key):
        """Stage k's optax update; the new rows are rounded back to their dtypes in one go
        (stochastic rounding of the whole row for 16-bit buffers, exact for float32)."""
        f32 = jnp.float32
        p = vm.packing.unpack(rows, k)
        g = to_float32(vm.packing.unpack(grads, k))
        o = vm.opt_packing.unpack(opt_rows, k)
        updates, new_o = optimizer.update(g, to_float32(o), to_float32(p))
        u_row = vm.packing.pack_row(updates, k, float_dtype=f32)
        new_p32 = {n: rows[n].astype(f32) + u_row[n] for n in rows}
        new_rows = cast_tree_like(new_p32, rows, jax.random.fold_in(key, k))
        new_o_row = vm.opt_packing.pack_row(new_o, k, float_dtype=f32)
        new_opt = cast_tree_like(new_o_row, opt_rows, jax.random.fold_in(key, stages + k))
        return new_rows, new_opt, sum_squares(u_row), sum_squares(new_rows)

    def step(state: VisionState, images, labels):
        rows = {k: v[0] for k, v in state.params.items()}
        opt_rows = {k: v[0] for k, v in state.opt_state["tx"].items()}
        ls: LossScaleState = state.opt_state["loss_scale"]
        varying = jax.tree.map(lambda r: jax.lax.pcast(r, ("replica",), to="varying"), rows)
        (loss, correct), grads = loss_and_grads(varying, images, labels, ls.scale)
        grads = jax.tree.map(lambda g: jax.lax.psum(g, "replica"), grads)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / ls.scale, grads)
        finite = jax.lax.pmin(all_finite(grads).astype(jnp.int32), "pipeline") > 0
        grad_norm = jnp.sqrt(jax.lax.psum(sum_squares(grads), "pipeline"))
        if clip > 0:
            grads = clip_by_norm(grads, grad_norm, clip)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step)
        stage = jax.lax.axis_index("pipeline")
        branches = [partial(update, k) for k in range(stages)]
        new_rows, new_opt, u2, p2 = jax.lax.switch(stage, branches, rows, grads, opt_rows, key)
        new_rows = select_tree(finite, new_rows, rows)
        new_opt = select_tree(finite, new_opt, opt_rows)
        new_ls = update_loss_scale(ls, finite, cfg.precision)
        metrics = {
            "loss": jax.lax.psum(loss, ("replica", "pipeline")),
            "accuracy": jax.lax.psum(correct, ("replica", "pipeline")) / cfg.global_batch,
            "grad_norm": grad_norm,
            "update_norm": jnp.sqrt(jax.lax.psum(jnp.where(finite, u2, 0.0), "pipeline")),
            "param_norm": jnp.sqrt(jax.lax.psum(p2, "pipeline")),
            "lr": schedule(state.step),
            "loss_scale": ls.scale,
            "skipped_steps": new_ls.skipped,
        }
        new_state = VisionState(
            state.step + 1,
            {k: v[None] for k, v in new_rows.items()},
            {"tx": {k: v[None] for k, v in new_opt.items()}, "loss_scale": new_ls},
        )
        return new_state, metrics

    return step


class VisionEngine(NamedTuple):
    """Same roles as `jaxpod.engine.transformer.Engine`, for image classifiers; batches are
    `(images uint8[G, H, W, 3], labels int32[G])` sharded over `replica`."""

    model: VisionModel
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    state_sharding: VisionState
    batch_sharding: NamedSharding
    train_step: Callable  # (state, (images, labels)) -> (state, metrics)
    eval_batch: Callable  # (params, (images, labels)) -> (mean loss, correct count)


def _state_specs(vm: VisionModel) -> VisionState:
    return VisionState(
        P(),
        {k: ROW for k in vm.packing.row_sizes},
        {
            "tx": {k: ROW for k in vm.opt_packing.row_sizes},
            "loss_scale": LossScaleState(P(), P(), P()),
        },
    )


def abstract_vision_state(vm: VisionModel, mesh: Mesh) -> VisionState:
    """The state as `ShapeDtypeStruct`s with their shardings (for AOT lowering)."""
    specs = _state_specs(vm)
    i32, f32 = jnp.int32, jnp.float32
    shapes = VisionState(
        jax.ShapeDtypeStruct((), i32),
        vm.packing.abstract(),
        {
            "tx": vm.opt_packing.abstract(),
            "loss_scale": LossScaleState(*(jax.ShapeDtypeStruct((), t) for t in (f32, i32, i32))),
        },
    )
    return jax.tree.map(
        lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        shapes,
        specs,
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )


def make_vision_engine(cfg: Config, mesh: Mesh, *, bubble_fill: float = 0.0) -> VisionEngine:
    """The jitted step/eval functions and shardings; no arrays are created."""
    optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps, clip=False)
    vm = vision_model(cfg, optimizer)
    specs = _state_specs(vm)
    local = _local_step(cfg, vm, optimizer, schedule, bubble_fill)
    stepper = jax.shard_map(
        lambda st, batch: local(st, *batch),
        mesh=mesh,
        in_specs=(specs, (BATCH, BATCH)),
        out_specs=(specs, P()),
    )
    state_sharding = jax.tree.map(
        lambda a: a.sharding,
        abstract_vision_state(vm, mesh),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
    )
    batch_sharding = NamedSharding(mesh, BATCH)
    train_step = jax.jit(
        stepper,
        in_shardings=(state_sharding, (batch_sharding, batch_sharding)),
        out_shardings=(state_sharding, None),
        donate_argnums=0,
    )
    forward, _ = _local_loss_and_grads(cfg, vm)

    def local_eval(params, batch):
        loss, correct = forward({k: v[0] for k, v in params.items()}, *batch)
        return jax.lax.psum(loss, ("replica", "pipeline")), jax.lax.psum(
            correct, ("replica", "pipeline")
        )

    eval_batch = jax.jit(
        jax.shard_map(
            local_eval, mesh=mesh, in_specs=(specs.params, (BATCH, BATCH)), out_specs=(P(), P())
        )
    )
    return VisionEngine(
        vm, optimizer, schedule, state_sharding, batch_sharding, train_step, eval_batch
    )


def build_vision_engine(
    cfg: Config, mesh: Mesh, *, bubble_fill: float = 0.0
) -> tuple[VisionEngine, VisionState]:
    """The engine and its initial state: packed, stage-sharded params and optimizer state."""
    engine = make_vision_engine(cfg, mesh, bubble_fill=bubble_fill)
    return engine, init_vision_state(cfg, engine.model, engine.optimizer, mesh)
