"""Every divisibility rule the program relies on, in one table (`RULES`): how a config's sizes
split over the mesh, the micro-batches, the pipeline's stages, passes and heads, and the
pieces that are streamed. What the program splits, each rule divides; a config these accept
builds its engine and lowers its train and eval steps (tests/inspect/test_rules_sweep.py).

A `Rule` names the fields it reads and returns, when broken, one line naming them with the
fix. It reads `sizes(cfg)`: a flat dict of those fields (`mesh.replica` and
`train.grad_accum` resolved). `first_broken(values)` checks, in order, every rule whose
fields `values` all hold, so a partial mapping can be checked too: validation
(`jaxpod.config.rules`) raises the first broken rule of a whole config (`enforce`); the
planner's search, schedule advice and suggestions prune with the same rules
(`jaxpod.inspect.search`, `jaxpod.planner.schedule_choice`, `jaxpod.planner.plan`). Jax-free.
"""

from __future__ import annotations

from jaxpod.config.divisibility_model import RULES as MODEL_RULES
from jaxpod.config.divisibility_pipeline import RULES as PIPELINE_RULES
from jaxpod.config.fields import fail
from jaxpod.config.rule_sizes import Rule, Sizes
from jaxpod.config.schema import Config

# every rule, in the order validation reports them: the model over the mesh, where the bytes
# live, the batch, the pipeline schedule, the pipelined heads
RULES: tuple[Rule, ...] = (*MODEL_RULES, *PIPELINE_RULES)
FIELDS: tuple[str, ...] = tuple(dict.fromkeys(f for r in RULES for f in r.fields))


def sizes(cfg: Config, replica: int | None = None, grad_accum: int | None = None) -> dict:
    """The value of every field the rules read, from `cfg` (resolved, or with the resolved
    `replica` and `grad_accum` given)."""
    values = {}
    for key in FIELDS:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    if replica is not None:
        values["mesh.replica"] = replica
    if grad_accum is not None:
        values["train.grad_accum"] = grad_accum
    return values


def first_broken(values: Sizes) -> str | None:
    """The message of the first rule, in table order, that `values` break, of those rules whose
    fields `values` all hold (a partial mapping is checked as far as it goes), or None. A rule
    may assume that every rule before it whose fields it reads holds."""
    for rule in RULES:
        if all(f in values for f in rule.fields):
            message = rule.check(values)
            if message is not None:
                return message
    return None


def accepts(values: Sizes) -> bool:
    """Whether no rule that `values` can be checked against is broken."""
    return first_broken(values) is None


def enforce(values: Sizes) -> None:
    """Raise the first broken rule's message as a one-line `ConfigError`."""
    message = first_broken(values)
    if message is not None:
        fail(message)
