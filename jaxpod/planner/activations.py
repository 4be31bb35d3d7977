"""The planner's activation model: what the train step keeps alive besides its state.

`activation_bytes(cfg, profile)` models two moments of one device's step, the loss head and
the layers' backward pass: the residuals saved per layer (`jaxpod.planner.layer`) and
pipeline tick, the pipeline's buffers, the head's logits, one layer's backward working set
(`jaxpod.planner.bytes` adds the state to them). `compute_bytes` and `stored_bytes` say how
many bytes a scalar takes in computation and between computations on the device profile.
Analytic, no jax.
"""

from __future__ import annotations

import math
from functools import lru_cache

from jaxpod.config import Config
from jaxpod.parallel.chunk_routes import routes
from jaxpod.parallel.schedules import STEPWISE, make_schedule
from jaxpod.planner import efficientnet
from jaxpod.planner.counts import efficientnet_stage_params, layer_params
from jaxpod.planner.host_saved import host_saved
from jaxpod.planner.layer import layer_sets
from jaxpod.planner.profiles import DeviceProfile, get_profile
from jaxpod.planner.stepwise_bytes import split_terms, tick_policy

SPLIT_KINDS = ("zb-h1", "zb-v")  # B keeps what W needs (`jaxpod.parallel.weight_split`)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MOMENTS = {"adamw": 2, "lamb": 2, "sgd": 1, "lars": 1}
HEAD_LOGIT_COPIES = 3  # float32 logits, shifted logits, exp: live together in the loss head
# with 16-bit compute the logits are rounded to it: the exp of the rounded logits and the
# cotangent are the two alive at the head's peak (read on BERT-Large POD16 and a float16
# GPT, benchmarks/xla_peak.py: docs/memory.md)
ROUNDED_HEAD_LOGIT_COPIES = 2
# with memory.vocab_slices > 1 the head's online softmax keeps a slice's logits and its exp
# (calibrated on bench_planner's vocab-slices row, docs/memory.md)
SLICED_HEAD_LOGIT_COPIES = 2


def compute_bytes(cfg: Config, profile: DeviceProfile | None = None) -> int:
    """Bytes of one activation scalar: the compute dtype's, or 4 on a device that computes
    16-bit dtypes in float32 (`DeviceProfile.widens_16bit`)."""
    profile = profile or get_profile(cfg.memory.device)
    return 4 if profile.widens_16bit else DTYPE_BYTES[cfg.precision.compute]


def stored_bytes(cfg: Config, profile: DeviceProfile | None = None) -> int:
    """Bytes of one activation scalar kept between computations (saved residuals, pipeline
    rows): the compute dtype's, or 4 where the backend stores that dtype in float32
    (`DeviceProfile.stores_in_float32`)."""
    profile = profile or get_profile(cfg.memory.device)
    compute = cfg.precision.compute
    return 4 if compute in profile.stores_in_float32 else DTYPE_BYTES[compute]


def grad_bytes(cfg: Config, profile: DeviceProfile | None = None) -> int:
    """Bytes of one gradient scalar of the stacked model: the params' dtype, or 4 where the
    16-bit weights are cast from float32 masters inside the layer loops
    (`DeviceProfile.casts_in_layer_loops`): autodiff returns the masters' float32 gradients."""
    profile = profile or get_profile(cfg.memory.device)
    return 4 if casts_in_layer_loops(cfg, profile) else DTYPE_BYTES[cfg.precision.params]


def casts_in_layer_loops(cfg: Config, profile: DeviceProfile) -> bool:
    """Whether the step casts float32 masters to 16-bit weights a piece at a time inside its
    loops (`DeviceProfile.casts_in_layer_loops`): a stack one layer at a time in the layer
    loops, packed rows leaf by leaf in each tick's stage function (`jaxpod.engine.packed`)."""
    prec = cfg.precision
    sixteen = DTYPE_BYTES[prec.params] == 2 and prec.master == "float32"
    return profile.casts_in_layer_loops and sixteen


