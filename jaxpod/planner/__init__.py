"""The pod planner: where every byte of a mapping lives (analytic, no jax)."""

from jaxpod.planner.plan import *  # noqa: F403
from jaxpod.planner.plan import __all__  # noqa: F401
