"""EfficientNet's block rules: its scaling fits the block names, and `model.pipeline_splits`
names blocks of the configured variant, each once, in model order (jax-free: the names come
from `jaxpod.config.efficientnet_specs`)."""

import math
import string

from jaxpod.config.efficientnet_specs import (
    BASE_BLOCK_GROUPS,
    HEAD_CH,
    coefficients,
    model_block_specs,
)
from jaxpod.config.fields import fail
from jaxpod.config.schema import Config


def check_blocks(cfg: Config) -> None:
    """EfficientNet's scaling fits its block names (a..z in a group), and `model.pipeline_splits`
    names blocks of the configured variant, each once, in model order."""
    md, letters = cfg.model, len(string.ascii_lowercase)
    total = len(BASE_BLOCK_GROUPS)
    if md.block_groups is not None and not 1 <= md.block_groups <= total:
        fail(
            f"model.block_groups={md.block_groups} must be between 1 and {total} "
            "(or null for all of the variant's block groups)"
        )
    width, depth = coefficients(md.variant, md.width_mult, md.depth_mult)
    longest = max(group[-1] for group in BASE_BLOCK_GROUPS)  # a block group's base repeats
    if longest * depth > letters:
        fail(
            f"model.depth_mult={depth:g} scales the {longest}-block group past {letters} blocks "
            f"(letters a..z name them); use model.depth_mult<={letters / longest:g}"
        )
    if not math.isfinite(width * HEAD_CH):
        fail(f"model.width_mult={width:g} is too large to scale the channels by; use e.g. 2")
    specs = model_block_specs(md)
    names = [s.name for s in specs]
    splits = list(md.pipeline_splits)
    valid = f"valid block names: {_block_names(names)}"
    for name in splits:
        if name not in names:
            of = (
                f"model.variant={md.variant}"
                + ("" if md.depth_mult is None else f" at model.depth_mult={md.depth_mult:g}")
                + ("" if md.block_groups is None else f" with model.block_groups={md.block_groups}")
            )
            fail(f"model.pipeline_splits={splits}: {name[:20]!r} is not a block of {of}; {valid}")
    for name in splits:
        if splits.count(name) > 1:
            fail(
                f"model.pipeline_splits={splits} names block {name} twice; each pipeline stage "
                f"starts at a different block ({valid})"
            )
    ordered = sorted(splits, key=names.index)
    if splits != ordered:
        fail(
            f"model.pipeline_splits={splits} is out of order; list the blocks in model order, "
            f"e.g. model.pipeline_splits=[{','.join(ordered)}]"
        )


def _block_names(names: list[str]) -> str:
    """The block names, or (more than 12) each block group's run as first-last: '4a-4c'."""
    if len(names) <= 12:
        return ", ".join(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name[:-1], []).append(name)
    return ", ".join(g[0] if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups.values())
