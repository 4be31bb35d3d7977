"""Validation and resolution of a `Config`: the rules every run configuration must satisfy.

One function per section (`check_mesh`, `check_model`, ... `check_memory`) checks that
section's fields and the rules about it, reading other sections only where a rule relates them
(the model's shapes divide over the mesh, RTS over the replicas). The cross-section resolution
fills in what the user may leave out: `resolve_replica` (mesh.replica=-1 from the devices) and
`resolve_batch` (grad_accum and global_batch from each other). Every divisibility rule (the
model over the mesh, the batch's parts and passes, the schedule, the heads, the streamed
pieces) is one table, `jaxpod.config.divisibility`, checked once the sizes are resolved.
Model-dependent rules ask what kind the model is (`cfg.kind`), not its name. Every rule
raises ``ConfigError`` with one line naming the field and the fix.

Imports `schema` and, for EfficientNet's block names, the jax-free
`jaxpod.config.efficientnet_specs` (`rules_model`), never jax: `jaxpod.config.load` builds the
dataclasses and calls `validate_and_resolve`.
"""

import dataclasses

from jaxpod.config.divisibility import enforce, sizes
from jaxpod.config.fields import _check_fields, fail, get
from jaxpod.config.rules_data import (  # noqa: F401
    BYTE_VOCAB,
    PATH_DATA,
    check_data,
    resolve_mask_id,
)
from jaxpod.config.rules_memory import check_memory, parse_bytes  # noqa: F401  (re-exported)
from jaxpod.config.rules_model import check_blocks
from jaxpod.config.rules_parallel import check_parallel
from jaxpod.config.rules_transformer import check_transformer
from jaxpod.config.schema import STEPWISE, Config

MAX_DEVICES = 256  # what `train` runs on one host's virtual CPU devices
MAX_PLANNED_DEVICES = 65536  # what the commands that only plan accept (a pod's count)
SEED_LIMIT = 2**32  # train.seed seeds numpy's generators: an unsigned 32-bit integer
INT32_MAX = 2**31 - 1  # a count the compiled step takes as an argument is an int32


def _devices(cfg: Config) -> str:
    """'devices=8', or with several processes 'devices=4 per process x 2 processes = 8 devices'."""
    if cfg.processes == 1:
        return f"devices={cfg.devices}"
    return (
        f"devices={cfg.devices} per process x {cfg.processes} processes = "
        f"{cfg.total_devices} devices"
    )


def check_mesh(cfg: Config, max_devices: int = MAX_DEVICES) -> None:
    """`devices` (of every process together) and the mesh axes."""
    if cfg.processes < 1:
        fail(f"processes={cfg.processes} must be >= 1")
    if cfg.devices < 1 or cfg.total_devices > max_devices:
        fail(f"{_devices(cfg)} must be between 1 and {max_devices}")
    if cfg.mesh.replica < 1 and cfg.mesh.replica != -1:
        fail(f"mesh.replica={cfg.mesh.replica} must be >= 1, or -1 to fill from devices")
    _check_fields(cfg, "mesh")


def resolve_replica(cfg: Config) -> int:
    """mesh.replica, filled from `total_devices` if -1; the mesh must span every device."""
    m, devices = cfg.mesh, cfg.total_devices
    if m.replica == -1:
        if devices % (m.pipeline * m.tensor):
            fail(
                f"mesh.pipeline*mesh.tensor={m.pipeline * m.tensor} does not divide "
                f"{_devices(cfg)}; change mesh.pipeline/mesh.tensor or devices"
            )
        return devices // (m.pipeline * m.tensor)
    product = m.replica * m.pipeline * m.tensor
    if product != devices:
        fail(
            f"mesh replica*pipeline*tensor = {m.replica}*{m.pipeline}*{m.tensor} = {product} does "
            f"not match {_devices(cfg)}; set mesh.replica=-1 to fill, or change devices"
        )
    return m.replica


