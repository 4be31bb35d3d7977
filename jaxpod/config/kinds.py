"""What kind each model is, for the code that must not import it (jax-free): the config
rules, the planner, the data loader and the engine's choice of stage layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ModelKind:
    """`data`: what a batch holds (`tokens[G, T+1]`, or `images[G, H, W, 3]` and labels);
    `stages`: how its pipeline stages are laid out (parts of one stack of identical layers,
    or heterogeneous stages packed into rows); `tensor_parallel`: whether its layers split
    over the `tensor` axis; `fixed_denominator`: whether its loss is divided by a count known
    before the batch is read (tokens or images per step), so a batch fed in parts
    (`train.batch_parts`) sums to the whole batch's loss (BERT divides by the masked tokens of
    the whole batch)."""

    data: Literal["tokens", "images"]
    stages: Literal["stacked", "packed"]
    tensor_parallel: bool
    fixed_denominator: bool


KINDS: dict[str, ModelKind] = {
    "gpt": ModelKind("tokens", "stacked", True, True),
    "bert": ModelKind("tokens", "stacked", True, False),
    "efficientnet": ModelKind("images", "packed", False, True),
}
