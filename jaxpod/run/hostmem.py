"""Host memory for virtual CPU devices: refuse a run the host cannot hold, name XLA's OOM.

Virtual CPU devices (`--xla_force_host_platform_device_count`) all live in this host's RAM,
so a mapping that "fits" each device's budget can still need more RAM than the host has: the
planner's bytes per device for XLA:CPU (on the device and offloaded to host memory) times the
devices of this process. `check_host_ram` compares that with `MemAvailable` of `/proc/meminfo` and
refuses in one line before anything is allocated (nothing is checked where jax runs on
accelerators, or where `/proc/meminfo` is absent). `oom_error` turns XLA's out-of-memory
exception into the same kind of one-line error. jax-free (the planner is analytic).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from jaxpod.config import Config
from jaxpod.errors import UserError
from jaxpod.platform import tpu_chips_attached

MEMINFO = Path("/proc/meminfo")
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")


def available_bytes(meminfo: str | Path = MEMINFO) -> int | None:
    """`MemAvailable` of a Linux `/proc/meminfo` in bytes (None if it cannot be read)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                number, *unit = value.split()
                return int(number) * (1024 if unit and unit[0].lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def on_virtual_cpu_devices() -> bool:
    """True if jax will run on the CPU (so every device shares this host's RAM): JAX_PLATFORMS
    says so, or no accelerator can start (libtpu compiles for TPUs, and runs only where TPU
    chips are attached; a GPU plugin is taken to mean a GPU)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.util.find_spec("libtpu") and tpu_chips_attached():
        return False
    return not any(importlib.util.find_spec(name) for name in _GPU_PLUGINS)


def needed_bytes(cfg: Config) -> tuple[int, int]:
    """(host bytes this process's devices need, bytes per device): `jaxpod plan`'s device and
    host totals for XLA:CPU (the `cpu` profile, whatever `memory.device` names: these devices
    are virtual CPU devices)."""
    from jaxpod.planner.backend import backend_plan

    planned = backend_plan(cfg, "cpu")
    per_device = int(planned["device_total"]) + int(planned["host_total"])
    return per_device * cfg.devices, per_device


def _fixes(cfg: Config) -> str:
    """The changes that shrink a step's bytes, but those `cfg` already has."""
    smaller = "a smaller model"
    if cfg.model.remat != "full":
        smaller += ", model.remat=full"
    return f"{smaller} or a larger memory.rts"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def host_ram_problem(cfg: Config, available: int | None = None) -> str | None:
    """The one-line reason `cfg` cannot run on this host's RAM, or None if it fits (or the
    devices are not virtual CPU devices, or the RAM is unknown)."""
    if available is None:
        if not on_virtual_cpu_devices():
            return None
        available = available_bytes()
        if available is None:
            return None
    need, per_device = needed_bytes(cfg)
    if need <= available:
        return None
    return (
        f"devices={cfg.devices} virtual CPU devices need ~{_gb(need)} of host RAM "
        f"({_gb(per_device)} each, as `jaxpod plan memory.device=cpu` counts it) but "
        f"{_gb(available)} is available; use fewer devices, {_fixes(cfg)}"
    )


def check_host_ram(cfg: Config, available: int | None = None) -> None:
    """One-line `UserError` if `cfg`'s devices need more host RAM than is available."""
    problem = host_ram_problem(cfg, available)
    if problem is not None:
        raise UserError(problem)


def is_oom(exc: BaseException) -> bool:
    """True for XLA's out-of-memory errors (`RESOURCE_EXHAUSTED`, allocation failures)."""
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def oom_error(exc: BaseException, cfg: Config) -> UserError:
    """XLA's out-of-memory exception as a one-line `UserError` naming the fix."""
    text = " ".join(str(exc).split())[:160]
    return UserError(
        f"XLA ran out of memory ({text}); `jaxpod plan` shows where the bytes go: use fewer "
        f"devices (devices={cfg.devices}), {_fixes(cfg)}"
    )
