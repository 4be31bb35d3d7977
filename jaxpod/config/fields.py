"""Per-field config checks shared by the rules modules: `fail` (one-line `ConfigError`),
`get` (a dotted key's value) and `_check_fields` (a section's choices and ranges).

Imports `schema` only (no jax), so every `rules_*` module can use it without a cycle.
"""

import functools
import typing
from typing import Any

from jaxpod.config.schema import CHOICES, LIST_CHOICES, Config
from jaxpod.errors import ConfigError


def fail(msg: str) -> typing.NoReturn:
    """Raise a one-line ConfigError."""
    raise ConfigError(msg.replace("\r", " ").replace("\n", " "))


def get(cfg: Config, key: str) -> Any:
    """The value of a dotted key, e.g. get(cfg, "mesh.tensor")."""
    return functools.reduce(getattr, key.split("."), cfg)


_AT_LEAST_1 = (
    "mesh.pipeline mesh.tensor model.layers model.d_model model.heads model.kv_heads model.d_ff "
    "model.seq_len "
    "model.sequence_chunks "
    "model.vocab train.steps train.micro_batch train.grad_accum train.global_batch "
    "train.batch_parts train.pipeline_group train.virtual_stages "
    "train.log_every train.eval_batches train.keep_checkpoints model.norm_groups "
    "model.image_size model.num_classes data.workers precision.loss_scale_period memory.rts "
    "memory.rts_optimizer memory.phases memory.mlp_panels memory.vocab_slices"
).split()
_AT_LEAST_0 = (
    "data.prefetch",
    "optim.power",
    "optim.end_lr",
    "optim.trust_coefficient",
    "train.eval_every",
    "train.checkpoint_every",
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.grad_clip",
)
_UNIT_INTERVAL = ("optim.momentum", "optim.b1", "optim.b2")  # [0, 1)


def _check_fields(cfg: Config, section: str) -> None:
    """The per-field rules of `section`: choices, then ranges."""
    keys = lambda table: [k for k in table if k.startswith(section + ".")]  # noqa: E731
    for key in keys(CHOICES):
        if get(cfg, key) not in CHOICES[key]:
            fail(f"{key}={get(cfg, key)!r} is not one of {', '.join(CHOICES[key])}")
    for key in keys(LIST_CHOICES):
        for item in get(cfg, key):
            if item not in LIST_CHOICES[key]:
                fail(f"{key} item {item!r} is not one of {', '.join(LIST_CHOICES[key])}")
    for key in keys(_AT_LEAST_1):
        value = get(cfg, key)
        if value is not None and value < 1:
            fail(f"{key}={value} must be >= 1")
    for key in keys(_AT_LEAST_0):
        if get(cfg, key) < 0:
            fail(f"{key}={get(cfg, key)} must be >= 0")
    for key in keys(_UNIT_INTERVAL):
        if not 0 <= get(cfg, key) < 1:
            fail(f"{key}={get(cfg, key)} must be in [0, 1)")
