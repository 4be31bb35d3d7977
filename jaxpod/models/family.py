"""A model family is a plug-in: what the engine needs of a model, and where families are found.

The engine never names a model. It asks `family(cfg.model.name)` for a `Family`: the kind
(`jaxpod.config.kinds`: what a batch holds and how stages are laid out) and a `build`
function. A *stacked* family builds one module (`StackedModel`) whose layers are one stack
`[L, ...]` under the attribute `STACK`; the engine cuts that stack into pipeline stages and
runs it (`jaxpod.parallel.stack`). A *packed* family builds its pipeline stages as a list of
modules (heterogeneous stages, packed into rows by the engine) and says how its raw inputs
become floats (`prepare_inputs`); its last stage's output is the logits of an image
classifier. Parameters carry logical axes and roles (`jaxpod.models.params`): that is how
the engine shards, decays and streams them.

GPT, BERT and EfficientNet are built in; `register(name, family)` adds another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
from flax import nnx

from jaxpod.config.kinds import KINDS, ModelKind

# Random streams of per-row example keys: training and evaluation draw different ones.
TRAIN_STREAM, EVAL_STREAM = 1, 2


class StackedModel(Protocol):
    """What the engine calls on a stacked family's module. `masked`: the loss counts only the
    positions `inputs_and_targets` weights (its `keys`, one per row, are then `row_keys`)."""

    masked: bool

    def embed(self, tokens: jax.Array, tp: str | None = None) -> jax.Array:
        """`tokens[..., T] -> x[..., T, D]` (tensor-parallel over axis `tp`)."""

    def inputs_and_targets(self, tokens: jax.Array, keys: jax.Array | None = None):
        """`tokens[..., T+1] -> (inputs[..., T], targets[..., T], weights[..., T] or None)`."""

    def token_loss(self, h: jax.Array, targets: jax.Array, tp: str | None = None) -> jax.Array:
        """`h[..., D], targets[...] -> loss[...]` per token (the head)."""


@dataclass(frozen=True)
class Family:
    """`kind`: the family's `ModelKind`. `build(model_cfg, *, rngs, dtype, param_dtype)`: a
    stacked family's `StackedModel` (dtype arguments unused: the engine casts), a packed
    family's list of stage modules computing in `dtype` with parameters in `param_dtype`.
    `prepare_inputs(raw, dtype)`: a packed family's inputs as floats, on the device."""

    kind: ModelKind
    build: Callable[..., nnx.Module | list]
    prepare_inputs: Callable[[jax.Array, jax.typing.DTypeLike], jax.Array] | None = None


# Built-in families: the module that defines each one's `FAMILY` (imported when first asked)
BUILT_IN = {
    "gpt": "jaxpod.models.gpt",
    "bert": "jaxpod.models.bert",
    "efficientnet": "jaxpod.models.efficientnet",
}
_REGISTERED: dict[str, Family] = {}


def register(name: str, fam: Family) -> None:
    """Make `name` a model family (its kind included, for the code that asks `KINDS`)."""
    if name in BUILT_IN:
        raise ValueError(f"model family {name!r} is built in")
    KINDS[name] = fam.kind
    _REGISTERED[name] = fam


def family(name: str) -> Family:
    """The family of `model.name`."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in BUILT_IN:
        known = ", ".join([*BUILT_IN, *_REGISTERED])
        raise KeyError(f"model.name={name!r} is no model family; known: {known}")
    return importlib.import_module(BUILT_IN[name]).FAMILY


def build_model(cfg, seed: int) -> nnx.Module:
    """The stacked model of `cfg` (a `ModelConfig`), initialised from `seed` in float32."""
    return family(cfg.name).build(cfg, rngs=nnx.Rngs(seed))


def row_keys(seed: int, step: jax.Array, rows: jax.Array, stream: int = TRAIN_STREAM):
    """One key per global row index in `rows[B]` for optimizer step `step`:
    `fold_in(fold_in(fold_in(key(seed), stream), step), row)`, so a row's randomness (BERT's
    masks) depends on (seed, step, row), never on the mesh or how rows are split."""
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)
    return jax.vmap(lambda r: jax.random.fold_in(base, r))(rows)
