"""jaxpod: sharded training on a (replica, pipeline, tensor) pod mesh in JAX/Flax NNX."""

__version__ = "0.1.0"
