"""The pod planner: where every byte of a mapping lives, before any hardware is spent.

`plan(cfg)` is analytic and instant: it builds no weights and imports no jax. Parameter counts
come from the model's formulas (an EfficientNet's from its block specs), per-device bytes from
the parameter layout of `jaxpod.parallel.mesh` (`LOGICAL_TO_MESH`), activations from a model of
what the train step keeps alive, checked against XLA's `memory_analysis()` of the compiled step
in `tests/planner/test_plan_vs_xla.py`.

Parameter counts (D = d_model, F = d_ff, V = vocab, T = seq_len, L = layers):

    one layer   4·D² + 2·D·F + 9·D + F
                (LNs 2·2D; qkv D·3D + 3D; out D·D + D; MLP D·F + F + F·D + D)
                GQA: qkv D·Q + Q with Q = D + 2·kv_heads·D/heads; SwiGLU: W_in D·2F + 2F;
                RoPE: no position table (`jaxpod.planner.counts.layer_params`)
    gpt         L·layer + V·D (tokens) + T·D (positions) + 2D (final LN) [+ V·D if untied]
    bert        L·layer + V·D + T·D + 2·D (token types) + 2D (embedding or final LN)
                + MLM head D·D + D (dense) + 2D (LN) + V (output bias; output weights tied)

Pre- or post-LN layers have the same parameters. Per device, the layer weights split over
`pipeline` (layers) and `tensor` (heads/MLP columns; LN and the D-sized biases are
replicated), the vocabulary-sized tables over `tensor` only, positions and LNs are replicated
(positions split over `tensor` along T with sequence parallelism). The byte model (what each
kind of state costs per device) is `jaxpod.planner.activations` and `jaxpod.planner.bytes`.
"""

from __future__ import annotations

import dataclasses

from jaxpod.config import Config, parse_bytes
from jaxpod.config.divisibility import accepts, sizes
from jaxpod.errors import UserError
from jaxpod.parallel.schedules import STEPWISE
from jaxpod.planner import schedule_choice
from jaxpod.planner.activations import DTYPE_BYTES, activation_bytes
from jaxpod.planner.bytes import device_bytes
from jaxpod.planner.counts import (
    efficientnet_stage_params,
    flops_per_example,
    layer_params,
    param_layout,
)
from jaxpod.planner.phased import held_phases
from jaxpod.planner.profiles import PROFILES, DeviceProfile, get_profile
from jaxpod.planner.report import format_bytes, format_plan

__all__ = [  # profiles, parameter counts and the report are re-exported from their modules
    "PROFILES",
    "DeviceProfile",
    "check_budget",
    "efficientnet_stage_params",
    "format_bytes",
    "format_plan",
    "get_profile",
    "layer_params",
    "param_layout",
    "plan",
]


def _budget(cfg: Config, profile: DeviceProfile) -> int:
    budget = parse_bytes(cfg.memory.device_budget)
    return profile.device_bytes if budget is None else budget


def _with_memory(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **changes))


