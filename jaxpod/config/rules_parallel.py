"""Rules of the `parallel` section: how the data-parallel gradient all-reduce runs.

Called by `jaxpod.config.rules.validate_and_resolve`; imports `schema` only (no jax).
"""

from jaxpod.config.schema import CHOICES, Config
from jaxpod.errors import ConfigError


def check_parallel(cfg: Config) -> None:
    """`parallel.grad_allreduce` is a known collective; `parallel.grad_bucket_bytes` >= 0."""
    p, options = cfg.parallel, CHOICES["parallel.grad_allreduce"]
    if p.grad_allreduce not in options:
        raise ConfigError(
            f"parallel.grad_allreduce={p.grad_allreduce!r} is not one of {', '.join(options)}"
        )
    if p.grad_bucket_bytes < 0:
        raise ConfigError(
            f"parallel.grad_bucket_bytes={p.grad_bucket_bytes} must be >= 0 (0: one "
            "all-reduce per gradient leaf; e.g. 4194304 fuses leaves into 4 MiB buckets)"
        )