def _head_kept(cfg: Config, tokens: int, sb: int, profile: DeviceProfile) -> int:
    """Bytes of the loss head's values alive through the layers' backward pass (`tokens`: the
    head's tokens on this device; `sb` bytes a stored scalar, `stored_bytes`). XLA:CPU computes
    the head's weight gradients after the layers' backward, so each weighted op of the head
    keeps its input and its output's cotangent: GPT the final LN's input, its output (the
    logits' input) and that output's cotangent; BERT also the dense layer's input and its
    output's cotangent, the head LN's input, its output (with the constant-1 column) and that
    output's cotangent; both the float32 logits' cotangent. A head in chunks
    (`sequence_chunks`) computes them inside its chunk loop and keeps none (measured);
    `memory.vocab_slices` is taken to be the same (not read). None where the profile computes
    the head's gradient at once (`head_grads_at_once`: read on GPT, float32 compute, and with
    sequence parallelism on GPT and BERT, float32 and bfloat16 compute, without a pipeline
    and under GPipe; BERT's head and 16-bit compute keep the logits' cotangent without
    sequence parallelism, and circular is not read)."""
    md = cfg.model
    if math.gcd(md.sequence_chunks, tokens) > 1 or cfg.memory.vocab_slices > 1:
        return 0
    read = cfg.mesh.pipeline == 1 or cfg.train.pipeline_schedule == "gpipe"
    float32_gpt = md.name == "gpt" and cfg.precision.compute == "float32"
    at_once = float32_gpt or (md.sequence_parallel and cfg.precision.compute != "float16")
    if profile.head_grads_at_once and at_once and read:
        return 0
    rows = 3 if md.name == "gpt" else 5 + 2 * (md.norm == "pre")
    return tokens * (rows * md.d_model * sb + md.vocab // cfg.mesh.tensor * 4)


def _head_table(cfg: Config, cb: int) -> int:
    """Bytes of the output table's copy the loss head makes (`cb` bytes a compute scalar):
    BERT appends its output bias as a column (a new [V/t, D+1] table); with RTS the table is
    all-gathered; computed in a wider dtype than stored (a widening backend) it is converted.
    The copy holds the wider of the two dtypes. None when the head reads the stored table."""
    md = cfg.model
    pb = DTYPE_BYTES[cfg.precision.params]
    if md.name != "bert" and cfg.memory.rts == 1 and cb <= pb:
        return 0
    rows = md.vocab // cfg.mesh.tensor // cfg.memory.vocab_slices
    return rows * (md.d_model + (md.name == "bert")) * max(cb, pb)


def _packed_activation_bytes(cfg: Config, profile: DeviceProfile, cb: int) -> dict:
    """EfficientNet's activation bytes (`jaxpod.planner.efficientnet`): its stages are packed
    into rows of the longest stage's parameter count, so the rows, their dtypes and the rows
    the update rounds stochastically are what its model needs from the config."""
    stage_params = efficientnet_stage_params(cfg)
    row = max(stage_params)  # n_max: every stage's row is this long
    prec = cfg.precision
    act, pb = DTYPE_BYTES[prec.compute], DTYPE_BYTES[prec.params]
    # rows of master weights and of moments (float32 with optim.moments=float32, else rounded)
    master16 = prec.master != "float32" and pb < 4
    moments, opt16 = MOMENTS[cfg.optim.name], master16 and cfg.optim.moments != "float32"
    # LARS ends in its momentum's trace: the new momentum is the update, one set of leaves
    new_state = moments - (cfg.optim.name == "lars")
    return efficientnet.activation_bytes(
        cfg,
        cb,
        act,
        row,
        grad_bytes(cfg, profile),
        moments * opt16,
        pb * master16,
        pb,
        stage_params,
        0 if opt16 else new_state,
        dense_depthwise=profile.dense_depthwise_grads,
        tile=profile.tile,
        grouped_copies=profile.grouped_conv_copies,
        wide_groups=profile.stem_groups_width_minor,
    )


def _tick_scan_buffers(
    cfg: Config, sets: dict, ticks: int, per_tick: int, profile: DeviceProfile
) -> tuple[int, int]:
    """`(pipeline_buffers, tick_grads)` of gpipe and circular: the forward tick scan, the
    head, then autodiff's backward tick scan, which holds besides the saved residuals
    (XLA:CPU's buffer assignment, read with benchmarks/xla_peak.py):

    - `ticks` rows: the cotangent of the ticks' collected outputs (the transpose of taking
      the last stage's M outputs from them: a pad (gpipe), a scatter (circular));
    - `micro` rows: the embedded micro-batches' cotangent, a carry of the scan; BERT also its
      embedding LayerNorm's input and centred input, [M, mb, T, D] each, saved for the
      embedding's backward after the ticks;
    - one row: the carry, the activation cotangent sent up the pipe;
    - the tick's own part of the saved residuals (`per_tick` layers);
    - `tick_grads`: with more than one layer a tick (a layer scan inside the tick), the
      transposed layer scan's gradient of the stage's whole stack (the tick's layers are a
      dynamic slice of it, `grad_bytes` a gradient), before it is added into the stage's
      accumulator;
    - with `train.skip_bubbles`, the backward tick's `lax.cond` returns its layers' weight
      gradients and saved residuals as buffers of their own (read on 1x2x1, d 128, remat
      full / minimal / comms / none, benchmarks/xla_peak.py)."""
    md, mesh = cfg.model, cfg.mesh
    micro, per_stage = cfg.pipeline_group, md.layers // mesh.pipeline
    rows = ticks + micro + 1 + (2 * micro if md.name == "bert" else 0)
    buffers = rows * sets["btd"] + per_tick * sets["saved"]
    sharded, replicated = layer_params(md)
    layer = (sharded // mesh.tensor + replicated) * grad_bytes(cfg, profile)
    tick_grads = per_stage * layer // cfg.memory.rts if per_tick > 1 else 0
    if cfg.train.skip_bubbles:
        buffers += per_tick * (layer // cfg.memory.rts + sets["saved"])
    return buffers, tick_grads


def _pipeline_terms(cfg: Config, sets: dict, sb: int, profile: DeviceProfile) -> dict:
    """What the schedule keeps of the layers' activations (`sets`: `layer_sets`), by the
    output's keys, and the head's tokens on this device (`head_tokens`).

    `saved`: residuals kept for the backward pass. pipeline == 1: the micro-batches run one
    after another (forward and backward inside the accumulation loop), so one micro-batch's
    layers are in flight. gpipe and circular (one forward scan, differentiated as a whole):
    every one of the V·M + S - 1 ticks saves its virtual stage's layers, bubble ticks
    included, where M is the micro-batches of one pass (`train.pipeline_group`; the passes
    run in turn). 1f1b: the stage inputs of at most S micro-batches.
    `pipeline_buffers` and `tick_grads`: gpipe, circular `_tick_scan_buffers`; 1f1b a
    backward tick's residuals. `head_kept`: `_head_kept`, where the head's gradients wait for
    the layers' backward."""
    md, mesh, tr = cfg.model, cfg.mesh, cfg.train
    # micro: the micro-batches of one GPipe pass (`train.pipeline_group`; passes run in turn)
    stages, micro, per_stage = mesh.pipeline, cfg.pipeline_group, md.layers // mesh.pipeline
    kind, virtual = tr.pipeline_schedule, tr.virtual_stages
    ticks = 1 if stages == 1 else virtual * micro + stages - 1
    per_tick = per_stage // virtual  # the layers one tick runs (one virtual stage's)
    saved = ticks * per_tick * sets["saved"]  # the forward tick scan's stacked residuals
    head_tokens = tr.micro_batch * md.seq_len * (1 if stages == 1 else micro) // stages
    buffers = tick_grads = head_kept = 0
    work = sets["work"]  # a layer's backward working set; a split tick's op (`split_terms`)
    if stages == 1 and md.remat != "none":
        # the head's operands through the layers' backward, as pipelined below (read on 1x1x1
        # and 1x1x4, remat full; without remat XLA:CPU computes the head's gradients at once)
        head_kept = _head_kept(cfg, head_tokens, sb, profile)
    if stages > 1 and kind not in STEPWISE:
        buffers, tick_grads = _tick_scan_buffers(cfg, sets, ticks, per_tick, profile)
        head_kept = _head_kept(cfg, head_tokens, sb, profile)  # its grads after the ticks
    if stages > 1 and kind in STEPWISE:
        # the stage inputs of at most S micro-batches and their gradients (two ring buffers),
        # the two values sent each tick; a backward tick's residuals of the stage's layers;
        # the head runs on one micro-batch at a time on the last stage (its gradients inside
        # the tick). The carried gradients and the backward tick's stack gradients are the
        # two gradient copies of `device_bytes` ("carried").
        k = stages  # ring-buffer slots: over chunks, those the routes assign
        if virtual > 1:
            k = route_slots(kind, stages, micro, virtual)
        saved = (2 * k + 2) * sets["btd"]
        buffers = per_tick * sets["saved"]  # the backward tick's residuals
        if kind in SPLIT_KINDS and cfg.memory.stream == "layer":  # B's slots for W
            carry, op = split_terms(cfg, sets, per_tick, grad_bytes(cfg, profile))
            saved, buffers, work = saved + carry, 0, op  # op: B's residuals in one moment
        head_tokens = tr.micro_batch * md.seq_len
    return {
        "saved": saved,
        "pipeline_buffers": buffers,
        "tick_grads": tick_grads,
        "head_kept": head_kept,
        "work": work,
        "ticks": ticks,
        "layers_per_stage": per_stage,
        "head_tokens": head_tokens,
    }


def offloaded_per_layer(cfg: Config, profile: DeviceProfile, sets: dict) -> tuple[int, str]:
    """`(bytes, why)`: bytes of one layer's saved values that live in host memory with
    `memory.offload=[activations]` (the remat policy's values, not the layer's input, which
    stays on the device as the layer scan's residual; `sets`: `layer_sets`), and, where
    that is 0 though activations are offloaded, why (else "")."""
    md = cfg.model
    if "activations" not in cfg.memory.offload:
        return 0, ""
    if not profile.offloads_activations:
        return 0, f"{profile.name}: the backend's program keeps saved values on the device"
    if cfg.mesh.pipeline > 1 and cfg.train.skip_bubbles:  # the compile refuses it
        return 0, "train.skip_bubbles: XLA:TPU rejects the program that offloads them"
    if md.remat not in ("minimal", "attention", "comms"):
        why = {"full": "remat full saves only layer inputs, which are never offloaded"}
        return 0, why.get(md.remat, f"remat {md.remat} with offload: not modelled")
    if cfg.memory.stream == "matrix":
        return 0, "memory.stream=matrix with offload: not modelled"
    return sets["saved"] - sets["btd"], ""


def fused_head(cfg: Config, profile: DeviceProfile) -> bool:
    """Whether the loss head holds its float32 logits once: a backend computing the head's
    gradient at once (`head_grads_at_once`) fuses the softmax, the loss and its cotangent
    into the logits' consumers, so one [b·T, V/t] value exists (read on GPT, float32 compute,
    no pipeline, RTS 1 to 4, tensor 1 and 2: tests/target/test_rts_tpu.py). Not with matrix
    streams: their step keeps two logits-shaped values through the layers' backward."""
    gpt32 = cfg.model.name == "gpt" and cfg.precision.compute == "float32"
    whole = cfg.model.sequence_chunks == 1 and cfg.memory.vocab_slices == 1
    whole &= cfg.memory.stream != "matrix"
    return profile.head_grads_at_once and gpt32 and whole and cfg.mesh.pipeline == 1


def rounded_head(cfg: Config, profile: DeviceProfile, chunks: int) -> bool:
    """Whether a 16-bit loss head holds at most one float32 logits value and one in the
    compute dtype at its peak (`head_grads_at_once`: XLA:TPU; BERT and GPT, without a
    pipeline and under GPipe, tests/target/test_head_tpu.py), not two float32 ones; the
    head whole (no chunks or vocabulary slices, not read)."""
    sixteen = cfg.precision.compute != "float32"
    whole = chunks == 1 and cfg.memory.vocab_slices == 1
    return profile.head_grads_at_once and sixteen and whole


def _head_logits(cfg: Config, tokens: int, cb: int, profile: DeviceProfile) -> tuple[int, int]:
    """`(head, chunks)`: bytes of the loss head at its peak over `tokens` tokens, in `chunks`
    chunks (`sequence_chunks`, as the engine divides the head's tokens): float32 logits over
    V/t (/ `memory.vocab_slices`) rows in their live copies (`fused_head`), plus the
    final LN's values."""
    md = cfg.model
    vocab_rows = md.vocab // cfg.mesh.tensor // cfg.memory.vocab_slices  # a slice's logits
    chunks = math.gcd(md.sequence_chunks, tokens)  # loss head chunks (as the engine)
    copies = SLICED_HEAD_LOGIT_COPIES if cfg.memory.vocab_slices > 1 else HEAD_LOGIT_COPIES
    if cfg.precision.compute != "float32":
        copies = min(copies, ROUNDED_HEAD_LOGIT_COPIES)
    if fused_head(cfg, profile):
        copies = 1
    logit_bytes = 4 * copies
    if rounded_head(cfg, profile, chunks):
        logit_bytes = 4 + cb  # the float32 logits and the compute dtype's
    head = tokens * vocab_rows * logit_bytes // chunks
    head += tokens * md.d_model * cb * (4 if md.name == "gpt" else 9) // chunks
    return head, chunks


def _head_peak(cfg: Config, tokens: int, head: int, chunks: int) -> int:
    """Bytes the loss head adds to its moment: its logits (`head`), and where its table's
    gradient is summed in a loop (over slices of rows or chunks of tokens) that loop's terms."""
    md, mesh = cfg.model, cfg.mesh
    pb = DTYPE_BYTES[cfg.precision.params]
    if cfg.memory.vocab_slices > 1:
        # the head's loop over slices of table rows carries the table's gradient, reduce-
        # scattered slice by slice (RTS): the carry and its update (read on
        # test_plan_vs_xla's vocab-slices config, 4x2x1, benchmarks/xla_peak.py)
        table = md.vocab // mesh.tensor * md.d_model * pb // cfg.memory.rts
        return head + 2 * table
    if chunks > 1:
        # in chunks, the head's table gradient is summed inside its chunk loop: the loop's
        # accumulator, and at a chunk's backward its term beside the chunk's logits'
        # cotangent (read on bench_planner's vocab row)
        vocab_rows = md.vocab // mesh.tensor // cfg.memory.vocab_slices
        logits = tokens * vocab_rows * 4 // chunks
        table = vocab_rows * md.d_model * pb
        return max(head, logits + table) + table
    return head


def _head_moment(cfg: Config, pipe: dict, saved: int, btd: int, head_peak: int) -> int:
    """Bytes of activations alive at the loss head (end of the forward pass): the saved
    residuals on the device (`saved`), the forward's rows (`btd` bytes each), the head
    (`head_peak`)."""
    tr = cfg.train
    if cfg.mesh.pipeline > 1 and tr.pipeline_schedule not in STEPWISE:
        # the embedded micro-batches (BERT: and its LN's rows)
        micro = cfg.pipeline_group
        return saved + (micro + 2 * micro * (cfg.model.name == "bert")) * btd + head_peak
    return saved + pipe["pipeline_buffers"] + pipe["tick_grads"] + head_peak


def activation_bytes(cfg: Config, profile: DeviceProfile | None = None) -> dict:
    """Activation bytes per device, with the breakdown.

    - `saved`: residuals kept for the backward pass; `pipeline_buffers`: what the backward
      tick scan holds besides; `tick_grads`: the gradient of the stage's layer stack that a
      tick's layer scan carries (`_pipeline_terms`).
    - `head`: the loss head: float32 logits over this device's tokens (mb·T; M·mb·T/S when the
      pipeline spreads the head over the stages) x V/t (/ `memory.vocab_slices`), x 3 live
      copies, plus the final LN; the tokens in `sequence_chunks` chunks (`_head_logits`).
    - `head_kept`: the head's operands for its weight gradients, alive through the layers'
      backward (`_head_kept`).
    - `layer_work`: one layer's backward working set (recomputation under remat).
    - `host`: the saved values in host memory (`offloaded_per_layer`, for each layer of the
      micro-batch in flight; gpipe and circular: of every tick; stepwise: of the backward
      tick, on the device too, `host_saved`; `host_why` says why none where offloaded);
      `saved_on_device` the rest of `saved`.
    Two moments: `head_moment` (saved on the device, the forward's embedded rows, the head; a
    head in chunks also its table gradient) and `backward_moment` (saved on the device, one
    layer's offloaded values read back, pipeline_buffers + tick_grads + head_kept + layer_work);
    `total` is the larger; `device_bytes` adds to each moment what else is alive then (1f1b
    runs its head inside the backward ticks). `head_table` is the head's table copy.
    """
    profile = profile or get_profile(cfg.memory.device)
    cb = compute_bytes(cfg, profile)
    if cfg.model.name == "efficientnet":  # packed heterogeneous stages
        return _packed_activation_bytes(cfg, profile, cb)
    sb = stored_bytes(cfg, profile)
    fuses, converts = profile.fuses_recomputation, profile.converts_matrices
    sets = layer_sets(tick_policy(cfg), cb, sb, fuses, converts)
    pipe = _pipeline_terms(cfg, sets, sb, profile)
    tokens = pipe["head_tokens"]
    head, head_chunks = _head_logits(cfg, tokens, cb, profile)
    per_layer, why = offloaded_per_layer(cfg, profile, sets)
    saved = pipe["saved"]
    host, lifted = host_saved(cfg, pipe, per_layer)
    on_device_saved = saved - lifted
    # a layer's backward reads its offloaded values back: one layer's are on the device then
    backward = on_device_saved + min(per_layer, lifted) + pipe["pipeline_buffers"]
    backward += pipe["tick_grads"] + pipe["head_kept"] + pipe["work"]
    head_peak = _head_peak(cfg, tokens, head, head_chunks)
    head_moment = _head_moment(cfg, pipe, on_device_saved, sets["btd"], head_peak)
    return {
        "saved": saved,
        "saved_on_device": on_device_saved,
        "saved_per_layer": sets["saved"],
        "pipeline_buffers": pipe["pipeline_buffers"],
        "tick_grads": pipe["tick_grads"],
        "head": head,
        "head_kept": pipe["head_kept"],
        "layer_work": sets["work"],
        "backward_moment": backward,
        "head_moment": head_moment,
        "head_table": _head_table(cfg, cb),
        "ticks": pipe["ticks"],
        "layers_per_stage": pipe["layers_per_stage"],
        "total": max(backward, head_moment),
        "host": host,
        "host_why": why,
        "estimated": False,
    }


@lru_cache(maxsize=512)
def route_slots(kind: str, stages: int, micro: int, virtual: int) -> int:
    """The ring-buffer slots a chunked schedule's routes assign a device (worked out once per
    table: a search plans the same tables many times)."""
    return routes(make_schedule(kind, stages, micro, virtual)).slots
