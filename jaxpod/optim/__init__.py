"""Optimizers: optax chains, the precision policy, the guarded update.

`jaxpod.optim.stochastic_round(x, key, dtype)` is the rounding of 16-bit master weights
(`jaxpod.optim.precision`), loaded on first use: the planner imports `jaxpod.optim.strips`
and must not start jax."""

__all__ = ["stochastic_round"]


def __getattr__(name: str):
    if name == "stochastic_round":
        from jaxpod.optim.precision import stochastic_round

        return stochastic_round
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
