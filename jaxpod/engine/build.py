"""Build the engine of a config: its stage layout, its state (sharded, or abstract), its steps.

Nothing is ever gathered: `abstract_engine` gives the state as `ShapeDtypeStruct`s with
shardings (any config can be lowered and compiled ahead of time, a 175 B-parameter one
included); `build_engine` initialises the state straight into its shards.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxpod.config import Config
from jaxpod.engine.state import TrainState
from jaxpod.engine.step import Engine, make_engine


def stage_layout(cfg: Config, mesh: Mesh, *, unroll: bool = False):
    """`StackedStages` for models of identical layers, `PackedStages` for models whose
    pipeline stages differ (the one place the engine asks which kind a model is)."""
    if cfg.kind.stages == "packed":
        from jaxpod.engine.packed import PackedStages

        return PackedStages(cfg, mesh, unroll=unroll)
    from jaxpod.engine.stacked import StackedStages

    return StackedStages(cfg, mesh, unroll=unroll)


def abstract_engine(
    cfg: Config, mesh: Mesh, *, bubble_fill: float = 0.0, unroll: bool = False
) -> tuple[Engine, TrainState]:
    """The engine and its state as `ShapeDtypeStruct`s with shardings (nothing allocated)."""
    stages = stage_layout(cfg, mesh, unroll=unroll)
    engine = make_engine(stages, cfg, bubble_fill=bubble_fill, unroll=unroll)
    return engine, stages.abstract_state()


def build_engine(
    cfg: Config, mesh: Mesh, *, bubble_fill: float = 0.0, unroll: bool = False
) -> tuple[Engine, TrainState]:
    """The engine and its initial state, every array created in its own shards."""
    stages = stage_layout(cfg, mesh, unroll=unroll)
    engine = make_engine(stages, cfg, bubble_fill=bubble_fill, unroll=unroll)
    return engine, stages.init_state()
