"""The planner's byte model: what one device holds of a mapping, per kind of state.

`device_bytes(cfg, layout, acts, profile)` adds to the activations
(`jaxpod.planner.activations`) what else is alive at the loss head, the layers' backward pass
and the update (weights, gradients, optimizer state, the update's working set, RTS-gathered
copies, float32 copies of streamed matrices), on the device and the host.
Analytic, no jax: nothing is built, so any mapping can be planned.

Host-resident state is counted on the device while the step uses it: the weights whole for
the whole step (the CPU lowering fetches no piece of them; the TPU/GPU lowering's per-phase
and per-matrix fetches are not credited: tests/planner/test_transfers.py), the optimizer
state moved in whole for the update. Where host memory is device memory (`shares_host_memory`,
XLA:CPU) the optimizer state, and the weights outside phases, are read in place instead.
Saved activations never leave the device (the lowered step has no such placement); nothing
is prefetched. The device profile's flags say how the backend computes and lays out values
(`widens_16bit`, `transposes_scattered_grads`, ...).
"""

from __future__ import annotations

import math

from jaxpod.config import Config
from jaxpod.optim.strips import strips
from jaxpod.planner.activations import DTYPE_BYTES, MOMENTS, compute_bytes
from jaxpod.planner.counts import layer_params
from jaxpod.planner.profiles import DeviceProfile, get_profile

TOKEN_BYTES = 4  # int32 token ids


def _step_share(cfg: Config) -> float:
    """With `memory.stream=matrix`: the largest step's share of a layer's parameters (a third
    of `W_qkv`, `W_o`, or one of the `mlp_panels` panels of `W_in` and `W_out`)."""
    d, f = cfg.model.d_model, cfg.model.d_ff
    return max(d * d, 2 * d * f / cfg.memory.mlp_panels) / sum(layer_params(d, f))


def _largest_matrix(cfg: Config) -> float:
    """Elements of the largest weight matrix one step of a layer gathers, on one tensor
    device: `W_qkv` or an MLP matrix, or with `memory.stream=matrix` a third of `W_qkv` or one
    MLP panel."""
    d, f = cfg.model.d_model, cfg.model.d_ff
    if cfg.memory.stream == "matrix":
        return max(d * d, d * f / cfg.memory.mlp_panels) / cfg.mesh.tensor
    return max(3 * d * d, d * f) / cfg.mesh.tensor


