"""`jaxpod estimate`: the step time of a config's mapping on N devices of a profile, from the
step-time model (`jaxpod.planner.step_time`). Jax-free: nothing is compiled.

    a100-80gb:1024    1,024 A100 80 GB (8 per node on NVLink, nodes on InfiniBand)
    tpu-v5p:8x8x4     a TPU topology as `compile --target` names it (256 chips)

jaxpod runs a pipeline as one SPMD program, so the estimate prices its schedule in lockstep
(a tick lasts its slowest op); RTS is FSDP (weights gathered per layer, gradients
reduce-scattered), the remat policy the recompute. EfficientNet's packed stages are priced
by `jaxpod.planner.step_time_conv` (the slowest stage sets each tick; images/s).
"""

from __future__ import annotations

import re

from jaxpod.config import Config
from jaxpod.errors import UserError
from jaxpod.planner.counts import flops_per_example, param_layout
from jaxpod.planner.speed import SPEEDS, get_speed
from jaxpod.planner.step_time import Workload, estimate, layer_flops
from jaxpod.planner.step_time_conv import estimate_packed

MAX_DEVICES = 65536
RECOMPUTE = {"none": "none", "full": "full", "minimal": "selective", "attention": "selective"}
RECOMPUTE |= {"comms": "selective"}


def parse_estimate_target(text: str) -> tuple[str, int]:
    """`(profile, devices)` of `PROFILE:N` or of a TPU topology (`tpu-v5p:8x8x4`)."""
    m = re.fullmatch(r"([a-z0-9-]+):(\d+)", text)
    if m and m.group(1) in SPEEDS:
        n = int(m.group(2))
        if not 1 <= n <= MAX_DEVICES:
            raise UserError(f"--target {text}: the device count must be 1 to {MAX_DEVICES}")
        return m.group(1), n
    if text.startswith("tpu-"):
        from jaxpod.target.spec import parse_target

        target = parse_target(text)
        return target.profile, target.chips
    names = ", ".join(n for n in SPEEDS if n != "cpu")
    raise UserError(
        f"--target {text}: name PROFILE:N (one of {names}; e.g. a100-80gb:1024) "
        "or a TPU topology such as tpu-v5p:8x8x4"
    )


def workload_of(cfg: Config) -> Workload:
    """The step-time model's view of a transformer config (its mesh resolved)."""
    md, m, t = cfg.model, cfg.mesh, cfg.train
    if cfg.kind.stages != "stacked":
        raise UserError(f"model.name={md.name}: a transformer workload is gpt or bert")
    replica = m.replica
    rts = max(cfg.memory.rts, cfg.memory.rts_optimizer or 1)
    return Workload(
        layers=md.layers,
        hidden=md.d_model,
        heads=md.heads,
        seq=md.seq_len,
        vocab=md.vocab,
        ffn=md.d_ff,
        kv_heads=md.kv_head_count,
        gated=md.mlp == "swiglu",
        rope=md.positions == "rope",
        global_batch=t.micro_batch * t.grad_accum * replica,
        micro_batch=t.micro_batch,
        t=m.tensor,
        p=m.pipeline,
        d=replica,
        virtual=t.virtual_stages,
        recompute=RECOMPUTE[md.remat],
        sequence_parallel=md.sequence_parallel,
        sharding="zero3" if cfg.memory.rts > 1 else ("zero1" if rts > 1 else "dp"),
        schedule=t.pipeline_schedule,
        lockstep=True,
        dtype=cfg.precision.compute,
    )


def estimate_config(cfg: Config, profile: str) -> dict:
    """The estimate of `cfg` on its mesh of `profile` devices: step time, tokens/s, model
    FLOP/s per device (6·params + attention per token, no recompute) and MFU, and the
    breakdown. A packed-stage model (EfficientNet) gives images/s instead of tokens/s."""
    if cfg.kind.stages == "packed":
        return _estimate_packed(cfg, profile)
    w = workload_of(cfg)
    devices = w.devices
    speed = get_speed(profile)
    est = estimate(w, speed)
    tokens = w.global_batch * w.seq
    weights, attention = layer_flops(w)
    model_flops = tokens * (3 * (w.layers * (weights + attention)) + 6 * w.hidden * w.vocab)
    per_device = model_flops / est["step_s"] / devices
    return {
        "target": f"{profile}:{devices}",
        "mapping": f"replica {w.d} x pipeline {w.p} x tensor {w.t}",
        "params": param_layout(cfg)["total"],
        "global_batch": w.global_batch,
        "step_time_s": est["step_s"],
        "tokens_per_s": tokens / est["step_s"],
        "model_flops_per_device_s": per_device,
        "mfu": per_device / speed.flops[w.dtype],
        "breakdown": {k: v for k, v in est.items() if k != "step_s"},
    }


def _estimate_packed(cfg: Config, profile: str) -> dict:
    """`estimate_config` of a packed-stage model (`jaxpod.planner.step_time_conv`): model
    FLOPs are 3 x the forward's per image (no recompute)."""
    speed = get_speed(profile)
    est = estimate_packed(cfg, speed)
    m, images = cfg.mesh, cfg.global_batch
    per_device = 3 * flops_per_example(cfg) * images / est["step_s"] / cfg.devices
    return {
        "target": f"{profile}:{cfg.devices}",
        "mapping": f"replica {m.replica} x pipeline {m.pipeline} x tensor {m.tensor}",
        "params": param_layout(cfg)["total"],
        "global_batch": images,
        "step_time_s": est["step_s"],
        "images_per_s": images / est["step_s"],
        "model_flops_per_device_s": per_device,
        "mfu": per_device / speed.flops[cfg.precision.compute],
        "breakdown": {k: v for k, v in est.items() if k != "step_s"},
    }


def throughput(r: dict) -> str:
    """`12,345 tokens/s` or, for an image model, `1,234 images/s`."""
    if "images_per_s" in r:
        return f"{r['images_per_s']:,.0f} images/s"
    return f"{r['tokens_per_s']:,.0f} tokens/s"


def format_estimate(r: dict) -> str:
    """The text report: the step time, its parts, throughput."""
    b = r["breakdown"]
    stages = enumerate(b.get("stage_s", ()))
    rows = [
        ("matmuls (incl. recompute)", b["matmul_s"]),
        ("memory-bound ops", b["memory_s"]),
        ("pipeline bubble", b["bubble_s"]),
        ("tensor collectives, exposed", b["tensor_exposed_s"]),
        ("pipeline sends, exposed", b["pipeline_exposed_s"]),
        ("data-parallel / RTS collectives, exposed", b["data_exposed_s"]),
        ("optimizer update", b["update_s"]),
    ]
    lines = [
        f"estimate for {r['target']}: {r['mapping']}, global batch {r['global_batch']} "
        f"({r['params'] / 1e9:.2f} B parameters; the step-time model, docs/estimate.md)",
        f"  step time          {r['step_time_s']:.3f} s",
        *(f"    {name:40s} {sec:8.3f} s" for name, sec in rows),
        *(f"    {f'stage {k} busy (lockstep: the slowest)':40s} {sec:8.3f} s" for k, sec in stages),
        f"  throughput         {throughput(r)}",
        f"  model FLOP/s/device {r['model_flops_per_device_s'] / 1e12:.1f} T (MFU {r['mfu']:.1%})",
    ]
    return "\n".join(lines)
