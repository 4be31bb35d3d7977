"""jaxpod: sharded training on a (replica, pipeline, tensor) pod mesh in JAX/Flax NNX.

The Python API (docs/api.md): the entry points a notebook or a script needs, the ones the
`jaxpod` commands call. Each is imported when first used (`__getattr__`), so `import jaxpod`
starts no jax: call `use_virtual_cpu_devices(n)` first where a CPU should act as n devices.

    use_virtual_cpu_devices(count)          XLA flags for `count` CPU devices, before jax starts
    preset_names() / load_config(name_or_path, ["key=value", ...]) -> Config
    mesh_for(cfg) -> jax.sharding.Mesh      the (replica, pipeline, tensor) mesh of a run
    plan(cfg) -> dict, format_plan(dict)    the planner: bytes per device, mapping, advice
    estimate_config(cfg, profile) -> dict, format_estimate(dict)   step time on `profile`
    compile_step(cfg, mesh) -> dict, format_compile(dict)   XLA's compiled bytes and traffic
    parse_target(text), compile_for_target(cfg, target) -> dict   for TPU/GPU chips not attached
    run_training(cfg) -> RunResult          train, leaving the run record in cfg.train.logdir
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "use_virtual_cpu_devices": "jaxpod.platform",
    "Config": "jaxpod.config",
    "load_config": "jaxpod.config",
    "preset_names": "jaxpod.config.presets",
    "mesh_for": "jaxpod.parallel.mesh",
    "plan": "jaxpod.planner.plan",
    "format_plan": "jaxpod.planner.report",
    "estimate_config": "jaxpod.inspect.estimate",
    "format_estimate": "jaxpod.inspect.estimate",
    "compile_step": "jaxpod.inspect.compile",
    "compile_for_target": "jaxpod.inspect.compile",
    "format_compile": "jaxpod.inspect.compile",
    "parse_target": "jaxpod.target.spec",
    "run_training": "jaxpod.run.loop",
    "RunResult": "jaxpod.run.loop",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> object:
    """The exported `name`, imported from its module on first use and kept: importing the
    planner or the engine starts jax, which a bare `import jaxpod` must not."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxpod' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names with the lazy exports among them (for completion in notebooks)."""
    return sorted({*globals(), *_EXPORTS})
