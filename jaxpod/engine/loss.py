"""Loss and gradients for every model, inside one `shard_map` over the whole mesh: a
`DeviceLoss` (`device_loss`) is one device's part of the step.

The skeleton is the same for stacked and packed stage layouts (`Stages`); a layout supplies
the pieces: `examples` (the local batch as micro-batches), `forward` (this device's `embed`,
`stage` and `head`), `data_axes` (what gradients are summed over).

    pipeline == 1: scan over the micro-batches: value_and_grad of head(stage(embed(x)))
                   each, gradients summed
    pipeline  > 1: per pass of `train.pipeline_group` micro-batches (default all), the
                   `train.pipeline_schedule` table (`jaxpod.parallel.schedules`):
                   gpipe, circular: embed them, `forward_ticks(stage)` (ppermute between
                   stages), the layout's pipelined head, value_and_grad of the whole
                   1f1b: `train_ticks`, which differentiates stage by stage itself
                   gradients summed over the passes
    the loss is multiplied by the loss scale before differentiation; then one psum of the
    loss and of each gradient over its reduction axes (with `train.batch_parts`, of the
    gradients only in the last part's call, after the earlier parts' unreduced sum is added).

Parameters are `pcast` to varying over their reduction axes once, before the loss, so no
reduction happens inside the micro-batch loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpod.config import Config
from jaxpod.models.family import EVAL_STREAM, TRAIN_STREAM
from jaxpod.parallel import offload
from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.pipeline import forward_ticks
from jaxpod.parallel.pipeline_chunks import train_chunk_ticks
from jaxpod.parallel.pipeline_train import train_ticks
from jaxpod.parallel.remat import saving
from jaxpod.parallel.replica import reduce_grads, vary_params
from jaxpod.parallel.schedules import (
    BACKWARD_INPUT,
    STEPWISE,
    Schedule,
    forward_only,
    make_schedule,
)
from jaxpod.parallel.weight_split import StageSplit


class Examples(NamedTuple):
    """A device's batch as micro-batches: `inputs`, `targets`, `weights` (or None) with a
    leading `[M, mb]`, and `denominator`, what the summed loss is divided by."""

    inputs: jax.Array
    targets: jax.Array
    weights: jax.Array | None
    denominator: Any


class Stages(Protocol):
    """How a model's pipeline stages are laid out (`StackedStages`, `PackedStages`)."""

    mesh: Mesh
    data_axes: tuple[str, ...]
    stored_specs: Any
    batch_specs: tuple

    def examples(self, params, batch: tuple, step: jax.Array, stream: int) -> Examples: ...

    def forward(self, params, pipelined: bool) -> tuple[Callable, Callable, Callable]: ...

    def pipeline_functions(self, params) -> tuple[Callable, Callable, Callable, Any]: ...

    def weight_split(self, params) -> StageSplit | None: ...


def device_loss(stages: Stages, cfg: Config, *, bubble_fill: float, unroll: bool) -> DeviceLoss:
    """The per-device loss and gradients of `stages` under `cfg` (`DeviceLoss`): the
    training pipeline table (pipeline > 1) and the remat policy its skipped bubbles keep."""
    n_stages = stages.mesh.shape["pipeline"]
    kind, virtual = cfg.train.pipeline_schedule, cfg.train.virtual_stages
    schedule = make_schedule(kind, n_stages, cfg.pipeline_group, virtual) if n_stages > 1 else None
    saves = saving(cfg.model.remat, offload="activations" in cfg.memory.offload)
    return DeviceLoss(stages, cfg, schedule, saves, bubble_fill, unroll)


