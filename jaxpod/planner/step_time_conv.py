"""The step-time model for packed stages (EfficientNet): how long one optimizer step of a
mapping (replica x pipeline, no tensor axis) takes. Jax-free.

The terms are the transformer model's (`jaxpod.planner.step_time`), priced per stage from
its pieces' work per image (`jaxpod.planner.conv_work`): the matmul-like convs at the
device's peak times its achievable efficiency, discounted when a conv's contraction is
shallow (half the shortfall at `HALF_WIDTH`); the memory-bound work (depthwise convs,
GroupNorm, swish, squeeze-excitation, residual adds) at HBM bandwidth; forward and backward
three forwards' worth, four with remat `full` (any other policy keeps nothing a conv stage
names, so only `none` saves the forward). jaxpod runs the stages as one SPMD program
(`lax.switch` per tick), so a tick lasts its slowest stage: the busy time is the costliest
stage's. Beside it the pipeline's sends of the float32 carry `[mb, A]` (forward and its
cotangent back), the bubble of the schedule's own table in lockstep for each pass of the
pipeline (each call of the step, `train.batch_parts`, fills and drains it), the replicas'
all-reduce of the gradient row (n_max, the largest stage's parameters) and the update of
the row at HBM bandwidth. Figures per step, in seconds.
"""

from __future__ import annotations

from jaxpod.config import Config
from jaxpod.planner.activations import DTYPE_BYTES, MOMENTS, grad_bytes
from jaxpod.planner.conv_work import balanced_splits, pieces_work, stages_work
from jaxpod.planner.counts import efficientnet_stage_params
from jaxpod.planner.efficientnet import carry_size
from jaxpod.planner.efficientnet_pieces import pieces
from jaxpod.planner.speed import Speed
from jaxpod.planner.step_time import (
    HALF_WIDTH,
    LINK_EFFICIENCY,
    data_seconds,
    link_for,
    schedule_bubble,
)


class _Mesh:
    """What `data_seconds` reads of a workload: d replicas (c = 1) of `devices`."""

    def __init__(self, d: int, devices: int):
        self.d, self.c, self.devices = d, 1, devices


def piece_seconds(piece: dict, speed: Speed, dtype: str) -> tuple[float, float]:
    """`(matmul, memory)` seconds of one piece's forward on one image."""
    peak = speed.flops[dtype] * speed.compute_efficiency
    matmul = sum(f / (peak * d / (d + HALF_WIDTH)) for f, d in piece["matmuls"])
    return matmul, piece["memory"] / speed.hbm_bandwidth


def stage_seconds(cfg: Config, speed: Speed, splits: tuple[str, ...] | None = None) -> list:
    """Per stage, `(matmul, memory)` seconds of its forward on one image."""
    act = DTYPE_BYTES[cfg.precision.compute]
    out = []
    for stage in stages_work(cfg, act, splits):
        parts = [piece_seconds(p, speed, cfg.precision.compute) for p in stage]
        out.append((sum(m for m, _ in parts), sum(b for _, b in parts)))
    return out


def compute_seconds(cfg: Config, speed: Speed) -> dict:
    """Matmul and memory-bound seconds per step of the costliest stage (lockstep: a tick
    lasts its slowest stage), before the bubble; `stages`: every stage's total."""
    images = cfg.global_batch / cfg.mesh.replica  # per pipeline
    passes = 4 if cfg.model.remat == "full" else 3
    per_stage = [(m * passes * images, b * passes * images) for m, b in stage_seconds(cfg, speed)]
    slowest = max(per_stage, key=sum)
    return {"matmul": slowest[0], "memory": slowest[1], "stages": [sum(s) for s in per_stage]}


def comm_seconds(cfg: Config, speed: Speed) -> dict:
    """Pipeline sends and the replicas' gradient all-reduce, seconds per step."""
    mesh, tr = cfg.mesh, cfg.train
    row = max(efficientnet_stage_params(cfg))  # n_max: every device's row
    micro = cfg.global_batch // (tr.micro_batch * mesh.replica)
    pipeline = 0.0
    if mesh.pipeline > 1:
        carry = tr.micro_batch * carry_size(pieces(cfg)) * 4  # float32 [mb, A]
        link = link_for(speed, mesh.pipeline)
        pipeline = 2 * micro * carry / (link * LINK_EFFICIENCY)
    grads = row * grad_bytes(cfg)
    data = data_seconds(grads, _Mesh(mesh.replica, cfg.devices), speed, all_reduce=True)
    return {"tensor": 0.0, "pipeline": pipeline, "data": data}


def update_seconds(cfg: Config, speed: Speed) -> float:
    """The update of the row: weights and master (read and written), the optimizer's moments
    (read and written) and the gradient (read), at HBM bandwidth."""
    prec = cfg.precision
    pb = DTYPE_BYTES[prec.params]
    master = 4 if prec.master == "float32" and pb != 4 else 0  # a float32 copy beside
    moment = 4 if cfg.optim.moments == "float32" else (master or pb)
    per_param = 2 * (pb + master + MOMENTS[cfg.optim.name] * moment) + grad_bytes(cfg)
    return max(efficientnet_stage_params(cfg)) * per_param / speed.hbm_bandwidth


def bubble_factor(cfg: Config) -> float:
    """Step time over busy time of the schedule's table in lockstep, for one pass of
    `cfg.pipeline_group` micro-batches."""
    mesh, tr = cfg.mesh, cfg.train
    if mesh.pipeline == 1:
        return 1.0
    full = cfg.model.remat == "full"
    kind, p, m, v = tr.pipeline_schedule, mesh.pipeline, cfg.pipeline_group, tr.virtual_stages
    return schedule_bubble(kind, p, m, v, True, full)


def estimate_packed(cfg: Config, speed: Speed) -> dict:
    """Seconds per step and the breakdown `jaxpod.planner.step_time.estimate` gives (its
    keys), plus `stage_s`: each stage's busy seconds."""
    comp = compute_seconds(cfg, speed)
    comm = comm_seconds(cfg, speed)
    update = update_seconds(cfg, speed)
    busy = comp["matmul"] + comp["memory"]
    stage = (busy + comm["pipeline"]) * bubble_factor(cfg)
    return {
        "step_s": stage + comm["data"] + update,
        "matmul_s": comp["matmul"],
        "memory_s": comp["memory"],
        "update_s": update,
        "bubble_s": stage - busy - comm["pipeline"],
        **{f"{k}_exposed_s": v for k, v in comm.items()},
        **{f"{k}_s": v for k, v in comm.items()},
        "stage_s": comp["stages"],
    }


def split_choices(
    cfg: Config, speed: Speed, stages: int, own: tuple | None = None
) -> list[tuple[str, ...]]:
    """The `model.pipeline_splits` a search tries for `stages` stages: the cut whose
    costliest stage (forward seconds per image, `piece_seconds`) is cheapest, and `own`
    (default: the config's) where it has that many stages."""
    act = DTYPE_BYTES[cfg.precision.compute]
    work = pieces_work(cfg, act)
    costs = [sum(piece_seconds(p, speed, cfg.precision.compute)) for p in work]
    balanced = balanced_splits(costs, [p["name"] for p in work[1:-1]], stages)
    own = tuple(cfg.model.pipeline_splits if own is None else own)
    choices = [] if balanced is None else [balanced]
    if len(own) == stages - 1 and own not in choices:
        choices.append(own)
    return choices
