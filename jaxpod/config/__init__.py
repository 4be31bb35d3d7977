"""The run configuration: typed sections, one loader, the validation rules (no jax)."""

from jaxpod.config.load import *  # noqa: F403
from jaxpod.config.load import __all__  # noqa: F401
