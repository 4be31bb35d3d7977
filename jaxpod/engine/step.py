"""The one engine: a model's stage layout turned into jitted train and eval steps.

    train_step(state, batch) -> (state, metrics)     the state donated: updated in place
    eval_step(params, batch) -> {"val_loss"[, "val_accuracy"]}

One step: a `DeviceLoss`'s `loss_and_grads` in one `shard_map` over the mesh
(`jaxpod.engine.loss`), then the layout's guarded update (`StackedStages.update` under GSPMD,
`PackedStages.update` per stage in `shard_map`). Metrics, one dict for every model: loss,
grad_norm, update_norm (0 for a skipped step), param_norm, lr, loss_scale, skipped_steps,
and accuracy for classifiers.

With `train.batch_parts` = k > 1 a step is k calls, each on 1/k of the batch (`run_step`):

    first_part_step(state, part) -> (grad_sum, {"loss"[, "correct"]})
    accumulate_step(state, part, grad_sum) -> (grad_sum, {"loss"[, "correct"]})
    train_step(state, last part, grad_sum) -> (state, metrics)   the state donated

The parts' losses are divided by the whole batch's count, so their sums are the batch's
loss and gradients. Between calls only `grad_sum` lives: each device's own sum of its parts'
gradients, not yet reduced over the replicas (one gradient copy, the stored layout with a
leading axis of one entry a device); the last call adds it and reduces once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config
from jaxpod.engine.loss import DeviceLoss, device_loss
from jaxpod.engine.state import OptState, TrainState
from jaxpod.parallel.replica import reduction_axes

F32 = jnp.float32


class Engine(NamedTuple):
    """Everything needed to run steps: jitted functions, the shardings they expect, and the
    stage layout (`stages.placement` for stacked models) they were built from."""

    stages: Any  # StackedStages | PackedStages
    state_sharding: TrainState
    batch_sharding: tuple  # one NamedSharding per batch array
    train_step: Callable  # (state, batch[, grad_sum]) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> {"val_loss": ..[, "val_accuracy"]}
    loss_and_grads: Callable  # (params, batch, scale=1, step=0) -> (loss, aux, grads)
    first_part_step: Callable | None  # batch_parts > 1: (state, part) -> (grad_sum, sums)
    accumulate_step: Callable | None  # batch_parts > 1: (state, part, grad_sum) -> the same

    @property
    def lr_schedule(self):
        """The learning rate of each optimizer step (an optax schedule)."""
        return self.stages.lr_schedule

    def updating_arguments(self, state: TrainState, batch: tuple) -> tuple:
        """The arguments of the call that updates, to lower it: `(state, batch)`, and in parts
        the earlier parts' summed gradients (abstract, with their shardings)."""
        if self.first_part_step is None:
            return state, batch
        return state, batch, jax.eval_shape(self.first_part_step, state, batch)[0]

    def run_step(
        self, state: TrainState, parts: Iterable, dispatched: Callable | None = None
    ) -> tuple[TrainState, dict]:
        """One optimizer step on `parts`, the batch's `train.batch_parts` parts in order: the
        earlier parts' gradients summed by `accumulate_step`, the last part's `train_step`
        adding them and updating; loss and accuracy are the parts' sums. A part is taken from
        `parts` just before its call and not held after it; `dispatched(outputs)` is told each
        call's small outputs (never donated) once it is dispatched (`jaxpod.data.feed`)."""
        parts, told = iter(parts), dispatched or (lambda outputs: None)
        if self.accumulate_step is None:
            state, metrics = self.train_step(state, next(parts))
            told(metrics)
            return state, metrics
        grad_sum, out = self.first_part_step(state, next(parts))
        told(out)
        sums = [out]
        for _ in range(self.stages.cfg.train.batch_parts - 2):
            grad_sum, out = self.accumulate_step(state, next(parts), grad_sum)
            told(out)
            sums.append(out)
        state, metrics = self.train_step(state, next(parts), grad_sum)
        told(metrics)
        metrics = {**metrics, "loss": metrics["loss"] + sum(o["loss"] for o in sums)}
        if "accuracy" in metrics:
            metrics["accuracy"] += sum(o["correct"] for o in sums) / self.stages.cfg.global_batch
        return state, metrics


