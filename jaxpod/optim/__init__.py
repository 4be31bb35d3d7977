"""Optimizers: optax chains, the precision policy, the guarded update.

`jaxpod.optim.stochastic_round(x, key, dtype)` is the rounding of 16-bit master weights
(`jaxpod.optim.precision`)."""

from jaxpod.optim.precision import stochastic_round

__all__ = ["stochastic_round"]
