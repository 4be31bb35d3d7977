"""Ahead-of-time lowering and compilation of a config's train step from abstract shapes.

Nothing is materialised: the state and the batch are `ShapeDtypeStruct`s carrying their
shardings, so a mapping of a model far larger than this machine's memory can be checked
for shape errors, sharding errors and per-device memory before any hardware is spent.
`compiled.memory_analysis()` reports per-device bytes of the SPMD program; beside them,
the planner's prediction of the same quantities for this backend (`planner.backend_plan`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpod.config import Config
from jaxpod.engine import Engine, TrainState, abstract_engine
from jaxpod.planner.backend import backend_plan
from jaxpod.platform import cpu_only
from jaxpod.run.mapping import most_on_one_device


def abstract_inputs(cfg: Config, mesh: Mesh) -> tuple[Engine, TrainState, tuple]:
    """`(engine, abstract state, abstract batch)` for `cfg` on `mesh`, nothing allocated; the
    batch is one call's: a `train.batch_parts` part of the global batch."""
    engine, state = abstract_engine(cfg, mesh)
    dataset_shapes = _batch_shapes(cfg)
    batch = tuple(
        jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for (shape, dtype), sharding in zip(dataset_shapes, engine.batch_sharding, strict=True)
    )
    return engine, state, batch


def _batch_shapes(cfg: Config) -> list[tuple[tuple[int, ...], object]]:
    """Shape and dtype of each array of a call's batch (what the datasets produce)."""
    g = cfg.part_batch
    if cfg.kind.data == "images":
        size = cfg.model.image_size
        return [((g, size, size, 3), jnp.uint8), ((g,), jnp.int32)]
    return [((g, cfg.model.seq_len + 1), jnp.int32)]


# XLA's LLVM optimization level for a program compiled to be read, never run (CPU only).
INSPECT_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_to_inspect(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered` compiled to read its memory, cost and HLO, never to run it.

    On CPU the machine code is left unoptimized (`INSPECT_OPTIONS`, LLVM -O0): what is read,
    XLA's optimized HLO and its buffer assignment, is the default compile's
    (tests/run/test_compile_to_inspect.py), in less compile time (docs/benchmarks.md, "The
    test suite's time"); such a program would run slower. Other
    backends compile as they always do."""
    return lowered.compile(compiler_options=inspect_options())


def inspect_options() -> dict:
    """The compiler options of `compile_to_inspect` on this backend (`{}`: the default)."""
    return cpu_only(INSPECT_OPTIONS)


def compile_step(cfg: Config, mesh: Mesh) -> dict:
    """Lower and compile the train step to read it (`compile_to_inspect`): timings and
    per-device memory/FLOPs. With `train.batch_parts` > 1, the call that updates (the last
    part's, its summed gradients an argument): the most a call holds but for the other
    calls' scalars (tests/engine/test_batch_parts.py)."""
    t0 = time.perf_counter()
    engine, state, batch = abstract_inputs(cfg, mesh)
    t1 = time.perf_counter()
    args = engine.updating_arguments(state, batch)
    lowered = engine.train_step.lower(*args)
    t2 = time.perf_counter()
    compiled = compile_to_inspect(lowered)
    t3 = time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    state_bytes = most_on_one_device(state, kind=None)
    device_args = most_on_one_device(args)
    device_total = device_args + int(mem.temp_size_in_bytes)
    planned = backend_plan(cfg, jax.default_backend())
    return {
        "devices": mesh.size,
        "mesh": dict(mesh.shape),
        "global_batch": cfg.global_batch,
        "batch_parts": cfg.train.batch_parts,
        "build_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "compile_options": inspect_options(),
        "state_bytes_per_device": state_bytes,
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        # what the planner's device total counts: device-resident arguments + temporaries
        "device_argument_bytes": device_args,
        "device_total_bytes": device_total,
        # the planner's prediction of the same quantities on this backend's device profile
        "planned_profile": planned["profile"],
        "planned_device_argument_bytes": planned["arguments"],
        "planned_temp_bytes": planned["temporaries"],
        "planned_device_total_bytes": planned["device_total"],
        "planned_ratio": planned["device_total"] / max(device_total, 1),
        "flops_per_device": float(cost.get("flops", 0.0)),
    }


def format_compile(r: dict) -> str:
    """Human-readable summary of `compile_step`'s result."""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    parts = r.get("batch_parts", 1)
    call = "step" if parts == 1 else "call"
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    options = " ".join(f"{k}={v}" for k, v in r.get("compile_options", {}).items())
    read_only = f" (to read, not to run: {options})" if options else ""
    return "\n".join(
        [
            f"mesh           {r['devices']} devices: {mesh}; global batch {r['global_batch']}"
            + (f" in {parts} parts: this is the last part's call" if parts > 1 else ""),
            f"lowered        in {r['lower_s']:.1f} s (engine built in {r['build_s']:.1f} s)",
            f"compiled       in {r['compile_s']:.1f} s{read_only}",
            f"per device     state {mib(r['state_bytes_per_device'])}, arguments "
            f"{mib(r['argument_bytes'])}, temporaries {mib(r['temp_bytes'])}",
            f"{'':15}{'XLA':>14}{'planned':>14}   (planner: device profile "
            f"{r['planned_profile']!r})",
            f"{'arguments':15}{mib(r['device_argument_bytes']):>14}"
            f"{mib(r['planned_device_argument_bytes']):>14}   device-resident state + batch"
            + (" part + summed gradients" if parts > 1 else ""),
            f"{'temporaries':15}{mib(r['temp_bytes']):>14}{mib(r['planned_temp_bytes']):>14}",
            f"{'device total':15}{mib(r['device_total_bytes']):>14}"
            f"{mib(r['planned_device_total_bytes']):>14}   planned / XLA "
            f"{r['planned_ratio']:.2f}",
            f"flops          {r['flops_per_device']:.3e} per device per {call} (loops counted "
            "once)",
        ]
    )