def make_engine(stages, cfg: Config, *, bubble_fill: float = 0.0, unroll: bool = False) -> Engine:
    """Jit the steps of `stages` (a `StackedStages` or `PackedStages`). `bubble_fill` is for
    tests: what the pipeline carry holds in bubble ticks (it must not matter); `unroll`
    unrolls every loop so that `cost_analysis()` counts every iteration (benchmarks)."""
    maps = _shard_maps(stages, device_loss(stages, cfg, bubble_fill=bubble_fill, unroll=unroll))

    def loss_and_grads(params, batch, scale=None, step=None):
        """`(loss, aux, grads)` of a whole batch; scale 1 and step 0 unless given."""
        scale = jnp.ones((), F32) if scale is None else scale
        step = jnp.zeros((), jnp.int32) if step is None else step
        return maps.loss_and_grads(params, batch, scale, step)

    sharding = stages.state_shardings()
    batch_sharding = tuple(NamedSharding(stages.mesh, s) for s in stages.batch_specs)
    train_step = _train_step(stages, cfg, maps)
    first = accumulate = None
    if cfg.train.batch_parts == 1:
        train = jax.jit(
            train_step,
            in_shardings=(sharding, batch_sharding),
            out_shardings=(sharding, None),
            donate_argnums=0,
        )
    else:  # the unreduced gradient sum: one entry a device (`_Maps.sum_specs`)
        sums = jax.tree.map(
            lambda s: NamedSharding(stages.mesh, s), maps.sum_specs, is_leaf=_is_spec
        )
        train = jax.jit(
            train_step,
            in_shardings=(sharding, batch_sharding, sums),
            out_shardings=(sharding, None),
            donate_argnums=0,
        )
        accumulate_step = _accumulate_step(maps)
        accumulate = jax.jit(
            accumulate_step,
            in_shardings=(sharding, batch_sharding, sums),
            out_shardings=(sums, None),
            donate_argnums=2,
        )
        first = jax.jit(
            accumulate_step, in_shardings=(sharding, batch_sharding), out_shardings=(sums, None)
        )
    evaluate = jax.jit(_eval_step(cfg, maps))
    return Engine(
        stages, sharding, batch_sharding, train, evaluate, loss_and_grads, first, accumulate
    )


def _is_spec(x) -> bool:
    """A `PartitionSpec` is a leaf of a tree of specs (it is a tuple)."""
    return isinstance(x, P)


class _Maps(NamedTuple):
    """A `DeviceLoss` in `shard_map`s over the whole mesh: params as stored
    (`stages.stored_specs`), the batch as `stages.batch_specs`, scalars replicated.

    `loss_and_grads(params, batch, scale, step) -> (loss, aux, grads)` and `evaluate(params,
    batch, step) -> (loss, aux)` for a whole batch; with `train.batch_parts`, `first(params,
    part, scale, step)`, `accumulate(..., grad_sum)` -> `(loss, aux, grad_sum)` and `last(...,
    grad_sum) -> (loss, aux, grads)`. `grad_sum` is the earlier parts' gradient sum, not yet
    reduced: each device keeps its own, laid out as stored with a leading axis over the
    gradient's reduction axes (`sum_specs`, one entry a device); `last` adds it and reduces
    once."""

    loss_and_grads: Callable
    evaluate: Callable
    first: Callable
    accumulate: Callable
    last: Callable
    sum_specs: Any


