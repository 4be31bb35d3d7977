"""What a divisibility rule is (`Rule`: the fields it reads, and a check returning None or its
one-line message with the fix) and the quantities several rules read from a flat dict of
config fields (`Sizes`): the model's kind, a call's and a pass's micro-batches, the key they
come from. `collector` gives a rules module its list and the decorator that fills it.

Jax-free; the rules are `jaxpod.config.divisibility_model` and `..._pipeline`, gathered in
`jaxpod.config.divisibility`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jaxpod.config.kinds import KINDS, ModelKind

Sizes = Mapping[str, Any]  # dotted key -> value, e.g. {"mesh.tensor": 2, ...}


@dataclass(frozen=True)
class Rule:
    """`check(values)`: None if the rule holds, else its one-line message; it reads only
    `fields`."""

    fields: tuple[str, ...]
    check: Callable[[Sizes], str | None]


def collector() -> tuple[list[Rule], Callable]:
    """`(rules, rule)`: a list, and the decorator `@rule(*fields)` that appends the decorated
    check to it as a `Rule` reading `fields` (in the order they are defined)."""
    rules: list[Rule] = []

    def rule(*fields: str) -> Callable:
        def register(check: Callable[[Sizes], str | None]) -> Callable:
            rules.append(Rule(fields, check))
            return check

        return register

    return rules, rule


def kind_of(v: Sizes) -> ModelKind:
    return KINDS[v["model.name"]]


def call_micro(v: Sizes) -> int:
    """Micro-batches per call of the step: `train.grad_accum / train.batch_parts`."""
    return v["train.grad_accum"] // v["train.batch_parts"]


def pass_micro(v: Sizes) -> int:
    """Micro-batches per pipeline pass: `train.pipeline_group`, or all of a call's."""
    return v["train.pipeline_group"] or call_micro(v)


def micro_name(v: Sizes, group: bool = True) -> str:
    """The key(s) a pass's micro-batch count (`group`) or a call's comes from."""
    if group and v["train.pipeline_group"]:
        return "train.pipeline_group"
    return (
        "train.grad_accum/train.batch_parts" if v["train.batch_parts"] > 1 else "train.grad_accum"
    )


def head_rows(v: Sizes, micro: int, name: str) -> tuple[int, str]:
    """`(rows, how)`: the output tokens of a pass of `micro` micro-batches on one tensor
    shard (a sequence-parallel shard holds 1/t of each sequence), which a pipelined head
    spreads over the stages, and the product that gives them."""
    mb, seq, t = v["train.micro_batch"], v["model.seq_len"], v["mesh.tensor"]
    if v["model.sequence_parallel"]:
        how = f"train.micro_batch*{name}*model.seq_len/mesh.tensor = {mb}*{micro}*{seq}/{t}"
        return mb * micro * (seq // t), how
    return mb * micro * seq, f"train.micro_batch*{name}*model.seq_len = {mb}*{micro}*{seq}"