def _with_model(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def _with_train(cfg: Config, **changes) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def _device_total(cfg: Config, params_override: int | None) -> int:
    layout = param_layout(cfg, params_override)
    return device_bytes(cfg, layout, activation_bytes(cfg))["device_total"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _fewest(
    cfg: Config, limit: int, params_override, counts: list[int], changes, fit_only=False
) -> dict:
    """Of `counts`, the fewest whose `memory` changes (`changes(k)`) fit; if none does (and
    not `fit_only`), the fewest that give the smallest total, when that is smaller than now.
    The changes, or {}."""
    totals = {k: _device_total(_with_memory(cfg, **changes(k)), params_override) for k in counts}
    fits = [k for k in counts if totals[k] <= limit]
    if fits:
        return changes(fits[0])
    if fit_only:
        return {}
    if totals and min(totals.values()) < _device_total(cfg, params_override):
        return changes(min(totals, key=lambda k: (totals[k], k)))
    return {}


def _finer_stream(cfg: Config, limit: int, params_override: int | None) -> dict:
    """Streaming matrix by matrix with the fewest MLP panels (of those that divide the
    device's hidden units, up to 64) that fits, or gives the smallest total (`_fewest`)."""
    counts = [k for k in _divisors(cfg.model.d_ff // cfg.mesh.tensor) if k <= 64]
    if cfg.memory.stream == "matrix":
        counts = [k for k in counts if k > cfg.memory.mlp_panels]
        return _fewest(cfg, limit, params_override, counts, lambda k: {"mlp_panels": k})
    changes = lambda k: {"stream": "matrix", "mlp_panels": k}
    return _fewest(cfg, limit, params_override, counts, changes)


def _finer_vocab(cfg: Config, limit: int, params_override: int | None) -> dict:
    """GPT's token table in the fewest slices of rows (dividing the device's rows, up to 64,
    more than now) that fits (`_fewest`), or {}."""
    rows = cfg.model.vocab // cfg.mesh.tensor
    counts = [k for k in _divisors(rows) if cfg.memory.vocab_slices < k <= 64]
    changes = lambda k: {"vocab_slices": k}
    return _fewest(cfg, limit, params_override, counts, changes, fit_only=True)


def _divides(trial: Config) -> bool:
    """Whether `trial` passes every divisibility rule (`jaxpod.config.divisibility`): the
    batch, the schedule, the heads, the streamed pieces, as validation checks them."""
    return accepts(sizes(trial))


def _memory_changes(cfg: Config, limit: int, params_override: int | None) -> list:
    """`(label, trial)` of the `memory` changes that lower the device bytes: a finer stream
    or token table (gathered a step or a slice at a time under RTS), RTS over every replica,
    the optimizer state offloaded (when that lowers the total)."""
    mem, mesh = cfg.memory, cfg.mesh
    out = []
    if cfg.kind.stages == "stacked" and mem.rts > 1 and cfg.model.remat != "none":
        stream = _finer_stream(cfg, limit, params_override)  # gathered a step at a time
        if stream:
            label = " ".join(f"memory.{k}={v}" for k, v in stream.items())
            out.append((label, _with_memory(cfg, **stream)))
    if cfg.model.name == "gpt" and mem.rts > 1:  # the token table gathered a slice at a time
        vocab = _finer_vocab(cfg, limit, params_override)
        if vocab:
            out.append((f"memory.vocab_slices={vocab['vocab_slices']}", _with_memory(cfg, **vocab)))
    if cfg.kind.stages == "stacked" and mesh.replica > mem.rts:
        out.append(
            (
                f"memory.rts={mesh.replica} memory.rts_optimizer={mesh.replica}",
                _with_memory(cfg, rts=mesh.replica, rts_optimizer=mesh.replica),
            )
        )
    if "optimizer" not in mem.offload and cfg.kind.stages == "stacked":
        offload = tuple(sorted({*mem.offload, "optimizer"}))
        trial = _with_memory(cfg, offload=offload)
        if _device_total(trial, params_override) < _device_total(cfg, params_override):
            out.append((f"memory.offload=[{','.join(offload)}]", trial))
    return out


def _model_changes(cfg: Config) -> list:
    """`(label, trial)` of the `model` changes that lower the activations: sequence
    parallelism (under tensor parallelism), sequence chunks, full remat."""
    md, mesh = cfg.model, cfg.mesh
    out = []
    if cfg.kind.tensor_parallel and mesh.tensor > 1 and not md.sequence_parallel:
        out.append(("model.sequence_parallel=true", _with_model(cfg, sequence_parallel=True)))
    if cfg.kind.data == "tokens" and md.sequence_chunks == 1:
        out.append(("model.sequence_chunks=8", _with_model(cfg, sequence_chunks=8)))
    if md.remat not in ("full",):
        out.append(("model.remat=full", _with_model(cfg, remat="full")))
    return out


def _fits(trial: Config, limit: int, params_override: int | None) -> bool:
    """Whether `trial` passes the divisibility rules and its device total fits `limit`."""
    return _divides(trial) and _device_total(trial, params_override) <= limit


def _train_changes(cfg: Config, limit: int, params_override: int | None) -> list:
    """`(label, trial)` of the `train` changes that hold fewer micro-batches' activations:
    1F1B (S micro-batches' stage inputs, not every tick's activations), the largest pipeline
    pass that fits, the fewest batch parts that fit (one part on the device)."""
    tr = cfg.train
    fits = lambda **changes: _fits(_with_train(cfg, **changes), limit, params_override)
    out = []
    if cfg.mesh.pipeline > 1 and tr.pipeline_schedule not in STEPWISE:
        trial = _with_train(cfg, pipeline_schedule="1f1b", virtual_stages=1)
        if _device_total(trial, params_override) < _device_total(cfg, params_override):
            out.append(("train.pipeline_schedule=1f1b", trial))
    if cfg.mesh.pipeline > 1:  # fewer micro-batches in flight
        smaller = [g for g in _divisors(cfg.part_micro) if g < cfg.pipeline_group]
        group = next((g for g in reversed(smaller) if fits(pipeline_group=g)), 0)
        if group:
            out.append((f"train.pipeline_group={group}", _with_train(cfg, pipeline_group=group)))
    if cfg.kind.fixed_denominator:
        more = (k for k in _divisors(tr.grad_accum) if k > tr.batch_parts)
        parts = next((k for k in more if fits(batch_parts=k)), 0)
        if parts:
            out.append((f"train.batch_parts={parts}", _with_train(cfg, batch_parts=parts)))
    return out


def _mesh_changes(cfg: Config) -> list:
    """`(label, trial)` of a deeper pipeline on half the replicas (stacked layers), RTS no
    wider than the replicas left; `_suggest` keeps it if the divisibility rules accept it."""
    mesh, mem = cfg.mesh, cfg.memory
    p2 = mesh.pipeline * 2
    if mesh.replica % 2 or cfg.kind.stages != "stacked":
        return []
    trial = dataclasses.replace(
        cfg, mesh=dataclasses.replace(mesh, pipeline=p2, replica=mesh.replica // 2)
    )
    if mem.rts > trial.mesh.replica or (mem.rts_optimizer or 1) > trial.mesh.replica:
        trial = _with_memory(trial, rts=1, rts_optimizer=None)
    return [(f"mesh.pipeline={p2} mesh.replica={mesh.replica // 2}", trial)]


def _suggest(cfg: Config, limit: int, params_override: int | None) -> str:
    """Single changes that lower the device bytes, each with the total its own re-plan gives:
    those that fit `limit` first, then those that only come closer (a change that does not
    lower the total, or that a divisibility rule refuses, is left out)."""
    changes = [
        *_memory_changes(cfg, limit, params_override),
        *_model_changes(cfg),
        *_train_changes(cfg, limit, params_override),
        *_mesh_changes(cfg),
    ]
    fit, closer = [], []
    now = _device_total(cfg, params_override)
    for label, trial in changes:
        if not _divides(trial):  # e.g. a deeper pipeline its schedule or head cannot split
            continue
        total = _device_total(trial, params_override)
        if total <= limit or total < now:
            (fit if total <= limit else closer).append(f"{label} ({format_bytes(total)})")
    if fit:
        return (
            f"to fit {format_bytes(limit)}, try: "
            + "; or ".join(fit)
            + ("; closer, not under it alone: " + "; ".join(closer) if closer else "")
        )
    if closer:
        return (
            f"no single change fits {format_bytes(limit)}; these lower the device total: "
            + "; ".join(closer)
        )
    return "no single change fits; use more devices or a smaller model"


def _bubble(cfg: Config) -> float:
    """The idle fraction of the pipeline's stage-ticks (0 without a pipeline): the
    schedule's own table (`jaxpod.parallel.schedules`, jax-free), one pass of it."""
    if cfg.mesh.pipeline == 1:
        return 0.0
    from jaxpod.parallel.schedules import make_schedule

    t = cfg.train
    kind, virtual = t.pipeline_schedule, t.virtual_stages
    return make_schedule(kind, cfg.mesh.pipeline, cfg.pipeline_group, virtual).bubble


def _layout(cfg: Config, params_override: int | None) -> dict:
    """The parameter layout (`param_layout`); with `params_override` on stacked layers, the
    formula's layout scaled to that count, so that it keeps the formula's shape (its layers,
    per-device and non-layer shares)."""
    layout = param_layout(cfg, params_override)
    if params_override is not None and cfg.kind.stages == "stacked":  # keep the layout's shape
        formula = param_layout(cfg)
        scale = params_override / max(formula["total"], 1)
        for key in ("layers", "local", "local_layers", "local_other"):
            layout[key] = int(formula[key] * scale)
    return layout


def _mapping(cfg: Config) -> dict:
    """The plan's mesh and batch: devices per axis, the batch's split and the pipeline's
    schedule with its bubble."""
    mesh, tr = cfg.mesh, cfg.train
    return {
        "devices": mesh.replica * mesh.pipeline * mesh.tensor,
        "replica": mesh.replica,
        "pipeline": mesh.pipeline,
        "tensor": mesh.tensor,
        "micro_batch": tr.micro_batch,
        "grad_accum": tr.grad_accum,
        "batch_parts": tr.batch_parts,
        "pipeline_group": cfg.pipeline_group,
        "pipeline_schedule": tr.pipeline_schedule if mesh.pipeline > 1 else None,
        "virtual_stages": tr.virtual_stages,
        "bubble": _bubble(cfg),
        "global_batch": tr.global_batch,
    }


def _weights(cfg: Config, layout: dict) -> dict:
    """The plan's model and memory settings: parameters (whole and per device), how the
    weights are sharded, offloaded and streamed, remat, the optimizer and the dtypes' bytes."""
    mesh, mem, prec = cfg.mesh, cfg.memory, cfg.precision
    rts = mem.rts
    return {
        "params": layout["total"],
        "params_estimated": layout["estimated"],
        "flops_per_example": flops_per_example(cfg),
        "params_per_device": int(layout["local"] / rts),
        "weight_fraction_per_device": 1 / (mesh.tensor * mesh.pipeline * rts),
        "rts": rts,
        "rts_optimizer": mem.rts_optimizer or rts,
        "offload": list(mem.offload),
        "configured_phases": mem.phases,
        "configured_stream": mem.stream,
        "mlp_panels": mem.mlp_panels,
        "vocab_slices": mem.vocab_slices,
        "remat": cfg.model.remat,
        "optimizer": cfg.optim.name,
        "dtype_bytes": {
            "params": DTYPE_BYTES[prec.params],
            "compute": DTYPE_BYTES[prec.compute],
            "master": 4 if prec.master == "float32" else DTYPE_BYTES[prec.params],
        },
    }


def plan(cfg: Config, params_override: int | None = None, *, advice: bool = True) -> dict:
    """Where every byte of `cfg`'s mapping lives, per device. Analytic: no jax, no weights.

    `params_override` replaces the formula's parameter count (e.g. EfficientNet's exact
    `count_params`); per-device counts then scale with it. `advice`: also which pipeline
    schedule to run (`jaxpod.planner.schedule_choice`). Returns a JSON-able dict (see the
    module docstring for the byte model)."""
    profile = get_profile(cfg.memory.device)
    layout = _layout(cfg, params_override)
    acts = activation_bytes(cfg, profile)
    per_device = device_bytes(cfg, layout, acts, profile)
    limit = _budget(cfg, profile)
    fits = per_device["device_total"] <= limit
    result = {
        "model": cfg.model.name,
        "device_profile": profile.name,
        **_mapping(cfg),
        **_weights(cfg, layout),
        "held_phases": held_phases(cfg, profile),
        "bytes_per_device": per_device,
        "activations_breakdown": acts,
        "device_memory_bytes": limit,
        "device_profile_bytes": profile.device_bytes,
        "streaming_memory_bytes": profile.streaming_bytes,
        "fits": fits,
        "host_fits": per_device["host_total"] <= profile.streaming_bytes,
    }
    if not fits:
        result["suggestion"] = _suggest(cfg, limit, params_override)
    if advice:
        total = lambda c: _device_total(c, params_override)  # noqa: E731
        result["schedule_advice"] = schedule_choice.advise(cfg, limit, total)
    return result


def check_budget(cfg: Config, plan_: dict | None = None) -> None:
    """Refuse a mapping whose planned device bytes exceed `memory.device_budget` (one line)."""
    budget = parse_bytes(cfg.memory.device_budget)
    if budget is None:
        return
    p = plan(cfg) if plan_ is None else plan_
    total = p["bytes_per_device"]["device_total"]
    if total <= budget:
        return
    b = p["bytes_per_device"]
    parts = ", ".join(
        f"{k} {format_bytes(b[k])}" for k in ("weights", "grads", "optimizer", "activations")
    )
    suggestion = p.get("suggestion") or "use more RTS or a deeper pipeline"
    raise UserError(
        f"memory.device_budget={cfg.memory.device_budget}: the plan needs "
        f"{format_bytes(total)} per device ({parts}) > {format_bytes(budget)}; {suggestion}"
    )