class DeviceLoss(NamedTuple):
    """A device's part of the step, for the inside of `shard_map` (module docstring):

    `eval_loss(params, batch, step) -> (loss, aux)`; `loss_and_grads(params, batch, scale,
    step) -> (loss, aux, grads of scale * loss)`, all summed over the data axes. `aux` holds
    the head's extra sums (a classifier's `correct` count). `params` and `batch` are this
    device's shards (`stages.stored_specs`, `stages.batch_specs`); `schedule` is the
    training pipeline table (None: one stage), `saves` the remat policy of a skipped bubble's
    cond, `bubble_fill` what the pipeline carry holds in bubbles (tests: it must not
    matter), `unroll` unrolls every loop (cost analysis)."""

    stages: Stages
    cfg: Config
    schedule: Schedule | None
    saves: Callable | None
    bubble_fill: float
    unroll: bool

    def eval_loss(self, params, batch, step):
        """(loss, aux) of the batch, summed over the data axes: the micro-batches one by one,
        or pipelined by the schedule itself (GPipe for tables with backward ops)."""
        stages, cfg = self.stages, self.cfg
        ex = stages.examples(params, batch, step, EVAL_STREAM)
        params = vary_params(params, stages.stored_specs, stages.data_axes)
        micro = (ex.inputs, ex.targets, ex.weights)
        if self.schedule is None:
            outs = jax.lax.map(lambda b: self.micro_loss(params, *b, ex.denominator), micro)
            return self.summed(jax.tree.map(jnp.sum, outs))
        kind = cfg.train.pipeline_schedule
        n_stages, virtual = stages.mesh.shape["pipeline"], cfg.train.virtual_stages
        if kind == "zb-v":  # its forwards only, run as they were trained
            table = forward_only(make_schedule(kind, n_stages, cfg.part_micro, virtual))
            zero = jnp.zeros((), jnp.float32)
            (loss, aux), _ = self.pipeline_train(zero, params, *micro, ex.denominator, table)
            return self.summed((loss, aux))
        # the forward-only table with the training one's layer placement
        kind = "circular" if kind == "interleaved-1f1b" else kind
        kind = "gpipe" if kind in STEPWISE else kind
        table = make_schedule(kind, n_stages, cfg.part_micro, virtual)
        return self.summed(self.pipeline_loss(params, *micro, ex.denominator, table=table))

    def loss_and_grads(self, params, batch, scale, step, partial=None, reduce=True):
        """(loss, aux, grads). `partial`: this device's unreduced gradient sum of the batch's
        earlier parts, added before the reduction; `reduce=False` returns the unreduced sum
        (`train.batch_parts`: the replicas reduce once a step, in the last part's call)."""
        stages, passes = self.stages, self.cfg.pipeline_passes
        ex = stages.examples(params, batch, step, TRAIN_STREAM)
        params = vary_params(params, stages.stored_specs, stages.data_axes)
        batches = (ex.inputs, ex.targets, ex.weights)
        if self.schedule is None:
            out, grads = self.accumulate(params, scale, batches, ex.denominator)
        elif passes == 1:
            out, grads = self.pass_grads(scale, params, *batches, ex.denominator)
        else:  # [M, ...] -> [passes, M / passes, ...]: one pipeline schedule per pass
            batches = jax.tree.map(lambda a: a.reshape(passes, -1, *a.shape[1:]), batches)
            out, grads = self.accumulate(params, scale, batches, ex.denominator)
        loss, aux = self.summed(out)
        if partial is not None:
            grads = jax.tree.map(jnp.add, partial, grads)
        if not reduce:
            return loss, aux, grads
        allreduce, bucket = self.cfg.parallel.grad_allreduce, self.cfg.parallel.grad_bucket_bytes
        grads = reduce_grads(
            grads, stages.stored_specs, stages.data_axes, allreduce=allreduce, bucket_bytes=bucket
        )
        return loss, aux, grads

    def micro_loss(self, params, inputs, targets, weights, denominator):
        """(loss, aux) of one micro-batch on one stage: head(stage(embed(x)))."""
        embed, stage, head = self.stages.forward(params, pipelined=False)
        return head(stage(embed(inputs)), targets, weights, denominator)

    def pipeline_loss(self, params, inputs, targets, weights, denominator, table=None):
        """(loss, aux) of the micro-batches `[M, mb, ...]` through a forward-only pipeline
        `table` (default the training one): embedded, `forward_ticks` (ppermute between
        stages), then the layout's pipelined head."""
        embed, stage, head = self.stages.forward(params, pipelined=True)
        ys = forward_ticks(
            stage,
            embed(inputs),
            self.schedule if table is None else table,
            bubble_fill=self.bubble_fill,
            unroll=self.unroll,
            skip_bubbles=self.cfg.train.skip_bubbles,
            saves=self.saves,
        )
        return head(ys, targets, weights, denominator)

    def pipeline_train(self, scale, params, inputs, targets, weights, denominator, table=None):
        """((loss, aux), grads of loss * scale) of one pass, differentiated stage by stage by
        a table with backward ops (`train_ticks`; over chunks, `train_chunk_ticks`), grads on
        the device. `table`: another than the training one (a forward-only evaluation)."""
        table = self.schedule if table is None else table
        embed, stage, head, params = self.stages.pipeline_functions(params)
        split = None
        if (table.op == BACKWARD_INPUT).any():  # B and W split each layer's backward
            split = self.stages.weight_split(params)
        run = train_chunk_ticks if table.virtual > 1 else train_ticks
        loss, aux, grads = run(
            embed,
            stage,
            lambda p, y, t, w: head(p, y, t, w, denominator),
            params,
            inputs,
            targets,
            weights,
            table,
            scale=scale,
            bubble_fill=self.bubble_fill,
            unroll=self.unroll,
            split=split,
        )
        return (loss, aux), grads

    def pass_grads(self, scale, params, inputs, targets, weights, denominator):
        """((loss, aux), grads of loss * scale), grads made in device memory, of one
        micro-batch (one stage) or one pipeline pass: `value_and_grad` of its loss (a
        host-resident parameter reaches it as an `offload.Resting` pair), or
        `pipeline_train`."""
        if self.schedule is not None and self.schedule.explicit_backward:
            return self.pipeline_train(scale, params, inputs, targets, weights, denominator)
        fn = self.micro_loss if self.schedule is None else self.pipeline_loss
        scaled = lambda *a: (lambda out: (out[0] * scale.astype(out[0].dtype), out))(fn(*a))
        args = (params, inputs, targets, weights, denominator)
        (_, out), grads = offload.value_and_grad(scaled, has_aux=True)(*args)
        return out, grads

    def accumulate(self, params, scale, batches, denominator):
        """Sum `pass_grads` over the leading axis of `batches` (one micro-batch, or one
        pipeline pass of `cfg.pipeline_group` micro-batches, per iteration)."""

        def body(acc, batch):
            out, grads = self.pass_grads(scale, params, *batch, denominator)
            return jax.tree.map(jnp.add, acc, grads), out

        zeros = jax.tree.map(lambda p: vary_like(jnp.zeros(p.shape, p.dtype), p), params)
        grads, outs = jax.lax.scan(body, zeros, batches, unroll=self.unroll)
        return jax.tree.map(jnp.sum, outs), grads

    def summed(self, out):
        """`out` summed over the data axes (psum)."""
        return jax.lax.psum(out, self.stages.data_axes)
