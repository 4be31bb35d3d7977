"""Process-level setup that must happen before jax starts. Imports nothing from jax."""

from __future__ import annotations

import os

# XLA's CPU backend schedules for thread parallelism by default, holding independent work
# alive at once; a pod's compiler schedules for memory, and so must the emulation that
# plans it (measured effect: docs/benchmarks.md, "The CPU scheduler").
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def use_virtual_cpu_devices(count: int) -> None:
    """Ask XLA for `count` virtual CPU devices (ignored by TPU/GPU backends), scheduled to
    minimise memory (`MEMORY_SCHEDULER`, unless `XLA_FLAGS` already sets that flag).

    Must run before jax initialises its backend: the flags are read once, at start-up.
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    if not any(f.split("=")[0] == MEMORY_SCHEDULER.split("=")[0] for f in flags):
        flags.append(MEMORY_SCHEDULER)
    os.environ["XLA_FLAGS"] = " ".join(flags)