def check_model(cfg: Config) -> None:
    """The model's fields, and its shapes against the mesh (after `check_mesh`)."""
    _check_fields(cfg, "model")
    md, mesh, kind = cfg.model, cfg.mesh, cfg.kind
    for key in ("model.width_mult", "model.depth_mult"):
        if get(cfg, key) is not None and get(cfg, key) <= 0:
            fail(f"{key}={get(cfg, key)} must be > 0 (or null for the variant's value)")
    if not kind.tensor_parallel and mesh.tensor != 1:
        fail(
            f"mesh.tensor={mesh.tensor}: model.name={md.name} is pipelined and replicated, "
            "not tensor-sharded; set mesh.tensor=1"
        )
    if kind.stages == "packed":
        if len(md.pipeline_splits) != mesh.pipeline - 1:
            fail(
                f"model.pipeline_splits={list(md.pipeline_splits)} names "
                f"{len(md.pipeline_splits)} stage boundaries but mesh.pipeline={mesh.pipeline} "
                f"needs {mesh.pipeline - 1}; e.g. model.pipeline_splits=[4a] for 2 stages"
            )
        check_blocks(cfg)
    else:
        if md.pipeline_splits:
            fail(
                f"model.pipeline_splits={list(md.pipeline_splits)} is for model.name=efficientnet; "
                "transformer layers split evenly, set model.pipeline_splits=[]"
            )
    if kind.data == "images":
        if md.image_size < 32:
            fail(f"model.image_size={md.image_size} must be >= 32 (five stride-2 stages)")
    if kind.stages == "stacked":
        check_transformer(cfg)


def check_train(cfg: Config) -> None:
    """The loop's fields (the batch sizes are resolved by `resolve_batch`)."""
    _check_fields(cfg, "train")
    if not 0 <= cfg.train.seed < SEED_LIMIT:
        fail(f"train.seed={cfg.train.seed} must be in [0, 2**32), e.g. train.seed=0")
    if not cfg.train.logdir.strip():
        fail("train.logdir='' must not be empty; e.g. train.logdir=runs/mine")
    if cfg.train.steps > INT32_MAX:  # the step counter, the data's batch index: int32 in jit
        fail(
            f"train.steps={cfg.train.steps} is more than a step counter holds "
            f"({INT32_MAX:,}, an int32 in the compiled step); use fewer steps"
        )
    profile = cfg.train.profile_steps
    if profile is not None and (len(profile) != 2 or not 0 <= profile[0] < profile[1]):
        fail(
            f"train.profile_steps={list(profile)} must be [start, stop] with 0 <= start < stop, "
            "e.g. train.profile_steps=[5,8]"
        )


def check_optim(cfg: Config) -> None:
    """The optimizer's fields."""
    _check_fields(cfg, "optim")
    if cfg.optim.lr <= 0:
        fail(f"optim.lr={cfg.optim.lr} must be > 0")


def check_precision(cfg: Config) -> None:
    """The dtypes and the loss scale."""
    _check_fields(cfg, "precision")
    if cfg.precision.loss_scale_init <= 0:
        fail(f"precision.loss_scale_init={cfg.precision.loss_scale_init} must be > 0")


def resolve_batch(cfg: Config, replica: int) -> tuple[int, int]:
    """(grad_accum, global_batch), each derived from the other (default grad_accum=1); how
    they split into parts, passes and heads is checked by `jaxpod.config.divisibility`."""
    t = cfg.train
    per_accum = t.micro_batch * replica
    if t.global_batch is None:
        grad_accum = 1 if t.grad_accum is None else t.grad_accum
    elif t.global_batch % per_accum:
        fail(
            f"train.global_batch={t.global_batch} is not divisible by "
            f"train.micro_batch*mesh.replica = {t.micro_batch}*{replica} = {per_accum}; "
            f"use a multiple of {per_accum} or drop train.global_batch"
        )
    else:
        grad_accum = t.global_batch // per_accum
        if t.grad_accum is not None and t.grad_accum != grad_accum:
            fail(
                f"train.grad_accum={t.grad_accum} disagrees with train.global_batch="
                f"{t.global_batch} (which needs grad_accum={grad_accum}); set only one, e.g. "
                "train.grad_accum=null"
            )
    if t.batch_parts > 1 and not cfg.kind.fixed_denominator:
        fail(
            f"train.batch_parts={t.batch_parts} sums the parts' losses, but model.name="
            f"{cfg.model.name} divides its loss by a count of the whole batch (masked tokens); "
            "use train.batch_parts=1"
        )
    return grad_accum, per_accum * grad_accum


