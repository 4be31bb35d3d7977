"""`jaxpod search`: the fastest mappings of a config on N devices. Jax-free.

Every mapping is enumerated, never sampled: tensor width t (inside one fast domain), pipeline
depth p, replicas r = N / (t·p), the micro-batch and accumulation that make the global
batch, the schedule (GPipe, 1F1B, ZB-H1; circular and interleaved 1F1B with 2 to 4 virtual
stages; ZB-V), the remat policy and RTS over the replicas. Each choice is pruned at once by the
divisibility rules it completes (`jaxpod.config.divisibility`, the rules validation
enforces). Each mapping left is validated as a config (`jaxpod.config.load_config`), kept if
the planner says it fits the profile's memory, and ranked by the step-time model
(`jaxpod.inspect.estimate`). A packed-stage model (EfficientNet: no tensor axis, no RTS) is
cut into stages where its stages' work is most even and where its config cuts it
(`jaxpod.planner.step_time_conv.split_choices`), with remat `none` or `full`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from jaxpod.config import CHOICES, MAX_PLANNED_DEVICES, Config, load_config
from jaxpod.config.divisibility import accepts, sizes
from jaxpod.config.load import config_maker
from jaxpod.config.schema import CHUNKED
from jaxpod.errors import ConfigError
from jaxpod.inspect.estimate import estimate_config, throughput
from jaxpod.planner.plan import plan
from jaxpod.planner.speed import get_speed
from jaxpod.planner.step_time_conv import split_choices

REMATS = ("none", "full", "comms")
# a packed-stage model (EfficientNet) names no value a policy keeps: every policy but `none`
# recomputes its whole stage, as `full` does
PACKED_REMATS = ("none", "full")
# (kind, virtual stages) of every schedule tried: the round-robin chunked kinds with 2 to 4
# virtual stages a device (Megatron's runs use up to 3), ZB-V with its V's two
SCHEDULES = tuple(
    (k, v)
    for k in CHOICES["train.pipeline_schedule"]
    for v in ((2,) if k == "zb-v" else (2, 3, 4) if k in CHUNKED else (1,))
)
# the fields a mapping sets; the rest of the rules' sizes are the config's own
SEARCHED = (
    "mesh.replica",
    "mesh.pipeline",
    "mesh.tensor",
    "train.micro_batch",
    "train.grad_accum",
    "train.pipeline_schedule",
    "train.virtual_stages",
    "memory.rts",
    "memory.rts_optimizer",
)
MAX_MICRO_BATCH = 32
# the mapping a search starts from (every mapping sets these again): the config's own mesh
# may not divide a shape the command line gives
UNMAPPED = (
    "mesh.replica=-1",
    "mesh.pipeline=1",
    "mesh.tensor=1",
    "train.pipeline_schedule=gpipe",
    "train.virtual_stages=1",
    "memory.rts=1",
    "memory.rts_optimizer=1",
    "model.pipeline_splits=[]",
)
TERMS = {  # breakdown key -> what it is, for the reasons
    "matmul_s": "matmul time",
    "memory_s": "memory-bound time",
    "bubble_s": "pipeline bubble",
    "tensor_exposed_s": "exposed tensor collectives",
    "pipeline_exposed_s": "exposed pipeline sends",
    "data_exposed_s": "exposed data-parallel collectives",
    "update_s": "update time",
}


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def mappings(
    cfg: Config, devices: int, global_batch: int, fast_group: int, own: tuple = ()
) -> Iterator[list]:
    """Override lists of every mapping worth planning (see the module docstring): each choice
    made is checked at once against the divisibility rules whose fields are all chosen
    (`jaxpod.config.divisibility.accepts`), so a branch they refuse is never walked. A
    packed-stage model (no tensor axis) is cut into stages where `split_choices` says
    (`own`: the config's own `model.pipeline_splits`, tried too)."""
    base = {k: v for k, v in sizes(cfg).items() if k not in SEARCHED}
    packed = cfg.kind.stages == "packed"
    for t in (1,) if packed else divisors(min(devices, fast_group, 64)):
        at_t = {**base, "mesh.tensor": t}
        if devices % t or not accepts(at_t):
            continue
        for p in divisors(devices // t):
            r = devices // (t * p)
            at_p = {**at_t, "mesh.pipeline": p, "mesh.replica": r}
            if global_batch % r or not accepts(at_p):
                continue
            if not packed:
                yield from _batching(at_p, global_batch // r, REMATS)
                continue
            for cut in split_choices(cfg, get_speed(cfg.memory.device), p, own):
                split = [f"model.pipeline_splits=[{','.join(cut)}]"]
                for more in _batching(at_p, global_batch // r, PACKED_REMATS):
                    yield [*more, *split]


def _batching(values: dict, per_replica: int, remats: tuple) -> Iterator[list]:
    """The micro-batch, schedule, remat (of `remats`) and RTS choices of one (t, p, r) in
    `values`."""
    r, p, t = (values[f"mesh.{a}"] for a in ("replica", "pipeline", "tensor"))
    mesh = [f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}"]
    for mb in divisors(per_replica):
        if mb > MAX_MICRO_BATCH:
            break
        accum = per_replica // mb
        at_mb = {**values, "train.micro_batch": mb, "train.grad_accum": accum}
        batch = [f"train.micro_batch={mb}", f"train.grad_accum={accum}", "train.global_batch=null"]
        for kind, virtual in SCHEDULES:
            at_kind = {**at_mb, "train.pipeline_schedule": kind, "train.virtual_stages": virtual}
            if not accepts(at_kind):
                continue
            schedule = [f"train.pipeline_schedule={kind}", f"train.virtual_stages={virtual}"]
            for remat in remats:
                for rts in sorted({1, r}):
                    if not accepts({**at_kind, "memory.rts": rts, "memory.rts_optimizer": rts}):
                        continue
                    memory = [f"memory.rts={rts}", f"memory.rts_optimizer={rts}"]
                    yield [*mesh, *batch, *schedule, f"model.remat={remat}", *memory]


def mapping_maker(
    config: str, overrides: list[str], profile: str, devices: int
) -> Callable[[list[str]], Config]:
    """`make(mapping)`: the config of `config` + `overrides` on `devices` devices of `profile`
    with a mapping's overrides (`mappings`) applied, the YAML read once."""
    base = [*overrides, f"devices={devices}", f"memory.device={profile}", *UNMAPPED]
    return config_maker(config, base, max_devices=MAX_PLANNED_DEVICES)


def search(
    config: str, overrides: list[str], profile: str, devices: int, global_batch: int | None
) -> dict:
    """`{"considered", "valid", "fitting", "top": [{"overrides", "estimate", "plan_bytes"}]}`
    sorted by step time (all fitting mappings)."""
    make = mapping_maker(config, overrides, profile, devices)
    cfg = make(())
    batch = global_batch or _config_batch(config, overrides, devices)
    speed = get_speed(profile)
    own = _own_splits(config, overrides, devices) if cfg.kind.stages == "packed" else ()
    considered = valid = 0
    ranked = []
    for more in mappings(cfg, devices, batch, speed.fast_group, own):
        considered += 1
        try:
            c = make(more)
        except ConfigError:
            continue
        valid += 1
        planned = plan(c, advice=False)
        if not planned["fits"]:
            continue
        est = estimate_config(c, profile)
        ranked.append(
            {"overrides": more, "estimate": est, "plan_bytes": planned["bytes_per_device"]}
        )
    ranked.sort(key=lambda m: m["estimate"]["step_time_s"])
    return {"considered": considered, "valid": valid, "fitting": len(ranked), "top": ranked}


def alternatives(config: str, overrides: list[str], cfg: Config, top: int = 3) -> list[dict]:
    """The `top` fastest mappings of `cfg`'s model, batch and devices that fit its profile
    (`search`'s entries), for a plan that does not fit."""
    found = search(config, overrides, cfg.memory.device, cfg.devices, cfg.train.global_batch)
    return found["top"][:top]


def format_alternatives(ranked: list[dict], cfg: Config) -> str:
    """`alternatives` as the lines `jaxpod plan` prints under a plan that does not fit."""
    head = (
        f"the fastest mappings of {cfg.devices} {cfg.memory.device} devices that fit "
        "(jaxpod search; the step-time model):"
    )
    if not ranked:
        return f"{head} none"
    lines = [head]
    for m in ranked:
        total = m["plan_bytes"]["device_total"] / 1e9
        shown = _shown(m["overrides"])
        step = _time(m["estimate"]["step_time_s"])
        lines.append(f"  {' '.join(shown)} ({total:.2f} GB, {step}/step)")
    return "\n".join(lines)


def _config_batch(config: str, overrides: list[str], devices: int) -> int:
    """The global batch the config gives on `devices` devices with its own mesh."""
    on = [*overrides, f"devices={devices}", "mesh.replica=-1"]
    try:
        return load_config(config, on, max_devices=MAX_PLANNED_DEVICES).train.global_batch
    except ConfigError as exc:
        raise ConfigError(f"{exc} (or give search --global-batch)") from None


def _own_splits(config: str, overrides: list[str], devices: int) -> tuple[str, ...]:
    """The config's own `model.pipeline_splits` (none where its mesh does not fit)."""
    on = [*overrides, f"devices={devices}", "mesh.replica=-1"]
    try:
        return load_config(config, on, max_devices=MAX_PLANNED_DEVICES).model.pipeline_splits
    except ConfigError:
        return ()


def reason(a: dict, b: dict) -> str:
    """Why mapping `a` beats `b`: the term of the breakdown that differs most."""
    ba, bb = a["estimate"]["breakdown"], b["estimate"]["breakdown"]
    key = max(TERMS, key=lambda k: bb[k] - ba[k])
    gain = bb[key] - ba[key]
    if gain <= 0:
        return "ties with the next"
    return f"{TERMS[key]}: {_time(gain)} less"


def _shown(overrides: list[str]) -> list[str]:
    """A mapping's overrides as printed: without the unset batch and the optimizer's RTS when
    it is the weights' (1)."""
    return [o for o in overrides if not o.endswith(("=null", "_optimizer=1"))]


def _time(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def format_search(result: dict, top: int, target: str) -> str:
    """The text report: how many mappings were considered, fit, and the fastest with why."""
    ranked = result["top"]
    lines = [
        f"search on {target}: {result['considered']} mappings considered, {result['valid']} "
        f"valid configs, {result['fitting']} fit (the step-time model, docs/estimate.md)"
    ]
    if not ranked:
        return lines[0] + "\nno mapping fits: see `jaxpod plan` for what the smallest needs"
    for i, m in enumerate(ranked[:top], 1):
        e = m["estimate"]
        total = m["plan_bytes"]["device_total"] / 1e9
        shown = _shown(m["overrides"])
        lines.append(
            f"{i}. {_time(e['step_time_s'])}/step, {throughput(e)}, MFU "
            f"{e['mfu']:.1%}, {total:.2f} GB/device: {' '.join(shown)}"
        )
        if i < len(ranked):
            lines.append(f"   beats the next by {reason(m, ranked[i])}")
    return "\n".join(lines)
