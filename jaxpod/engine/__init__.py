"""One engine for every model: stage layout, state, loss and gradients, update, step."""

from jaxpod.engine.build import abstract_engine, build_engine, stage_layout
from jaxpod.engine.state import OptState, TrainState
from jaxpod.engine.step import Engine

__all__ = ["Engine", "OptState", "TrainState", "abstract_engine", "build_engine", "stage_layout"]
