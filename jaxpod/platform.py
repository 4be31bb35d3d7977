"""Process-level setup that must happen before jax starts. Imports nothing from jax."""

from __future__ import annotations

import os


def use_virtual_cpu_devices(count: int) -> None:
    """Ask XLA for `count` virtual CPU devices (ignored by TPU/GPU backends).

    Must run before jax initialises its backend: the flag is read once, at start-up.
    """
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
