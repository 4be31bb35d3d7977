"""The planner's byte model: what one device holds of a mapping, per kind of state.

`device_bytes(cfg, layout, acts, profile)` adds to the activations
(`jaxpod.planner.activations`) what else is alive at the loss head, the layers' backward pass
and the update (weights, gradients, optimizer state, the update's working set, RTS-gathered
copies, float32 copies of streamed matrices), on the device and the host.
Analytic, no jax: nothing is built, so any mapping can be planned.

Host-resident state is counted on the device while the step uses it: the weights whole for
the whole step (the CPU lowering fetches no piece of them: tests/planner/test_transfers.py),
the optimizer state moved in whole for the update; in phases without a pipeline, a phase of
the stack at a time where the profile's program moves one in at a time (`updates_in_phases`,
`jaxpod.planner.phased`). Where host memory is device memory (`shares_host_memory`, XLA:CPU)
the optimizer state, and the weights outside phases, are read in place instead.
Saved activations stay on the device unless the profile's backend places the remat policy's
values in host memory (`offloads_activations`, `jaxpod.planner.activations`: the host
total); nothing is prefetched. The device profile's flags say how the backend computes and
lays out values (`widens_16bit`, `transposes_scattered_grads`, ...).
"""

from __future__ import annotations

import math

from jaxpod.config import Config
from jaxpod.optim.strips import strips
from jaxpod.parallel.schedules import STEPWISE
from jaxpod.planner.activations import (
    DTYPE_BYTES,
    MOMENTS,
    casts_in_layer_loops,
    compute_bytes,
    fused_head,
    grad_bytes,
)
from jaxpod.planner.counts import layer_params
from jaxpod.planner.phased import held_phases, one_phase, stack_credit
from jaxpod.planner.profiles import DeviceProfile, get_profile
from jaxpod.planner.tiles import image_elements
from jaxpod.planner.vmem import held_in_vmem

TOKEN_BYTES = 4  # int32 token ids


