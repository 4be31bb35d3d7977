"""Rules of the `parallel` section: how the data-parallel gradient all-reduce runs.

Called by `jaxpod.config.rules.validate_and_resolve`; imports `fields` and `schema` (no jax).
"""

from jaxpod.config.fields import _check_fields, fail
from jaxpod.config.schema import Config


def check_parallel(cfg: Config) -> None:
    """`parallel.grad_allreduce` is one of its choices; `parallel.grad_bucket_bytes` >= 0."""
    _check_fields(cfg, "parallel")
    if cfg.parallel.grad_bucket_bytes < 0:
        fail(
            f"parallel.grad_bucket_bytes={cfg.parallel.grad_bucket_bytes} must be >= 0 (0: one "
            "all-reduce per gradient leaf; e.g. 4194304 fuses leaves into 4 MiB buckets)"
        )