def device_bytes(
    cfg: Config, layout: dict, acts: dict, profile: DeviceProfile | None = None
) -> dict:
    """Bytes per device of each kind of state, and the device and host totals (see the module
    docstring); `profile` (default `memory.device`) is the device the step runs on."""
    mem, prec = cfg.memory, cfg.precision
    profile = profile or get_profile(mem.device)
    rts = mem.rts
    rts_opt = mem.rts_optimizer or rts
    pb = DTYPE_BYTES[prec.params]
    mb = 4 if prec.master == "float32" else pb
    local = layout["local"]
    offload = set(mem.offload)

    # the state stores the master weights; a 16-bit working copy (the forward's cast) is a
    # temporary of the step, made on the device, alive from the forward to the backward
    master_all = local / rts * mb
    weights_all = master_all + (local / rts * pb if mb != pb else 0)
    moment_bytes = 4 if cfg.optim.moments == "float32" else mb
    optimizer_all = local / rts_opt * MOMENTS[cfg.optim.name] * moment_bytes
    accumulated = cfg.part_micro > 1 if cfg.mesh.pipeline == 1 else cfg.pipeline_passes > 1
    accumulated |= cfg.mesh.pipeline > 1 and cfg.train.pipeline_schedule == "1f1b"  # carried
    grads_stage = local / rts * pb * (2 if accumulated else 1)
    grads_update = local / rts * pb
    updates = local / rts * mb
    gathered = gathered_layer = widened_step = scattered = 0
    # the parameters one step of a layer uses: the whole layer, or with memory.stream=matrix
    # the largest step's panels (gathered, and their gradients reduce-scattered, one panel at a
    # time: the panel is cut before the gather)
    step = layout["local_layers"] / max(cfg.model.layers // cfg.mesh.pipeline, 1)
    if mem.stream == "matrix":
        step *= _step_share(cfg)
        if compute_bytes(cfg, profile) > pb:
            # 16-bit weights multiplied in float32 (a widening backend, or float32 compute):
            # the step's matrices (a third of W_qkv, W_o, or one MLP panel of W_in and W_out)
            # are converted to float32 buffers for their dots, alive at the recomputed layer's
            # backward (XLA:CPU's dot fusions read float32; benchmarks/xla_peak.py)
            widened_step = step * 4
    if rts > 1 and cfg.model.remat == "none":
        gathered = local * pb  # every layer's gathered copy is saved
    elif rts > 1:  # the non-layer weights, and one layer's step at a time (recomputed)
        other = layout["local_other"]
        if mem.vocab_slices > 1:  # GPT's tables: one slice of rows and its gradient at a time
            table = cfg.model.vocab // cfg.mesh.tensor * cfg.model.d_model
            tables = table * (1 if cfg.model.tie_embeddings else 2)
            other += 2 * table / mem.vocab_slices - tables
        gathered = (other + step) * pb
        gathered_layer = step * pb
    if rts > 1 and cfg.kind.stages == "stacked":
        # a gathered matrix's weight gradient is computed whole (a dot's output, compute
        # bytes), then reduce-scattered to its RTS shard: the layer's backward holds the
        # largest of a step's, and on a backend that first transposes it into the gradients'
        # dtype (`DeviceProfile.transposes_scattered_grads`) that copy too. A whole recomputed
        # layer no longer holds one gathered MLP matrix by then: the backward uses the second
        # MLP matrix first (benchmarks/xla_peak.py on the d 512 and float16 d 256 RTS rows)
        copy = pb if profile.transposes_scattered_grads else 0
        scattered = _largest_matrix(cfg) * (compute_bytes(cfg, profile) + copy)
        if mem.stream != "matrix" and cfg.model.remat != "none":
            mlp_matrix = cfg.model.d_model * cfg.model.d_ff / cfg.mesh.tensor * pb
            scattered = max(scattered - mlp_matrix, 0)  # net of the freed matrix, if any

    # what rests on the host: every weight with params offloaded, the layer stack with phases
    host_weights = master_all if "params" in offload else 0
    if "params" not in offload and mem.phases > 1:
        host_weights = master_all * layout["local_layers"] / max(local, 1)
    # Host-resident weights are on the device for the whole step: the CPU lowering fetches no
    # piece of them (its per-phase / per-matrix device_puts lower to nothing; the TPU/GPU
    # lowering keeps them, uncredited: jaxpod.parallel.offload), and a pipelined stage
    # fetches its stack before the ticks. Where host memory is device memory (XLA:CPU) they
    # are read in place, as the optimizer state is, unless in phases (XLA:CPU then holds the
    # stack in its temporaries: docs/memory.md, "Which program the planner counts").
    weights = weights_all
    if profile.shares_host_memory and mem.phases == 1:
        weights = weights_all - host_weights
    grads = grads_stage
    optimizer = 0 if "optimizer" in offload else optimizer_all
    activations = acts["total"]
    # a call's batch (with `train.batch_parts`, a part of it)
    inputs = cfg.part_micro * cfg.train.micro_batch * (cfg.model.seq_len + 1) * TOKEN_BYTES
    if cfg.kind.data == "images":
        inputs = cfg.part_micro * cfg.train.micro_batch * 3 * cfg.model.image_size**2
    # in parts, the earlier parts' gradients summed on each device (unreduced, as stored): an
    # argument of every later call
    grad_sum = local / rts * pb if cfg.train.batch_parts > 1 else 0
    # the loss head's moment: the gradient accumulator only if it carries from an earlier
    # micro-batch or pass; of the gathered weights, the head's table copy (`_head_table`)
    head_grads = local / rts * pb if accumulated else 0
    head_peak = head_grads + acts.get("head_moment", 0) + acts.get("head_table", 0)
    backward_peak = grads + acts.get("backward_moment", activations) + gathered + widened_step
    if cfg.mesh.pipeline > 1 and not accumulated and "backward_moment" in acts:
        # one GPipe pass: the layers' backward (the tick scans) holds the stages' layer
        # gradients and one layer's gathered weights; the other weights' gradients (and
        # their gathered copies) belong to the embedding and the head, after the ticks
        grads_layers = layout["local_layers"] / rts * pb
        backward_peak = grads_layers + acts["backward_moment"] + gathered_layer + widened_step
    backward_peak += scattered
    # The update runs on whole trees: host-resident weights and optimizer state are moved to
    # the device first (`StackedStages.update`), the reduced grads too. It holds the grads and
    # the updates (the new weights and moments are written into their donated buffers).
    moved_in = weights_all - weights + optimizer_all - optimizer
    if profile.shares_host_memory:
        moved_in = 0  # read in place (XLA:CPU)
    update_peak = moved_in + grads_update + updates
    if "update_work" in acts:  # packed rows: the update's whole-row working set
        update_peak = moved_in + grads_update + acts["update_work"]
    # 16-bit masters of stacked layers: `jaxpod.optim.per_layer`, tensor by tensor
    if mb < 4 and cfg.kind.stages == "stacked":
        md, mesh, devices = cfg.model, cfg.mesh, cfg.total_devices
        # the largest stacked tensor (one layer of every stage: `jaxpod.optim.strips`) and
        # the token embedding, each updated in strips
        layer = (mesh.pipeline, md.d_model, max(3 * md.d_model, md.d_ff))
        table = (md.vocab, md.d_model)
        strip = max(
            math.prod(layer[1:]) / mesh.tensor / rts / strips(layer, devices, True)[1],
            math.prod(table) / mesh.tensor / rts / strips(table, devices, False)[1],
        )
        # the grads, a 16-bit copy of the stacked layer weights (XLA's loop carries), and the
        # working set of the largest strip: float32 upcasts, moments, update and threefry's
        # random-bit temporaries, ~8 float32 copies (measured)
        updates = layout["local_layers"] / rts * mb + strip * 4 * 8
        update_peak = moved_in + grads_update + updates
    moments = {"backward": backward_peak, "head": head_peak, "update": update_peak + gathered}
    peak = max(moments, key=moments.get)  # a tie goes to the first: backward, head, update
    device_total = weights + optimizer + inputs + grad_sum + moments[peak]
    host_total = host_weights + (optimizer_all - optimizer) + acts.get("host", 0)
    # what the device stores between steps (XLA's device-resident arguments): the weights
    # that do not rest on the host, the optimizer state unless offloaded, and the batch
    stored = master_all - host_weights
    return {
        "weights": int(weights),
        "grads": int(grads),
        "optimizer": int(optimizer),
        "activations": int(activations),
        "updates": int(updates),
        "gathered": int(gathered),
        "widened": int(widened_step),
        "scattered": int(scattered),
        "moved_in": int(moved_in),
        "inputs": int(inputs),
        "device_total": int(device_total),
        "grad_sum": int(grad_sum),
        "arguments": int(stored + optimizer + inputs + grad_sum),
        "host_total": int(host_total),
        "peak": peak,
    }
