"""Stacked stages: models whose pipeline stages are parts of one stack of identical layers.

A stacked family's model (`jaxpod.models.family.StackedModel`, built in or registered)
keeps its layers as one module with a leading `[L]` axis, split over `pipeline`; a stage
scans its part (`jaxpod.parallel.stack.run_stack`). The model offers `embed(tokens, tp)`,
the stack, `token_loss(h, targets, tp)`, `inputs_and_targets(tokens, keys)` and `masked`.
Around it, from the config:

    params   nested dicts, each leaf sharded by its logical axes (+ the RTS split), in device
             or host memory (`engine.placement`); inside `shard_map` the non-layer weights are
             fetched, gathered and cast before use, the layers one at a time by `run_stack`
    batch    (tokens int32[G, T+1],) split over the batch axes
    update   under GSPMD on the globally sharded arrays (whole-parameter norms): the
             guarded update, whole-tree, or layer by layer for 16-bit master weights
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpod.config import Config
from jaxpod.config.schema import STEPWISE
from jaxpod.engine.loss import Examples
from jaxpod.engine.placement import make_placement
from jaxpod.engine.state import (
    OptState,
    TrainState,
    compile_once,
    optimizer_shardings,
    put_global,
    with_shardings,
)
from jaxpod.models.chunks import token_loss_in_chunks
from jaxpod.models.family import build_model, row_keys
from jaxpod.models.params import STACK, in_stack, masks
from jaxpod.optim.chains import make_optimizer
from jaxpod.optim.guarded import guarded_update, unscaled_sum_squares, whole_tree
from jaxpod.optim.per_layer import per_layer
from jaxpod.optim.phased import in_phases
from jaxpod.optim.precision import LossScaleState, compute_dtype, init_loss_scale, is_half
from jaxpod.optim.precision import master_dtype as master_dtype_of
from jaxpod.parallel import offload
from jaxpod.parallel.mesh import param_specs, shardings
from jaxpod.parallel.pipeline import spread_over_stages
from jaxpod.parallel.replica import gather
from jaxpod.parallel.schedules import layer_order
from jaxpod.parallel.stack import StackOptions, run_stack, split_stack, virtual_stage_slice
from jaxpod.parallel.tensor import VocabSlices, gather_sequence
from jaxpod.parallel.weight_split import StageSplit

TP = "tensor"  # a size-1 axis costs nothing: XLA drops single-device collectives


def _cast(tree, dtype):
    """Floating leaves in `dtype` (leaves already in it are returned as they are)."""
    return jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), tree)


class StackedStages:
    """A stacked model on a mesh: its placement, optimizer and the pieces of its loss."""

    def __init__(self, cfg: Config, mesh: Mesh, *, unroll: bool = False):
        self.cfg, self.unroll = cfg, unroll
        graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg.model, cfg.train.seed)))
        self.graphdef, self.specs, self.masks = graphdef, param_specs(state), masks(state)
        master = master_dtype_of(cfg.precision)
        params = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, master), nnx.to_pure_dict(state)
        )
        self.abstract_params = params
        self.params_count = sum(leaf.size for leaf in jax.tree.leaves(params))
        self.placement = placement = make_placement(cfg, mesh, params, self.specs, self.masks)
        self.mesh, self.data_axes = placement.mesh, placement.data_axes
        self.stored_specs = placement.stored_specs
        self.batch_specs = (placement.batch_spec,)
        self.optimizer, self.lr_schedule = make_optimizer(
            cfg.optim,
            cfg.train.steps,
            decay_mask=self.masks.decay,
            stacked_mask=self.masks.stacked,
            clip=False,
        )
        self.dtype = compute_dtype(cfg.precision)
        self.sliced = cfg.memory.vocab_slices > 1  # token tables used a slice of rows at a time
        self.any_host = any(jax.tree.leaves(placement.host))
        host_layers = jax.tree.map(lambda h, s: h and s, placement.host, self.masks.stacked)
        self.layers_on_host = any(jax.tree.leaves(host_layers))
        mem = cfg.memory
        # a forward-only table's tick scan stacks what each tick saves (`StackOptions`)
        tick_stacked = cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule not in STEPWISE
        self.stack_options = StackOptions(
            remat_policy=cfg.model.remat,
            phases=placement.phases,
            stream=mem.stream,
            mlp_panels=mem.mlp_panels,
            offload_activations=placement.offload_activations,
            unroll=unroll,
            layer_loop=placement.offload_activations and tick_stacked,
        )

    # ------------------------------------------------------------------ state and shardings
    def state_shardings(self) -> TrainState:
        placement = self.placement
        replicated = NamedSharding(placement.mesh, P())
        kind = offload.HOST if placement.host_optimizer else None
        moments = shardings(placement.mesh, placement.opt_specs, kind)
        tx = optimizer_shardings(self.optimizer, self.abstract_params, replicated, like=moments)
        ls = LossScaleState(replicated, replicated, replicated)
        return TrainState(replicated, placement.param_shardings(), OptState(tx, ls))

    def abstract_state(self) -> TrainState:
        """The state as `ShapeDtypeStruct`s with shardings: nothing is materialised."""
        ls = jax.eval_shape(lambda: init_loss_scale(self.cfg.precision))
        tx = jax.eval_shape(self.optimizer.init, self.abstract_params)
        step = jax.ShapeDtypeStruct((), jnp.int32)
        shapes = TrainState(step, self.abstract_params, OptState(tx, ls))
        return with_shardings(shapes, self.state_shardings())

    def init_state(self) -> TrainState:
        """Params created already sharded (a jitted init with `out_shardings`: no device ever
        holds more than its own shards; the values depend only on the seed, not the mesh)."""
        cfg, sharding = self.cfg, self.state_shardings()
        master = master_dtype_of(cfg.precision)
        order = self.layer_order

        def init_params():
            params = nnx.to_pure_dict(nnx.split(build_model(cfg.model, cfg.train.seed))[1])
            if order is not None:  # circular: each stage's part holds its virtual stages in order
                stack = jax.tree.map(lambda a: a[order], params[STACK])
                params = {**params, STACK: stack}
            return _cast(params, master)

        params = compile_once(init_params, sharding.params)()
        tx = compile_once(self.optimizer.init, sharding.opt_state.tx, params)(params)
        ls = put_global(init_loss_scale(cfg.precision), sharding.opt_state.loss_scale)
        step = put_global(np.zeros((), np.int32), sharding.step)
        return TrainState(step, params, OptState(tx, ls))

    # ------------------------------------------------------------------ inside shard_map
    def examples(self, params, batch: tuple, step, stream: int) -> Examples:
        """Local `tokens[B, T+1]` -> micro-batches `[M, mb, T]` of inputs, targets, weights."""
        (tokens,) = batch
        cfg, batch_axes = self.cfg, self.placement.batch_axes
        model = nnx.merge(self.graphdef, params)
        keys = None
        if model.masked:
            rows = jax.lax.axis_index(batch_axes) * tokens.shape[0]
            keys = row_keys(cfg.train.seed, step, rows + jnp.arange(tokens.shape[0]), stream)
        inputs, targets, weights = model.inputs_and_targets(tokens, keys)
        micro, mb = cfg.part_micro, cfg.train.micro_batch
        split = lambda a: None if a is None else a.reshape(micro, mb, *a.shape[1:])
        if weights is None:
            return Examples(split(inputs), split(targets), None, cfg.tokens_per_step)
        denominator = jax.lax.psum(jnp.sum(weights), batch_axes)
        return Examples(split(inputs), split(targets), split(weights), denominator)

    def _prepare(self, tree, dims, leading: int = 0, panels=None):
        """Stored -> computed: cast to the compute dtype, all-gathered over the RTS group."""
        return gather(_cast(tree, self.dtype), dims, self.placement.rts_axes, leading, panels)

    @property
    def layer_order(self) -> np.ndarray | None:
        """Where each stored layer comes from (`stored[i] = logical[order[i]]`) when the
        schedule gives each stage several virtual stages (round-robin, or in a V); None: the
        logical order."""
        t, stages = self.cfg.train, self.cfg.mesh.pipeline
        if t.virtual_stages == 1:
            return None
        return layer_order(self.cfg.model.layers, stages, t.virtual_stages, t.pipeline_schedule)

    def reordered(self, state: TrainState, saved_order: list[int] | None) -> TrainState:
        """`state` whose stacked layers are stored in `saved_order` (a checkpoint's; None: the
        logical order) with every stacked leaf of the params and the optimizer's moments
        permuted along its layer axis into this engine's `layer_order`, in its shardings."""
        logical = np.arange(self.cfg.model.layers)
        saved = logical if saved_order is None else np.asarray(saved_order)
        order = logical if self.layer_order is None else self.layer_order
        if np.array_equal(saved, order):
            return state
        moved = np.argsort(saved)[order]  # stored_new[j] = stored_saved[moved[j]]

        def move(path, leaf):  # host-resident leaves are gathered in device memory
            return offload.to_device(leaf)[moved] if in_stack(path) else leaf

        reorder = lambda s: jax.tree_util.tree_map_with_path(move, s)  # noqa: E731
        return jax.jit(reorder, out_shardings=self.state_shardings())(state)

    def _model(self, params, fetched_layers: bool, fetched: bool = False) -> nnx.Module:
        """The model of the local params: non-layer weights fetched and prepared, token tables
        as `VocabSlices` when used a slice at a time, the layers as stored. `fetched`: every
        host-resident leaf is already on the device."""
        placement, cfg = self.placement, self.cfg
        flat = lambda tree: jax.tree.leaves(tree)
        leaves, treedef = jax.tree.flatten(params, is_leaf=offload.is_resting)
        roles = (self.masks.stacked, self.masks.table, placement.host)
        rows = zip(leaves, *map(flat, roles), strict=True)
        ready = []
        for (leaf, stacked, table, host), dim in zip(rows, flat(placement.rts_dims), strict=True):
            if stacked:  # run_stack prepares the layers one at a time
                fetch = host and fetched_layers and not fetched
                ready.append(offload.to_device(leaf) if fetch else leaf)
                continue
            leaf = offload.to_device(leaf) if host and not fetched else leaf
            if table and self.sliced:
                prepare = lambda rows, dim=dim: self._prepare(rows, dim)
                ready.append(VocabSlices(leaf, cfg.memory.vocab_slices, prepare))
            else:
                ready.append(self._prepare(leaf, dim))
        return nnx.merge(self.graphdef, jax.tree.unflatten(treedef, ready))

    def _run_layers(
        self, model: nnx.Module, x: jax.Array, fetched: bool, virtual_stage=0
    ) -> jax.Array:
        """This stage's layers over `x` (with V virtual stages, the layers of virtual stage
        `virtual_stage` only); `fetched`: the stack is already on the device."""
        cfg = self.cfg
        prepare, fetch, virtual = self._layer_prepare(), None, None
        fetch_whole = None
        if self.layers_on_host and not fetched:  # per phase, or per step (stream=matrix)
            fetch = offload.to_device  # the matrices; biases and norms whole, before the layers
            fetch_whole = jax.tree.map(lambda d: not d, self.masks.decay[STACK])
        if cfg.train.virtual_stages > 1:
            virtual = (virtual_stage, cfg.train.virtual_stages)
        stack = getattr(model, STACK)
        options = self.stack_options
        return run_stack(
            stack,
            x,
            tp=TP,
            options=options,
            prepare=prepare,
            fetch=fetch,
            fetch_whole=fetch_whole,
            virtual_stage=virtual,
        )

    def _layer_prepare(self):
        """A layer's stored weights -> computed (RTS gather, cast), or None: as stored."""
        dims = self.placement.rts_dims[STACK]
        if self.placement.rts_axes or self.dtype != master_dtype_of(self.cfg.precision):
            return lambda p, panels=None: self._prepare(p, dims, 1, panels)
        return None

    def _micro_head(self, model, h, targets, weights, denominator):
        """The head of one micro-batch's `h[mb, T, D]` (sequence-parallel: `[mb, T/t, D]`)."""
        if self.cfg.model.sequence_parallel:  # the vocab-parallel head needs every position
            h = gather_sequence(h, TP)
        return self._head(model, h, targets, weights, denominator)

    def _head(self, model, h, targets, weights, denominator):
        loss = token_loss_in_chunks(model, h, targets, TP, self.cfg.model.sequence_chunks)
        weighted = loss if weights is None else loss * weights.reshape(loss.shape)
        return jnp.sum(weighted) / denominator, {}

    def forward(self, params, pipelined: bool):
        """`(embed, stage, head)` of this device. Pipelined, the host-resident stack is
        fetched once per step before the ticks, which all read it (fetched in phases inside
        the ticks, it would cross 2 (M + S - 1) times a step), and the head runs on 1/S of
        the last stage's outputs on every stage (`spread_over_stages`)."""
        model = self._model(params, fetched_layers=pipelined)
        sp = self.cfg.model.sequence_parallel
        embed = lambda tokens: model.embed(tokens, TP)
        stage = lambda x, r=0: self._run_layers(model, x, fetched=pipelined, virtual_stage=r)
        if not pipelined:
            return embed, stage, lambda *a: self._micro_head(model, *a)
        stages = self.mesh.shape["pipeline"]

        def stage_share(a):  # this stage's targets/weights [M, mb, T], in h's order
            if a is None:
                return None
            index = jax.lax.axis_index("pipeline")
            if not sp:
                return a.reshape(stages, -1)[index]
            # h will be the concatenation over tensor shards i of (shard i's positions,
            # flattened, this stage's slice): the same permutation, without communication.
            shards = jax.lax.axis_size(TP)
            a = jnp.moveaxis(a.reshape(*a.shape[:-1], shards, -1), -2, 0)  # [t, M, mb, T/t]
            return a.reshape(shards, stages, -1)[:, index].reshape(-1)

        def pipelined_head(ys, targets, weights, denominator):
            h = spread_over_stages(ys.reshape(-1, ys.shape[-1]))  # [M*mb*T / S, D] (/t: SP)
            if sp:  # every tensor shard needs every token for the vocab-parallel head
                h = gather_sequence(h, TP, dim=0)
            return self._head(model, h, stage_share(targets), stage_share(weights), denominator)

        return embed, stage, pipelined_head

    def pipeline_functions(self, params):
        """For schedules that differentiate stage by stage (1F1B): `(embed(p, inputs),
        stage(p, x, r), head(p, y, targets, weights, denominator), params)` (r: the virtual
        stage), each a function of
        the params, with every host-resident leaf fetched to the device once, here, before
        the ticks, which all read it."""
        if self.any_host:
            params = jax.tree.map(
                lambda a, h: offload.to_device(a) if h else a, params, self.placement.host
            )
        model = lambda p: self._model(p, fetched_layers=False, fetched=True)  # noqa: E731
        embed = lambda p, inputs: model(p).embed(inputs, TP)  # noqa: E731
        stage = lambda p, x, r=0: self._run_layers(model(p), x, True, r)  # noqa: E731
        head = lambda p, *a: self._micro_head(model(p), *a)  # noqa: E731
        return embed, stage, head, params

    def weight_split(self, params) -> StageSplit | None:
        """How B and W split a stage's backward (`split_stack`), for `pipeline_functions`'
        `params`: the layers of virtual stage r are a slice of the stored stack."""
        virtual = self.cfg.train.virtual_stages

        def stack_of(p, r=0):
            return p[STACK] if virtual == 1 else virtual_stage_slice(p[STACK], (r, virtual))

        stack = getattr(nnx.merge(self.graphdef, params), STACK)
        options, prepare = self.stack_options, self._layer_prepare()
        return split_stack(stack, tp=TP, options=options, prepare=prepare, stack_of=stack_of)

    # ------------------------------------------------------------------ the update (GSPMD)
    @property
    def update_phases(self) -> int:
        """How many phases the update brings the layer stack in by (`optim.phased`): the
        step's `memory.phases` without a pipeline; 1 (the whole tree at once) with one, whose
        stage holds its whole stack on the device for the ticks anyway."""
        return self.placement.phases if self.cfg.mesh.pipeline == 1 else 1

    def _apply(self) -> tuple:
        """`(grad_sum_squares, apply)` of the guarded update: layer by layer for 16-bit
        masters, whole-tree otherwise."""
        cfg = self.cfg
        if is_half(master_dtype_of(cfg.precision)):  # 16-bit masters: layer by layer
            return per_layer(
                self.optimizer,
                self.masks.stacked,
                stages=cfg.mesh.pipeline,
                devices=cfg.total_devices,
            )
        return unscaled_sum_squares, whole_tree(self.optimizer)

    def update(self, grads, tx, params, loss_scale, key):
        """The guarded update on the global arrays: host-resident state is moved to the
        device, updated, and put back where it lives, the whole tree at once or, in phases
        (`update_phases`), one phase of the layer stack at a time (`optim.phased`). Returns
        `(params, tx, loss_scale, info)`; `info` adds `param_norm` to the guarded update's."""
        cfg, placement = self.cfg, self.placement
        sharding = self.state_shardings()
        grad_sq, apply = self._apply()
        norms: dict = {}
        if self.update_phases > 1:
            # the stacked matrices by phase; their biases and norms, a few vectors a layer,
            # whole (XLA:TPU cannot read a slice of their layer axis from host memory)
            phases = self.update_phases
            stacked = jax.tree.map(lambda s, d: s and d, self.masks.stacked, self.masks.decay)
            fetch, store = offload.to_device, offload.put_back
            apply = in_phases(
                apply, self.optimizer, stacked, phases, fetch=fetch, store=store, norms=norms
            )
        else:
            if self.any_host:
                params = jax.device_put(params, offload.with_memory_kind(sharding.params, "device"))
            if placement.host_optimizer:
                device_tx = offload.with_memory_kind(sharding.opt_state.tx, "device")
                tx = jax.device_put(tx, device_tx)
        params, tx, loss_scale, info = guarded_update(
            apply,
            grads,
            tx,
            params,
            loss_scale,
            key,
            cfg.precision,
            max_norm=cfg.optim.grad_clip,
            grad_sum_squares=grad_sq,
        )
        param_sq = norms.get("param_sq")
        info["param_norm"] = optax.tree.norm(params) if param_sq is None else jnp.sqrt(param_sq)
        params = jax.device_put(params, sharding.params)
        tx = jax.device_put(tx, sharding.opt_state.tx)
        return params, tx, loss_scale, info
