"""Loss and gradients for every model, inside one `shard_map` over the whole mesh.

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
from jaxpod.parallel.manual import vary_like
from jaxpod.parallel.pipeline import forward_ticks
from jaxpod.parallel.pipeline_train import train_ticks
from jaxpod.parallel.remat import saving
from jaxpod.parallel.replica import reduce_grads, vary_params
from jaxpod.parallel.schedules import make_schedule


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

    def grads_to_device(self, grads): ...

    def pipeline_functions(self, params) -> tuple[Callable, Callable, Callable, Any]: ...


def local_functions(stages: Stages, cfg: Config, *, bubble_fill: float, unroll: bool):
    """Per-device `(eval_loss, loss_and_grads)` for the inside of `shard_map`:

    `eval_loss(params, batch, step) -> (loss, aux)`; `loss_and_grads(params, batch, scale,
    step) -> (loss, aux, grads of scale * loss)`, all summed over the data axes. `aux` holds
    the head's extra sums (a classifier's `correct` count)."""
    n_stages = stages.mesh.shape["pipeline"]
    pipelined = n_stages > 1
    passes = cfg.pipeline_passes
    kind, virtual = cfg.train.pipeline_schedule, cfg.train.virtual_stages
    schedule = make_schedule(kind, n_stages, cfg.pipeline_group, virtual) if pipelined else None
    # evaluation runs forward only: the schedule itself, or GPipe for tables with backward
    forward_kind = "gpipe" if kind == "1f1b" else kind
    saves = saving(cfg.model.remat, offload="activations" in cfg.memory.offload)

    def micro_loss(params, inputs, targets, weights, denominator):
        embed, stage, head = stages.forward(params, pipelined=False)
        return head(stage(embed(inputs)), targets, weights, denominator)

    def pipeline_loss(params, inputs, targets, weights, denominator, table=schedule):
        embed, stage, head = stages.forward(params, pipelined=True)
        ys = forward_ticks(
            stage,
            embed(inputs),
            table,
            bubble_fill=bubble_fill,
            unroll=unroll,
            skip_bubbles=cfg.train.skip_bubbles,
            saves=saves,
        )
        return head(ys, targets, weights, denominator)

    def pipeline_train(scale, params, inputs, targets, weights, denominator):
        """((loss, aux), grads of loss * scale) of one pass, differentiated stage by stage."""
        embed, stage, head, params = stages.pipeline_functions(params)
        loss, aux, grads = train_ticks(
            embed,
            stage,
            lambda p, y, t, w: head(p, y, t, w, denominator),
            params,
            inputs,
            targets,
            weights,
            schedule,
            scale=scale,
            bubble_fill=bubble_fill,
            unroll=unroll,
        )
        return (loss, aux), stages.grads_to_device(grads)

    def value_and_grad(fn, scale, *args):
        """((loss, aux), grads of loss * scale), grads on the device."""
        if fn is pipeline_train:
            return pipeline_train(scale, *args)
        scaled = lambda *a: (lambda out: (out[0] * scale.astype(out[0].dtype), out))(fn(*a))
        (_, out), grads = jax.value_and_grad(scaled, has_aux=True)(*args)
        return out, stages.grads_to_device(grads)

    def accumulate(fn, params, scale, batches, denominator):
        """Sum `value_and_grad(fn)` over the leading axis of `batches` (one micro-batch, or one
        pipeline pass of `cfg.pipeline_group` micro-batches, per iteration)."""

        def body(acc, batch):
            out, grads = value_and_grad(fn, scale, params, *batch, denominator)
            return jax.tree.map(jnp.add, acc, grads), out

        zeros = jax.tree.map(lambda p: vary_like(jnp.zeros(p.shape, p.dtype), p), params)
        grads, outs = jax.lax.scan(body, zeros, batches, unroll=unroll)
        return jax.tree.map(jnp.sum, outs), grads

    def summed(out):
        return jax.lax.psum(out, stages.data_axes)

    def eval_loss(params, batch, step):
        ex = stages.examples(params, batch, step, EVAL_STREAM)
        params = vary_params(params, stages.stored_specs, stages.data_axes)
        micro = (ex.inputs, ex.targets, ex.weights)
        if not pipelined:
            outs = jax.lax.map(lambda b: micro_loss(params, *b, ex.denominator), micro)
            return summed(jax.tree.map(jnp.sum, outs))
        table = make_schedule(forward_kind, n_stages, cfg.part_micro, virtual)
        return summed(pipeline_loss(params, *micro, ex.denominator, table=table))

    def loss_and_grads(params, batch, scale, step, partial=None, reduce=True):
        """(loss, aux, grads). `partial`: this device's unreduced gradient sum of the batch's
        earlier parts, added before the reduction; `reduce=False` returns the unreduced sum
        (`train.batch_parts`: the replicas reduce once a step, in the last part's call)."""
        ex = stages.examples(params, batch, step, TRAIN_STREAM)
        params = vary_params(params, stages.stored_specs, stages.data_axes)
        batches = (ex.inputs, ex.targets, ex.weights)
        per_pass = pipeline_train if pipelined and schedule.explicit_backward else pipeline_loss
        if not pipelined:
            out, grads = accumulate(micro_loss, params, scale, batches, ex.denominator)
        elif passes == 1:
            out, grads = value_and_grad(per_pass, scale, params, *batches, ex.denominator)
        else:  # [M, ...] -> [passes, M / passes, ...]: one pipeline schedule per pass
            batches = jax.tree.map(lambda a: a.reshape(passes, -1, *a.shape[1:]), batches)
            out, grads = accumulate(per_pass, params, scale, batches, ex.denominator)
        loss, aux = summed(out)
        if partial is not None:
            grads = jax.tree.map(jnp.add, partial, grads)
        if not reduce:
            return loss, aux, grads
        allreduce, bucket = cfg.parallel.grad_allreduce, cfg.parallel.grad_bucket_bytes
        grads = reduce_grads(
            grads, stages.stored_specs, stages.data_axes, allreduce=allreduce, bucket_bytes=bucket
        )
        return loss, aux, grads

    return eval_loss, loss_and_grads
