"""The planner's prediction for the backend a program is compiled on, item by item as XLA
attributes its bytes: `jaxpod compile` prints it beside `memory_analysis()`.

XLA reports a step's device-resident arguments (the state and batch kept in device memory)
and its temporaries; the planner's device total splits the same way: the arguments are the
state the device stores at rest (weights unless offloaded, their non-layer part if the
layers are; the optimizer state unless offloaded) and the batch, the temporaries all the rest.
The compiling backend's device profile (`cpu` on XLA:CPU) supplies its known differences.
"""

from __future__ import annotations

import dataclasses

from jaxpod.config import Config
from jaxpod.planner.plan import plan
from jaxpod.planner.profiles import PROFILES

# jax backend name -> the device profile that describes how it runs a step
BACKEND_PROFILES = {"cpu": "cpu"}


def backend_plan(cfg: Config, backend: str, params_override: int | None = None) -> dict:
    """`{"profile", "device_total", "arguments", "temporaries", "host_total"}` bytes per
    device, planned for `backend`: a device profile's name (a `--target`'s), a jax backend
    with a profile of its own (`BACKEND_PROFILES`), else `memory.device`'s profile."""
    name = backend if backend in PROFILES else BACKEND_PROFILES.get(backend, cfg.memory.device)
    memory = dataclasses.replace(cfg.memory, device=PROFILES[name].name, device_budget=None)
    p = plan(dataclasses.replace(cfg, memory=memory), params_override)
    b = p["bytes_per_device"]
    return {
        "profile": name,
        "device_total": b["device_total"],
        "arguments": b["arguments"],
        "temporaries": b["device_total"] - b["arguments"],
        "host_total": b["host_total"],
    }
