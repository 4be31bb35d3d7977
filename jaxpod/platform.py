"""Process-level setup that must happen before jax starts (imports nothing from jax at import
time), and the compiler options that apply to XLA's CPU backend only."""

from __future__ import annotations

import os

# XLA's CPU backend schedules for thread parallelism by default, holding independent work
# alive at once; a pod's compiler schedules for memory, and so must the emulation that
# plans it (measured effect: docs/benchmarks.md, "The CPU scheduler").
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def virtual_cpu_flags(count: int, existing: str = "") -> str:
    """`existing` XLA flags with the device count set to `count` and, unless they already set
    it, the memory-minimising scheduler (`MEMORY_SCHEDULER`): the flags every jaxpod process
    (CLI, tests, benchmark workers) compiles with, so they all measure the same program."""
    flags = [f for f in existing.split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={count}")
    if not any(f.split("=")[0] == MEMORY_SCHEDULER.split("=")[0] for f in flags):
        flags.append(MEMORY_SCHEDULER)
    return " ".join(flags)


def use_virtual_cpu_devices(count: int) -> None:
    """Ask XLA for `count` virtual CPU devices (ignored by TPU/GPU backends) with
    `virtual_cpu_flags`. Must run before jax initialises its backend: the flags are read once,
    at start-up.
    """
    os.environ["XLA_FLAGS"] = virtual_cpu_flags(count, os.environ.get("XLA_FLAGS", ""))


def cpu_only(options: dict) -> dict:
    """`options` (XLA compiler options) when jax runs on its CPU backend, `{}` elsewhere: the
    LLVM levels jaxpod picks for programs that run once or are only read are XLA:CPU's."""
    import jax  # here, not at the top: this module is imported before jax may start

    return dict(options) if jax.default_backend() == "cpu" else {}
