"""Each row of the published-runs file as a jaxpod config: `configs/tiny.yaml` (GPT) and the
KEY=VALUE overrides that give it the row's shape and mapping, or the reason jaxpod cannot.

`config_overrides(row)` writes the row as jaxpod would run it: the shape (GQA, SwiGLU and RoPE
for the Llama-family rows), t/p/d, the 1F1B schedule (interleaved with the row's virtual
stages), micro-batch and gradient accumulation, recompute as a remat policy (full -> full,
Megatron's selective -> `minimal`, which recomputes the attention core only), sequence
parallelism, the distributed optimizer as RTS of the optimizer state and FSDP as RTS of the
weights, the precision. `config_workload(row, direct)` loads that config and takes its
step-time workload through `jaxpod estimate`'s own path (`workload_of`), then sets what a
config cannot carry from the published run (`SOURCE_FIELDS`). `DIFFERENCES` names the fields
where the config's workload may still differ from the row's direct one, and why.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from jaxpod.config import MAX_PLANNED_DEVICES, ConfigError, load_config
from jaxpod.inspect.estimate import workload_of
from jaxpod.planner.step_time import Workload

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "tiny.yaml"
LLAMA = ("MXT", "DGXC-L")  # Llama-family sources: SwiGLU MLP, rotary positions
# the Workload fields a config cannot carry, taken from the published run: why each
SOURCE_FIELDS = {
    "flash": "fused attention that computes the causal half (jaxpod's attention is plain XLA)",
    "overlap": "collectives overlapped with compute as the source's framework does",
    "lockstep": "the source runs its pipeline MPMD (jaxpod's one SPMD program runs lockstep)",
    "grad_bytes": "the source's gradient all-reduce width (jaxpod's estimate counts float32)",
}
# field -> why the config's workload may differ from the direct one (same step time)
DIFFERENCES = {
    "sharding": "ZeRO-2 (gradients sharded, weights whole) has no jaxpod setting; RTS of the "
    "optimizer state is ZeRO-1, which the step-time model prices as ZeRO-2",
}


def _note(text: str, pattern: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def _shape(row: dict) -> list[str]:
    """The model's overrides: layers, widths, heads, sequence, vocabulary, MLP, positions."""
    h = int(row["hidden"])
    heads = row["heads"].split()[0]
    ffn = _note(row["notes"], r"(?:mlp|FFN) (\d+)") or 4 * h
    kv = _note(row["heads"], r"\((\d+) KV\)")
    out = [
        "model.name=gpt",
        f"model.layers={row['layers']}",
        f"model.d_model={h}",
        f"model.heads={heads}",
        f"model.d_ff={ffn}",
        f"model.seq_len={row['seq']}",
        f"model.vocab={row['vocab']}",
        "model.tie_embeddings=true",
    ]
    if kv:
        out.append(f"model.kv_heads={kv}")
    if row["source"].startswith(LLAMA):
        out += ["model.mlp=swiglu", "model.positions=rope"]
    return out


def _remat(recompute: str) -> str:
    """The remat policy of the source's recompute. For Megatron's selective recompute (the
    attention core again), `minimal`: it keeps every weight matmul's output and recomputes
    the attention core and the elementwise ops; the step-time model prices it as selective."""
    if "full" in recompute:
        return "full"
    return "minimal" if "selective" in recompute else "none"


def _sharding(row: dict, d: int) -> list[str]:
    """FSDP as RTS of the weights over the source's FSDP width (all replicas if it names
    none); the distributed optimizer (and ZeRO-2) as RTS of the optimizer state."""
    zero = row["zero/dist_opt"]
    if "dist-opt" in zero or "SHARD_GRAD_OP" in zero:
        return [f"memory.rts_optimizer={d}"]
    if "FSDP" in zero:
        width = _note(zero, r"FSDP (\d+)") or d
        return [f"memory.rts={width}"]
    return []


def config_overrides(row: dict) -> list[str] | str:
    """The overrides on `configs/tiny.yaml` that make the row's run, or why there are none."""
    if not row["global_batch"] and not row["micro_batch"]:
        return "the source gives no micro-batch or global batch"
    cp = _note(row["notes"], r"CP=(\d+)") or 1
    if cp > 1:
        return f"context parallelism CP={cp}: jaxpod splits no sequence over devices"
    t, p, d, vpp = (int(row[k] or 1) for k in ("t", "p", "d", "vpp"))
    gb = int(row["global_batch"] or 0)
    mb = int(row["micro_batch"] or max(gb // d, 1))
    if gb % (mb * d):
        return f"global batch {gb} is not a whole number of micro-batches {mb} x replicas {d}"
    dtype = "float16" if row["hardware"].startswith("V100") else "bfloat16"
    schedule = ["train.pipeline_schedule=1f1b"] if p > 1 else []
    if vpp > 1:
        schedule = ["train.pipeline_schedule=interleaved-1f1b", f"train.virtual_stages={vpp}"]
    return [
        *_shape(row),
        f"model.remat={_remat(row['recompute'])}",
        f"model.sequence_parallel={'true' if row['seq_parallel'] == 'yes' else 'false'}",
        f"devices={t * p * d}",
        f"mesh.tensor={t}",
        f"mesh.pipeline={p}",
        f"mesh.replica={d}",
        *schedule,
        f"train.micro_batch={mb}",
        f"train.grad_accum={gb // (mb * d)}",
        *_sharding(row, d),
        f"precision.params={dtype}",
        f"precision.compute={dtype}",
        "precision.master=float32",
        f"precision.loss_scale={'dynamic' if dtype == 'float16' else 'none'}",
    ]


def config_workload(row: dict, direct: Workload) -> Workload | str:
    """The row's config's workload, as `jaxpod estimate` builds it, with `SOURCE_FIELDS` (and
    the schedule, where the config has no pipeline) set from `direct`, the row's workload
    written from the file; or the reason the row is no config."""
    overrides = config_overrides(row)
    if isinstance(overrides, str):
        return overrides
    try:
        cfg = load_config(PRESET, overrides, max_devices=MAX_PLANNED_DEVICES)
    except ConfigError as err:
        return f"jaxpod refuses the config: {err}"
    source = {name: getattr(direct, name) for name in SOURCE_FIELDS}
    if cfg.mesh.pipeline == 1:  # no pipeline: the schedule names no table
        source["schedule"] = direct.schedule
    return dataclasses.replace(workload_of(cfg), **source)


def differences(config: Workload, direct: Workload) -> dict[str, str]:
    """`{field: why}` for each field where the two workloads differ (`DIFFERENCES`, or
    'unexplained')."""
    out = {}
    for f in dataclasses.fields(Workload):
        if getattr(config, f.name) != getattr(direct, f.name):
            out[f.name] = DIFFERENCES.get(f.name, "unexplained")
    return out
