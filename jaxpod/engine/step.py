"""The one engine: a model's stage layout turned into jitted train and eval steps.

    train_step(state, batch) -> (state, metrics)     the state donated: updated in place
    eval_step(params, batch) -> {"val_loss"[, "val_accuracy"]}

One step: `loss_and_grads` in one `shard_map` over the mesh (`jaxpod.engine.loss`), then the
layout's guarded update (`StackedStages.update` under GSPMD, `PackedStages.update` per stage
in `shard_map`). Metrics, one dict for every model: loss, grad_norm, update_norm (0 for a
skipped step), param_norm, lr, loss_scale, skipped_steps, and accuracy for classifiers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config
from jaxpod.engine.loss import local_functions
from jaxpod.engine.state import OptState, TrainState

F32 = jnp.float32


class Engine(NamedTuple):
    """Everything needed to run steps: jitted functions, the shardings they expect, and the
    stage layout (`stages.layout` for stacked models) they were built from."""

    stages: Any  # StackedStages | PackedStages
    state_sharding: TrainState
    batch_sharding: tuple  # one NamedSharding per batch array
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> {"val_loss": ..[, "val_accuracy"]}
    loss_and_grads: Callable  # (params, batch, scale=1, step=0) -> (loss, aux, grads)

    @property
    def schedule(self):
        return self.stages.schedule


def make_engine(stages, cfg: Config, *, bubble_fill: float = 0.0, unroll: bool = False) -> Engine:
    """Jit the steps of `stages` (a `StackedStages` or `PackedStages`). `bubble_fill` is for
    tests: what the pipeline carry holds in bubble ticks (it must not matter); `unroll`
    unrolls every loop so that `cost_analysis()` counts every iteration (benchmarks)."""
    eval_local, train_local = local_functions(stages, cfg, bubble_fill=bubble_fill, unroll=unroll)
    in_specs = (stages.stored_specs, stages.batch_specs, P(), P())
    loss_and_grads_map = jax.shard_map(
        train_local, mesh=stages.mesh, in_specs=in_specs,
        out_specs=(P(), P(), stages.stored_specs),
    )  # fmt: skip
    eval_map = jax.shard_map(
        eval_local, mesh=stages.mesh, in_specs=in_specs[:2] + (P(),), out_specs=P()
    )

    def loss_and_grads(params, batch, scale=None, step=None):
        scale = jnp.ones((), F32) if scale is None else scale
        step = jnp.zeros((), jnp.int32) if step is None else step
        return loss_and_grads_map(params, batch, scale, step)

    def train_step(state: TrainState, batch):
        ls = state.opt_state.loss_scale
        loss, aux, grads = loss_and_grads_map(state.params, batch, ls.scale, state.step)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step)
        params, tx, new_ls, info = stages.update(grads, state.opt_state.tx, state.params, ls, key)
        metrics = {
            "loss": loss,
            "grad_norm": info["grad_norm"],
            "update_norm": jnp.where(info["finite"], jnp.sqrt(info["update_sq"]), 0.0),
            "param_norm": info["param_norm"],
            "lr": stages.schedule(state.step),
            "loss_scale": ls.scale,
            "skipped_steps": new_ls.skipped,
        }
        if "correct" in aux:
            metrics["accuracy"] = aux["correct"] / cfg.global_batch
        return TrainState(state.step + 1, params, OptState(tx, new_ls)), metrics

    def eval_step(params, batch):
        loss, aux = eval_map(params, batch, jnp.zeros((), jnp.int32))
        out = {"val_loss": loss}
        if "correct" in aux:
            out["val_accuracy"] = aux["correct"] / cfg.global_batch
        return out

    sharding = stages.state_shardings()
    batch_sharding = tuple(NamedSharding(stages.mesh, s) for s in stages.batch_specs)
    train = jax.jit(
        train_step,
        in_shardings=(sharding, batch_sharding),
        out_shardings=(sharding, None),
        donate_argnums=0,
    )
    return Engine(stages, sharding, batch_sharding, train, jax.jit(eval_step), loss_and_grads)