def check_counts(cfg: Config, global_batch: int) -> None:
    """A step's tokens (with each sequence's next-token target) or images fit in an int32: the
    step divides its loss by that count, passed to the compiled step as an int32, and a call's
    arrays hold at most that many tokens."""
    t, md = cfg.train, cfg.model
    if cfg.kind.data == "images":
        count, what = global_batch, f"{global_batch:,} images"
    else:
        count = global_batch * (md.seq_len + 1)
        what = (
            f"train.global_batch*(model.seq_len+1) = {global_batch}*{md.seq_len + 1} = "
            f"{count:,} tokens"
        )
    if count > INT32_MAX:
        fail(
            f"train.micro_batch={t.micro_batch} makes {what} a step, more than an int32 count "
            f"holds ({INT32_MAX:,}); reduce train.micro_batch (or train.grad_accum)"
        )


def warnings(cfg: Config) -> list[str]:
    """Legal but surprising run settings, one line each (the CLI prints them)."""
    out = []
    o, t = cfg.optim, cfg.train
    if o.warmup_steps > t.steps:  # the warm-up is cut to the run: step k uses lr * (k-1) / T
        out.append(
            f"optim.warmup_steps={o.warmup_steps} is more than train.steps={t.steps}, so the "
            f"warm-up is cut to {t.steps} steps: the learning rate rises from 0 to "
            f"{o.lr * (t.steps - 1) / t.steps:.3g} at the last step and never reaches "
            f"optim.lr={o.lr:g}; use optim.warmup_steps<={t.steps}"
        )
    if t.skip_bubbles and cfg.mesh.pipeline == 1:
        out.append(
            "train.skip_bubbles=true does nothing with mesh.pipeline=1 (no pipeline, no bubble "
            "ticks); leave it out"
        )
    elif t.skip_bubbles and t.pipeline_schedule in STEPWISE:
        out.append(
            f"train.skip_bubbles=true is not used by {t.pipeline_schedule} training (its ticks "
            "run only their own op); leave it out, or use train.pipeline_schedule=gpipe or "
            "circular"
        )
    mem = cfg.memory
    if mem.phases > 1 and "params" not in mem.offload:
        out.append(
            f"memory.phases={mem.phases} keeps the layer stack in host memory between steps and "
            "fetches it a phase at a time, as memory.offload=[params] does for every weight; "
            "with memory.phases=1 it stays on the device"
        )
    return out


def validate_and_resolve(cfg: Config, max_devices: int = MAX_DEVICES) -> Config:
    """Check every section, then return `cfg` with mesh.replica, train.grad_accum and
    train.global_batch resolved; `max_devices`: the most devices the mesh may span."""
    check_mesh(cfg, max_devices)
    replica = resolve_replica(cfg)
    check_model(cfg)
    check_train(cfg)
    check_optim(cfg)
    check_data(cfg)
    check_precision(cfg)
    check_memory(cfg)
    check_parallel(cfg)
    grad_accum, global_batch = resolve_batch(cfg, replica)
    enforce(sizes(cfg, replica, grad_accum))
    check_counts(cfg, global_batch)
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, replica=replica),
        train=dataclasses.replace(cfg.train, grad_accum=grad_accum, global_batch=global_batch),
        model=dataclasses.replace(cfg.model, mask_id=resolve_mask_id(cfg)),
    )
