"""The divisibility rules of the pipeline schedule (virtual stages, the ring's groups, phases
per chunk) and of the pipelined heads (training's and evaluation's, which spread a pass's
output tokens over the stages): part of the one table `jaxpod.config.divisibility.RULES`.
Each rule names the fields it reads (`rule(...)`) and returns its one-line message, or None.
"""

from __future__ import annotations

from jaxpod.config.rule_sizes import (
    Sizes,
    call_micro,
    collector,
    head_rows,
    kind_of,
    micro_name,
    pass_micro,
)
from jaxpod.config.schema import CHUNKED, STEPWISE

RULES, rule = collector()


# ------------------------------------------------------------------ the pipeline schedule
@rule("train.pipeline_schedule", "train.virtual_stages")
def _virtual_stages_need_chunks(v: Sizes) -> str | None:
    kind, virtual = v["train.pipeline_schedule"], v["train.virtual_stages"]
    if virtual > 1 and kind not in CHUNKED:
        return (
            f"train.virtual_stages={virtual} splits each pipeline stage into virtual stages, "
            f"which train.pipeline_schedule={kind} does not run; set train.virtual_stages=1, "
            f"or a schedule of {', '.join(CHUNKED)}"
        )
    if kind == "zb-v" and virtual != 2:
        return (
            "train.pipeline_schedule=zb-v runs two chunks per stage in a V; set "
            f"train.virtual_stages=2 (not {virtual})"
        )
    if kind in CHUNKED and virtual < 2:
        return (
            f"train.pipeline_schedule={kind} needs train.virtual_stages >= 2 (virtual "
            "stages per stage; with 1 it is gpipe or 1f1b)"
        )
    return None


@rule("train.pipeline_schedule", "mesh.pipeline", "model.name")
def _schedule_needs_stages(v: Sizes) -> str | None:
    kind = v["train.pipeline_schedule"]
    if kind != "gpipe" and v["mesh.pipeline"] == 1:
        return (
            f"train.pipeline_schedule={kind} schedules pipeline stages but mesh.pipeline=1; "
            "set mesh.pipeline > 1 or train.pipeline_schedule=gpipe"
        )
    if kind in CHUNKED and kind_of(v).stages != "stacked":
        return (
            f"train.pipeline_schedule={kind} cuts a stack of identical layers into virtual "
            f"stages; model.name={v['model.name']} has heterogeneous stages: use gpipe, 1f1b "
            "or zb-h1"
        )
    return None


@rule("train.pipeline_schedule", "model.layers", "mesh.pipeline", "train.virtual_stages")
def _chunks_split_layers(v: Sizes) -> str | None:
    layers, chunks = v["model.layers"], v["mesh.pipeline"] * v["train.virtual_stages"]
    if v["train.pipeline_schedule"] in CHUNKED and layers % chunks:
        return (
            f"model.layers={layers} does not divide into mesh.pipeline*train.virtual_stages"
            f" = {v['mesh.pipeline']}*{v['train.virtual_stages']} = {chunks} virtual stages; "
            f"use a multiple of {chunks}"
        )
    return None


@rule(
    "train.pipeline_schedule",
    "mesh.pipeline",
    "train.grad_accum",
    "train.batch_parts",
    "train.pipeline_group",
)
def _ring_takes_whole_groups(v: Sizes) -> str | None:
    kind, stages, group = v["train.pipeline_schedule"], v["mesh.pipeline"], pass_micro(v)
    if kind in CHUNKED and kind != "zb-v" and group % stages:
        return (
            f"{micro_name(v)}={group} micro-batches per pass is not a multiple of "
            f"mesh.pipeline={stages}: train.pipeline_schedule={kind} sends them around the "
            f"ring in groups of {stages}; use a multiple of {stages}"
        )
    return None


@rule(
    "train.pipeline_schedule",
    "model.layers",
    "mesh.pipeline",
    "train.virtual_stages",
    "memory.phases",
)
def _phases_split_chunk(v: Sizes) -> str | None:
    chunks = v["mesh.pipeline"] * v["train.virtual_stages"]
    per_virtual, phases = v["model.layers"] // chunks, v["memory.phases"]
    if v["train.pipeline_schedule"] in CHUNKED and per_virtual % phases:
        return (
            f"memory.phases={phases} does not divide the {per_virtual} layers of a virtual "
            "stage (model.layers/(mesh.pipeline*train.virtual_stages)); use a divisor of "
            f"{per_virtual}"
        )
    return None


# ------------------------------------------------------------------ the pipelined heads
HEAD = (
    "model.name",
    "mesh.pipeline",
    "mesh.tensor",
    "model.seq_len",
    "model.sequence_parallel",
    "train.micro_batch",
    "train.grad_accum",
    "train.batch_parts",
    "train.pipeline_schedule",
)


@rule(*HEAD, "train.pipeline_group")
def _training_head_spreads(v: Sizes) -> str | None:
    """GPipe and circular training run the head on 1/S of a pass's output tokens on every
    stage (a reduce-scatter over the pipeline); the tables with backward ops run it on the
    last stage, one micro-batch at a time."""
    stages, kind = v["mesh.pipeline"], v["train.pipeline_schedule"]
    if kind_of(v).stages != "stacked" or stages == 1 or kind in STEPWISE:
        return None
    rows, how = head_rows(v, pass_micro(v), micro_name(v))
    if rows % stages:
        return (
            f"{how} = {rows} output tokens per pipeline pass (per tensor shard) is not "
            f"divisible by mesh.pipeline={stages}; change one of them"
        )
    return None


@rule(*HEAD)
def _evaluation_head_spreads(v: Sizes) -> str | None:
    """Evaluation runs a call's micro-batches through one forward-only pass (GPipe's table
    for 1F1B and ZB-H1, circular's for interleaved 1F1B) and its head on 1/S of the output
    tokens on every stage; ZB-V's forwards keep the head on the last stage."""
    stages, kind = v["mesh.pipeline"], v["train.pipeline_schedule"]
    if kind_of(v).stages != "stacked" or stages == 1 or kind == "zb-v":
        return None
    rows, how = head_rows(v, call_micro(v), micro_name(v, group=False))
    if rows % stages:
        return (
            f"{how} = {rows} output tokens of an evaluation pass (per tensor shard) is not "
            f"divisible by mesh.pipeline={stages}: evaluation runs its head on 1/{stages} of "
            "them on every stage; change one of them"
        )
    return None
