"""Validation of the `memory` section: where bytes live (device profile, budget, offload,
phases, streamed matrices, the token table's slices), checked against the model. How RTS
groups, panels, slices and phases divide is `jaxpod.config.divisibility`'s. Split from
`jaxpod.config.rules`, which calls `check_memory`; `parse_bytes` reads sizes such as `900MB`
or `16GiB`. jax-free, like every config module.
"""

from jaxpod.config.fields import _check_fields, fail
from jaxpod.config.schema import Config

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | None, key: str = "memory.device_budget") -> int | None:
    """'900MB' -> 900_000_000, '16GiB' -> 17179869184, '1234' -> 1234; None stays None."""
    if text is None:
        return None
    raw = text.strip().upper()
    digits = raw.rstrip("KMGTIB ")
    unit = raw[len(digits) :].strip()
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        fail(f"{key}={text!r} is not a size; use e.g. 900MB, 16GiB or a byte count")
    if value <= 0:
        fail(f"{key}={text!r} must be > 0")
    return int(value)


def check_memory(cfg: Config) -> None:
    """Where bytes live: the options a model's kind takes, and how they combine."""
    _check_fields(cfg, "memory")
    parse_bytes(cfg.memory.device_budget)
    mem, md = cfg.memory, cfg.model
    if cfg.kind.stages == "packed" and (
        mem.phases != 1
        or mem.rts != 1
        or mem.offload
        or mem.stream != "layer"
        or mem.mlp_panels > 1
        or mem.vocab_slices > 1
    ):
        fail(
            "memory.phases/rts/offload/stream/mlp_panels/vocab_slices are for transformer "
            f"models; leave them at 1/1/[]/layer/1/1 for model.name={md.name}"
        )
    _check_streaming(cfg)


def _check_streaming(cfg: Config) -> None:
    """How a stage's weights are cut into the pieces that are streamed (phases of layers, MLP
    panels, token-table slices, matrix by matrix): which options go together."""
    mem, md = cfg.memory, cfg.model
    if mem.phases > md.layers:
        fail(f"memory.phases={mem.phases} is more than model.layers={md.layers}; use fewer")
    if mem.mlp_panels > 1 and mem.stream != "matrix":
        fail(
            f"memory.mlp_panels={mem.mlp_panels} streams the MLP's matrices in panels, which "
            "only memory.stream=matrix does; set memory.stream=matrix or memory.mlp_panels=1"
        )
    if mem.vocab_slices > 1 and md.name != "gpt":
        fail(
            f"memory.vocab_slices={mem.vocab_slices} slices GPT's token table; model.name="
            f"{md.name} uses its table whole: set memory.vocab_slices=1"
        )
    if mem.stream == "matrix" and md.remat == "none":
        fail(
            "memory.stream=matrix makes each weight matrix a remat unit, gathered again in the "
            "backward pass; it needs a remat policy: set model.remat=full (or minimal, ...)"
        )
