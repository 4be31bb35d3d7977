"""Optimizers: optax chains, the precision policy, the guarded update."""