def _widths(cfg: Config) -> tuple[int, int, int, int]:
    """`(D, F, W_qkv's columns D + 2 KVD, W_in's columns: F, or 2F with SwiGLU)`."""
    md = cfg.model
    d, f = md.d_model, md.d_ff
    qkv = d + 2 * md.kv_head_count * (d // md.heads)
    return d, f, qkv, 2 * f if md.mlp == "swiglu" else f


def _step_share(cfg: Config) -> float:
    """With `memory.stream=matrix`: the largest step's share of a layer's parameters (one slot
    of `W_qkv`, `W_o`, or one of the `mlp_panels` panels of `W_in` and `W_out`)."""
    d, f, _, f_in = _widths(cfg)
    return max(d * d, (f_in + f) * d / cfg.memory.mlp_panels) / sum(layer_params(cfg.model))


def _largest_matrix(cfg: Config) -> float:
    """Elements of the largest weight matrix one step of a layer gathers, on one tensor
    device: `W_qkv` or an MLP matrix, or with `memory.stream=matrix` one slot of `W_qkv`,
    `W_o` or one MLP panel."""
    d, _, qkv, f_in = _widths(cfg)
    if cfg.memory.stream == "matrix":
        return max(d * d, d * f_in / cfg.memory.mlp_panels) / cfg.mesh.tensor
    return max(qkv * d, d * f_in) / cfg.mesh.tensor


def row_padding(cfg: Config, profile: DeviceProfile, itemsize: int) -> int:
    """How many rows a packed family's state row `[1, n]` of `itemsize`-byte elements takes
    once tiled (`DeviceProfile.tile`): 2 for 16-bit rows on XLA:TPU (`T(2,128)(2,1)`: one
    32-bit word's rows), 1 for float32 rows or an untiled device; stacked layers' state is
    never one row."""
    if profile.tile is None or cfg.kind.stages != "packed":
        return 1
    return profile.tile.rows_of(1, itemsize)


def _in_place_grads(cfg: Config, profile: DeviceProfile) -> bool:
    """Whether the accumulator takes the gradients of the parameters outside the layer stack
    in place (`DeviceProfile.accumulates_in_place`): without a pipeline, in micro-batches
    (read on GPT, float32 and bfloat16 compute, and BERT); not under a pipeline's
    accumulation or for a packed family (not read). With RTS they are accumulated whole,
    their reduce-scatter after the micro-batches, where the head is fused (`fused_head`:
    read on GPT, float32; matrix streams compute the head's gradients after the layers,
    a head in chunks or slices sums its table's gradient in its own loop)."""
    accumulated = cfg.mesh.pipeline == 1 and cfg.part_micro > 1
    read = cfg.kind.stages == "stacked"
    read &= cfg.memory.rts == 1 or fused_head(cfg, profile)
    return profile.accumulates_in_place and accumulated and read


def _state_bytes(cfg: Config, layout: dict, profile: DeviceProfile) -> dict:
    """Bytes per device of the whole state, wherever it rests: `master` (the master weights),
    `weights` (with a 16-bit working copy: the forward's cast, a temporary of the step made on
    the device, alive from the forward to the backward; none where the cast is one layer's at
    a time, `casts_in_layer_loops`), `optimizer`, the gradients (`grad_bytes`) as the
    stage holds them (`grads`: two copies when `accumulated`, summed over micro-batches or
    passes, or carried by 1f1b) and as the update reads them (`grads_update`), the update's
    `updates`, and the micro-batch `accumulator`. A packed family's stored rows take their
    tiled rows (`row_padding`); where the non-layer gradients are added into their
    accumulator (`_in_place_grads`) they are one copy of the two, whole (not RTS's shard)."""
    mem, prec = cfg.memory, cfg.precision
    rts = mem.rts
    rts_opt = mem.rts_optimizer or rts
    pb = DTYPE_BYTES[prec.params]
    mb = 4 if prec.master == "float32" else pb
    local = layout["local"]
    master_all = local / rts * mb * row_padding(cfg, profile, mb)
    moment_bytes = 4 if cfg.optim.moments == "float32" else mb
    moment_bytes *= row_padding(cfg, profile, moment_bytes)
    accumulated = cfg.part_micro > 1 if cfg.mesh.pipeline == 1 else cfg.pipeline_passes > 1
    accumulated |= cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule in STEPWISE  # carried
    grads, accumulator = local * (2 if accumulated else 1), local
    if _in_place_grads(cfg, profile):  # elements, before the division by rts below
        grads += layout["local_other"] * (rts - 2)
        accumulator += layout["local_other"] * (rts - 1)
    gb = grad_bytes(cfg, profile)
    working = mb != pb and not casts_in_layer_loops(cfg, profile)
    return {
        "master": master_all,
        "weights": master_all + (local / rts * pb if working else 0),
        "optimizer": local / rts_opt * MOMENTS[cfg.optim.name] * moment_bytes,
        "accumulated": accumulated,
        "grads": grads / rts * gb,
        "grads_update": local / rts * gb,
        "accumulator": accumulator / rts * gb,
        "updates": local / rts * mb,
    }


def _gathered_bytes(cfg: Config, layout: dict, profile: DeviceProfile) -> tuple:
    """`(gathered, gathered_layer, widened)`: bytes of the RTS-gathered weights alive in the
    backward (all of them, or one layer's; a layer's at `_gather_bytes`) and of the step's
    matrices widened to float32."""
    mem, md = cfg.memory, cfg.model
    pb = DTYPE_BYTES[cfg.precision.params]
    gb = _gather_bytes(cfg, profile)  # a gathered layer weight's bytes a scalar
    gathered = gathered_layer = widened_step = 0
    # the parameters one step of a layer uses: the whole layer, or with memory.stream=matrix
    # the largest step's panels (gathered, and their gradients reduce-scattered, one panel at a
    # time: the panel is cut before the gather)
    step = layout["local_layers"] / max(md.layers // cfg.mesh.pipeline, 1)
    if mem.stream == "matrix":
        step *= _step_share(cfg)
        if compute_bytes(cfg, profile) > pb:
            # 16-bit weights multiplied in float32 (a widening backend, or float32 compute):
            # the step's matrices (a third of W_qkv, W_o, or one MLP panel of W_in and W_out)
            # are converted to float32 buffers for their dots, alive at the recomputed layer's
            # backward (XLA:CPU's dot fusions read float32; benchmarks/xla_peak.py)
            widened_step = step * 4
    if mem.rts > 1 and md.remat == "none":
        gathered = layout["local"] * pb  # every layer's gathered copy is saved
    elif mem.rts > 1:  # the non-layer weights, and one layer's step at a time (recomputed)
        other = layout["local_other"]
        if mem.vocab_slices > 1:  # GPT's tables: one slice of rows and its gradient at a time
            table = md.vocab // cfg.mesh.tensor * md.d_model
            tables = table * (1 if md.tie_embeddings else 2)
            other += 2 * table / mem.vocab_slices - tables
        gathered = other * pb + step * gb
        gathered_layer = step * gb
    return gathered, gathered_layer, widened_step


def _gather_bytes(cfg: Config, profile: DeviceProfile) -> int:
    """Bytes a scalar of a layer's RTS-gathered weights: 2 where the backend multiplies
    float32 in one bfloat16 pass (`converts_matrices`) and converts the shard before the
    all-gather (XLA:TPU, float32 params and compute, whole layers and matrix streams:
    tests/target/test_rts_tpu.py), else the params' bytes."""
    prec = cfg.precision
    f32 = prec.params == "float32" and prec.compute == "float32"
    return 2 if profile.converts_matrices and f32 else DTYPE_BYTES[prec.params]


def _scattered_bytes(cfg: Config, profile: DeviceProfile) -> float:
    """Bytes of a whole weight gradient alive before its RTS reduce-scatter (stacked layers
    with RTS; else 0).

    A gathered matrix's weight gradient is computed whole (a dot's output, compute bytes),
    then reduce-scattered to its RTS shard: the layer's backward holds the largest of a
    step's, and on a backend that first transposes it into the gradients' dtype
    (`DeviceProfile.transposes_scattered_grads`) that copy too. A whole recomputed layer no
    longer holds one gathered MLP matrix by then: the backward uses the second MLP matrix
    first (benchmarks/xla_peak.py on the d 512 and float16 d 256 RTS rows)."""
    if cfg.memory.rts == 1 or cfg.kind.stages != "stacked":
        return 0
    pb = DTYPE_BYTES[cfg.precision.params]
    copy = pb if profile.transposes_scattered_grads else 0
    scattered = _largest_matrix(cfg) * (compute_bytes(cfg, profile) + copy)
    if cfg.memory.stream != "matrix" and cfg.model.remat != "none":
        mlp_matrix = cfg.model.d_model * _widths(cfg)[3] / cfg.mesh.tensor * pb
        scattered = max(scattered - mlp_matrix, 0)  # net of the freed matrix, if any
    return scattered


def _host_weights(cfg: Config, layout: dict, master_all: float) -> float:
    """Bytes of the master weights resting on the host: every weight with params offloaded,
    the layer stack with phases."""
    mem = cfg.memory
    if "params" in mem.offload:
        return master_all
    if mem.phases > 1:
        return master_all * layout["local_layers"] / max(layout["local"], 1)
    return 0


def _on_device(cfg: Config, layout: dict, s: dict, host_weights: float, profile) -> tuple:
    """`(weights, optimizer, moved_in)`: bytes of the weights and the optimizer state counted
    on the device all step, and of the host-resident state moved in for the update.

    Host-resident weights are on the device for the whole step: the CPU lowering fetches no
    piece of them (its per-phase / per-matrix device_puts lower to nothing), and a pipelined
    stage fetches its stack before the ticks. Where host memory is device memory (XLA:CPU)
    they are read in place, as the optimizer state is, unless in phases (XLA:CPU then holds
    the stack in its temporaries: docs/memory.md, "Which program the planner counts"). The
    update is counted on whole trees: host-resident weights and optimizer state moved to the
    device first (`StackedStages.update`); where the program holds the stack a phase at a
    time (`held_phases`), one phase of it and of what the update moves in."""
    weights = s["weights"]
    if profile.shares_host_memory and cfg.memory.phases == 1:
        weights = s["weights"] - host_weights
    optimizer = 0 if "optimizer" in cfg.memory.offload else s["optimizer"]
    moved_in = s["weights"] - weights + s["optimizer"] - optimizer
    if profile.shares_host_memory:
        moved_in = 0  # read in place (XLA:CPU)
    phases = held_phases(cfg, profile)
    weights -= stack_credit(layout, s["master"], phases)
    return weights, optimizer, moved_in * one_phase(layout, phases)


def _matrix_copies(cfg: Config, profile: DeviceProfile) -> float:
    """Bytes of the bfloat16 copies of the stage's stacked layer matrices (W_qkv, W_o, W_in,
    W_out: the device's shards, [L/p, D, (D + 2 KVD)/t] ...) that a backend multiplying
    float32 at default precision makes once and holds all step
    (`DeviceProfile.converts_matrices`); 0 where the step's matmuls are not float32 or the
    stack is not read whole from the device."""
    prec, mem = cfg.precision, cfg.memory
    if not profile.converts_matrices or cfg.kind.stages != "stacked":
        return 0
    if prec.params != "float32" or prec.compute != "float32":
        return 0
    # read on device-resident, unsharded stacks only: RTS, host-resident layers and matrix
    # streams fetch or gather pieces of them, whose conversion no program read has shown
    if mem.rts > 1 or "params" in mem.offload or mem.phases > 1 or mem.stream == "matrix":
        return 0
    d, f, qkv, f_in = _widths(cfg)
    layers = cfg.model.layers // cfg.mesh.pipeline
    return layers * d * (qkv + d + f_in + f) / cfg.mesh.tensor * 2


def _widened_matrices(cfg: Config, profile: DeviceProfile) -> float:
    """Bytes of the float32 copies of the stage's bfloat16 stacked layer matrices (the
    device's shards, RTS's included) that a backend storing bfloat16 in float32
    (`DeviceProfile.stores_in_float32`: XLA:CPU) converts once, whole, before the layer
    loops and holds through the forward and backward passes, not the update (read on GPT
    and BERT probes, 1x1 and 2-stage pipelines, RTS 1 and 2: benchmarks/xla_peak.py); 0
    where the stack is not read whole from the device or is cast one layer at a time from
    float32 masters (`casts_in_layer_loops`: its float32 gradients are counted instead)."""
    mem = cfg.memory
    if cfg.precision.params not in profile.stores_in_float32 or cfg.kind.stages != "stacked":
        return 0
    if casts_in_layer_loops(cfg, profile):
        return 0
    if "params" in mem.offload or mem.phases > 1 or mem.stream == "matrix":
        return 0  # not read: pieces of the stack fetched or streamed
    d, f, qkv, f_in = _widths(cfg)
    layers = cfg.model.layers // cfg.mesh.pipeline
    return layers * d * (qkv + d + f_in + f) / cfg.mesh.tensor / mem.rts * 4


def _inputs(cfg: Config) -> int:
    """Bytes of a call's batch (with `train.batch_parts`, a part of it): token ids, or uint8
    images."""
    if cfg.kind.data == "images":
        return cfg.part_micro * cfg.train.micro_batch * 3 * cfg.model.image_size**2
    return cfg.part_micro * cfg.train.micro_batch * (cfg.model.seq_len + 1) * TOKEN_BYTES


def _input_copy(cfg: Config, profile: DeviceProfile) -> int:
    """Bytes of the uint8 image batch's tiled copy, on a device that pads arrays to tiles
    (`DeviceProfile.tile`): for a stepwise pipeline's tick loop XLA:TPU copies the call's
    images `[G, H, W, 3]` (an argument laid out width-minor) into a channels-minor layout,
    the 3 channels padded to 128, and holds the copy through the step. GPipe's ticks read
    the argument itself: no copy."""
    stepwise = cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule in STEPWISE
    if profile.tile is None or cfg.kind.data != "images" or not stepwise:
        return 0
    images = cfg.part_micro * cfg.train.micro_batch
    return images * image_elements(profile.tile, cfg.model.image_size, 3)


def _strip_updates(cfg: Config, layout: dict) -> float:
    """The update's working set with 16-bit masters of stacked layers (`jaxpod.optim.
    per_layer`, tensor by tensor): the largest stacked tensor (one layer of every stage:
    `jaxpod.optim.strips`) and the token embedding are each updated in strips."""
    md, mesh, devices, rts = cfg.model, cfg.mesh, cfg.total_devices, cfg.memory.rts
    mb = DTYPE_BYTES[cfg.precision.params]  # masters of the params' dtype (16-bit)
    layer = (mesh.pipeline, md.d_model, max(*_widths(cfg)[2:]))
    table = (md.vocab, md.d_model)
    strip = max(
        math.prod(layer[1:]) / mesh.tensor / rts / strips(layer, devices, True)[1],
        math.prod(table) / mesh.tensor / rts / strips(table, devices, False)[1],
    )
    # the grads, a 16-bit copy of the stacked layer weights (XLA's loop carries), and the
    # working set of the largest strip: float32 upcasts, moments, update and threefry's
    # random-bit temporaries, ~8 float32 copies (measured)
    return layout["local_layers"] / rts * mb + strip * 4 * 8


def _update(cfg: Config, layout: dict, acts: dict, s: dict, moved_in: float, phases: int):
    """`(update_peak, updates)`: bytes alive in the update besides the resting state, and
    its working set. It holds what was moved in, the reduced grads and the updates (the new
    weights and moments are written into their donated buffers), in `phases` one part's
    (`jaxpod.planner.phased`); packed rows their whole-row working set (`update_work`); 16-bit
    masters of stacked layers `_strip_updates`."""
    updates = s["updates"] * one_phase(layout, phases)
    update_peak = moved_in + s["grads_update"] + updates
    if "update_work" in acts:  # packed rows: the update's whole-row working set
        update_peak = moved_in + s["grads_update"] + acts["update_work"]
    master_bytes = 4 if cfg.precision.master == "float32" else DTYPE_BYTES[cfg.precision.params]
    if master_bytes < 4 and cfg.kind.stages == "stacked":
        updates = _strip_updates(cfg, layout)
        update_peak = moved_in + s["grads_update"] + updates
    return update_peak, updates


def _backward_peak(cfg: Config, layout: dict, acts: dict, s: dict, copies: tuple) -> float:
    """Bytes alive at the layers' backward besides the resting state: the gradients, the
    backward's activations, the gathered and widened weights (`_gathered_bytes`) and a whole
    gradient before its reduce-scatter (`_scattered_bytes`): `copies`, as `device_bytes`
    names them. One GPipe pass (nothing accumulated): the layers' backward (the tick scans)
    holds the stages' layer gradients and one layer's gathered weights; the other weights'
    gradients (and their gathered copies) belong to the embedding and the head, after."""
    gathered, gathered_layer, widened, scattered = copies
    backward = acts.get("backward_moment", acts["total"])
    peak = s["grads"] + backward + gathered + widened
    if cfg.mesh.pipeline > 1 and not s["accumulated"] and "backward_moment" in acts:
        grads_layers = s["grads_update"] * layout["local_layers"] / layout["local"]
        peak = grads_layers + acts["backward_moment"] + gathered_layer + widened
    return peak + scattered


def device_bytes(
    cfg: Config, layout: dict, acts: dict, profile: DeviceProfile | None = None
) -> dict:
    """Bytes per device of each kind of state, and the device and host totals (see the module
    docstring); `profile` (default `memory.device`) is the device the step runs on. Three
    moments compete for the peak: the layers' backward, the loss head and the update."""
    profile = profile or get_profile(cfg.memory.device)
    s = _state_bytes(cfg, layout, profile)
    host_weights = _host_weights(cfg, layout, s["master"])
    weights, optimizer, moved_in = _on_device(cfg, layout, s, host_weights, profile)
    weights += _matrix_copies(cfg, profile)
    gathered, gathered_layer, widened = _gathered_bytes(cfg, layout, profile)
    scattered = _scattered_bytes(cfg, profile)
    # a fused head's gathered tables are dead by the layers' backward (their uses, the
    # embedding and the head with its gradient, are over: tests/target/test_rts_tpu.py)
    at_backward = gathered_layer if fused_head(cfg, profile) else gathered
    copies = (at_backward, gathered_layer, widened, scattered)
    update_peak, updates = _update(cfg, layout, acts, s, moved_in, held_phases(cfg, profile))
    # the loss head's moment: the gradient accumulator only if it carries from an earlier
    # micro-batch or pass; of the gathered weights, the head's table copy (`_head_table`)
    head_grads = s["accumulator"] if s["accumulated"] else 0
    wide = _widened_matrices(cfg, profile)  # alive through both passes, not the update
    moments = {
        "backward": _backward_peak(cfg, layout, acts, s, copies) + wide,
        "head": head_grads + acts.get("head_moment", 0) + acts.get("head_table", 0) + wide,
        "update": update_peak + gathered,
    }
    peak = max(moments, key=moments.get)  # a tie goes to the first: backward, head, update
    # in parts, the earlier parts' gradients summed unreduced: an argument of each later call
    grad_sum = s["grads_update"] if cfg.train.batch_parts > 1 else 0
    inputs = _inputs(cfg)
    input_copy = _input_copy(cfg, profile)
    # what the device stores between steps (XLA's device-resident arguments): the weights
    # that do not rest on the host, the optimizer state unless offloaded, and the batch
    stored = s["master"] - host_weights
    arguments = stored + optimizer + inputs + grad_sum
    total = weights + optimizer + inputs + input_copy + grad_sum + moments[peak]
    in_vmem = held_in_vmem(profile, total - arguments)
    return {
        "weights": int(weights),
        "grads": int(s["grads"]),
        "optimizer": int(optimizer),
        "activations": int(acts["total"]),
        "updates": int(updates),
        "gathered": int(gathered),
        "widened": int(widened),
        "scattered": int(scattered),
        "moved_in": int(moved_in),
        "inputs": int(inputs),
        "input_copy": int(input_copy),
        "in_vmem": in_vmem,
        "device_total": int(total - in_vmem),
        "grad_sum": int(grad_sum),
        "arguments": int(arguments),
        "host_total": int(host_weights + (s["optimizer"] - optimizer) + acts.get("host", 0)),
        "peak": peak,
    }