def _shard_maps(stages, device: DeviceLoss) -> _Maps:
    """`device`'s functions in `shard_map` over `stages.mesh` (`_Maps`)."""
    in_specs = (stages.stored_specs, stages.batch_specs, P(), P())
    loss_and_grads = jax.shard_map(
        device.loss_and_grads,
        mesh=stages.mesh,
        in_specs=in_specs,
        out_specs=(P(), P(), stages.stored_specs),
    )
    evaluate = jax.shard_map(
        device.eval_loss, mesh=stages.mesh, in_specs=in_specs[:2] + (P(),), out_specs=P()
    )
    sum_specs = jax.tree.map(
        lambda s: P(reduction_axes(s, stages.data_axes) or None, *s),
        stages.stored_specs,
        is_leaf=_is_spec,
    )

    def part_map(with_sum: bool, reduce: bool):
        out = stages.stored_specs if reduce else sum_specs
        return jax.shard_map(
            functools.partial(_part_local, device.loss_and_grads, reduce=reduce),
            mesh=stages.mesh,
            in_specs=(*in_specs, sum_specs) if with_sum else in_specs,
            out_specs=(P(), P(), out),
        )

    first = part_map(with_sum=False, reduce=False)
    accumulate = part_map(with_sum=True, reduce=False)
    last = part_map(with_sum=True, reduce=True)
    return _Maps(loss_and_grads, evaluate, first, accumulate, last, sum_specs)


def _part_local(loss_and_grads, params, batch, scale, step, grad_sum=None, *, reduce: bool):
    """A part's `loss_and_grads` on one device, its `grad_sum` (`_Maps`) without the leading
    one-entry axis inside `shard_map`, and put back on the gradients it returns unreduced."""
    grad_sum = None if grad_sum is None else jax.tree.map(lambda g: g[0], grad_sum)
    loss, aux, grads = loss_and_grads(params, batch, scale, step, grad_sum, reduce)
    return loss, aux, grads if reduce else jax.tree.map(lambda g: g[None], grads)


def _train_step(stages, cfg: Config, maps: _Maps) -> Callable:
    """`train_step(state, batch[, grad_sum]) -> (state, metrics)`: loss and gradients (the
    earlier parts' `grad_sum` added before the one reduction), then the layout's guarded
    update with the step's key, and the metrics of the module docstring."""

    def train_step(state: TrainState, batch, grad_sum=None):
        ls = state.opt_state.loss_scale
        args = (state.params, batch, ls.scale, state.step)
        if grad_sum is None:
            loss, aux, grads = maps.loss_and_grads(*args)
        else:  # the earlier parts' unreduced gradients, added before the one reduction
            loss, aux, grads = maps.last(*args, grad_sum)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step)
        params, tx, new_ls, info = stages.update(grads, state.opt_state.tx, state.params, ls, key)
        metrics = {
            "loss": loss,
            "grad_norm": info["grad_norm"],
            "update_norm": jnp.where(info["finite"], jnp.sqrt(info["update_sq"]), 0.0),
            "param_norm": info["param_norm"],
            "lr": stages.lr_schedule(state.step),
            "loss_scale": ls.scale,
            "skipped_steps": new_ls.skipped,
        }
        if "correct" in aux:
            metrics["accuracy"] = aux["correct"] / cfg.global_batch
        return TrainState(state.step + 1, params, OptState(tx, new_ls)), metrics

    return train_step


def _accumulate_step(maps: _Maps) -> Callable:
    """`accumulate_step(state, part[, grad_sum]) -> (grad_sum, sums)`: a part's gradients
    added to the earlier parts' `grad_sum` (none: the first part), unreduced (`_Maps`), and
    its `{"loss"[, "correct"]}`, both sums."""

    def accumulate_step(state: TrainState, batch, grad_sum=None):
        ls = state.opt_state.loss_scale
        args = (state.params, batch, ls.scale, state.step)
        if grad_sum is None:
            loss, aux, grads = maps.first(*args)
        else:
            loss, aux, grads = maps.accumulate(*args, grad_sum)
        return grads, {"loss": loss, **({"correct": aux["correct"]} if "correct" in aux else {})}

    return accumulate_step


def _eval_step(cfg: Config, maps: _Maps) -> Callable:
    """`eval_step(params, batch) -> {"val_loss"[, "val_accuracy"]}` of a whole batch."""

    def eval_step(params, batch):
        loss, aux = maps.evaluate(params, batch, jnp.zeros((), jnp.int32))
        out = {"val_loss": loss}
        if "correct" in aux:
            out["val_accuracy"] = aux["correct"] / cfg.global_batch
        return out

    return eval_step
