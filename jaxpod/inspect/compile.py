"""Ahead-of-time lowering and compilation of a config's train step from abstract shapes.

Nothing is materialised: the state and the batch are `ShapeDtypeStruct`s carrying their
shardings, so a mapping of a model far larger than this machine's memory can be checked
for shape errors, sharding errors and per-device memory before any hardware is spent.
`compiled.memory_analysis()` reports per-device bytes of the SPMD program; beside them,
the planner's prediction of the same quantities for this backend (`planner.backend_plan`).
"""

from __future__ import annotations

import time
from typing import TextIO

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxpod.config import Config
from jaxpod.engine import Engine, TrainState, abstract_engine
from jaxpod.errors import UserError
from jaxpod.planner.backend import backend_plan
from jaxpod.planner.report import format_bytes
from jaxpod.run.hostmem import is_oom
from jaxpod.run.mapping import most_on_one_device
from jaxpod.run.progress import Phase
from jaxpod.target.buffers import compile_with_spaces, device_memory_bytes
from jaxpod.target.devices import describe_layout, target_devices, torus_layout, torus_mesh
from jaxpod.target.hlo import collectives, transfers
from jaxpod.target.spec import Target, check_compiles


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


def compile_to_inspect(lowered: jax.stages.Lowered, platform: str = "cpu") -> jax.stages.Compiled:
    """`lowered` compiled to read its memory, cost and HLO, never to run it.

    On CPU the machine code is left unoptimized (`INSPECT_OPTIONS`, LLVM -O0): what is read,
    XLA's optimized HLO and its buffer assignment, is the default compile's
    (tests/inspect/test_compile_to_inspect.py), in less compile time; such a program would run
    slower. Other platforms (`platform`: the devices' own, "tpu" for a `--target` compile)
    compile as they always do."""
    return lowered.compile(compiler_options=inspect_options(platform))


def inspect_options(platform: str = "cpu") -> dict:
    """The compiler options of `compile_to_inspect` for `platform` (`{}`: the default)."""
    return dict(INSPECT_OPTIONS) if platform == "cpu" and jax.default_backend() == "cpu" else {}


def compile_step(
    cfg: Config, mesh: Mesh, profile: str | None = None, progress: TextIO | None = None
) -> dict:
    """Lower and compile the train step on `mesh` to read it (`compile_to_inspect`): what the
    compiled program holds per device (`read_program`) beside the planner's prediction for
    `profile` (default: the backend's own, `backend_plan`). With `train.batch_parts` > 1,
    the call that updates (the last part's, its summed gradients an argument): the most a
    call holds but for the other calls' scalars (tests/engine/test_batch_parts.py).
    `progress`, if given, is where each stage shows its name and elapsed time (`Phase`)."""
    phase = lambda text: Phase(text, progress, prefix="jaxpod: ")
    platform = mesh.devices.flat[0].platform
    t0 = time.perf_counter()
    with phase(f"building the abstract state on {mesh.size} {platform} devices"):
        engine, state, batch = abstract_inputs(cfg, mesh)
        args = engine.updating_arguments(state, batch)
    t1 = time.perf_counter()
    with phase("lowering the train step"):
        lowered = engine.train_step.lower(*args)
    t2 = time.perf_counter()
    with phase(f"compiling it with XLA:{platform.upper()}"):
        if platform == "cpu":
            compiled, spaces = compile_to_inspect(lowered, platform), {}
        else:  # its buffer assignment by memory space: what is in HBM
            compiled, spaces = compile_with_spaces(lowered, inspect_options(platform))
    t3 = time.perf_counter()
    program = read_program(compiled, args, spaces)
    planned = backend_plan(cfg, profile or platform)
    return {
        "devices": mesh.size,
        "platform": platform,
        "mesh": dict(mesh.shape),
        "global_batch": cfg.global_batch,
        "batch_parts": cfg.train.batch_parts,
        "build_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "compile_options": inspect_options(platform),
        "state_bytes_per_device": most_on_one_device(state, kind=None),
        **program,
        # the planner's prediction of the same quantities on this backend's device profile
        "planned_profile": planned["profile"],
        "planned_device_argument_bytes": planned["arguments"],
        "planned_temp_bytes": planned["temporaries"],
        "planned_device_total_bytes": planned["device_total"],
        "planned_host_bytes": planned["host_total"],
        "planned_ratio": planned["device_total"] / max(program["device_total_bytes"], 1),
    }


def compile_for_target(cfg: Config, target: Target, progress: TextIO | None = None) -> dict:
    """`compile_step` on `target`'s compile-only devices (no accelerator attached), the mesh
    laid on its torus (`jaxpod.target.devices`), planned for the target's profile."""
    check_compiles(target, cfg)
    text = f"{target.text}: {target.chips} chips, topology {target.topology_name}"
    with Phase(text, progress, prefix="jaxpod: "):
        shape = (cfg.mesh.replica, cfg.mesh.pipeline, cfg.mesh.tensor)
        mesh = torus_mesh(shape, target_devices(target))
    # no client can load a compile-only program back: a cache entry would only warn when read
    # (jax decides once per process, so this holds where nothing compiled before: the CLI)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        result = compile_step(cfg, mesh, profile=target.profile, progress=progress)
    except jax.errors.JaxRuntimeError as exc:
        raise refused(exc, target.text) from None
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
    layout = torus_layout(mesh)
    return {"target": target.text, "layout": describe_layout(layout) if layout else "", **result}


def refused(exc: Exception, target: str) -> UserError:
    """XLA's refusal to compile the step for `target` as one line: out of HBM where its
    message says so, else its own first line (an internal check of one of its passes: the
    mapping is valid for jaxpod, and another one may compile)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if is_oom(exc):
        return UserError(f"the step does not fit {target}'s memory, as XLA compiles it: {first}")
    return UserError(
        f"XLA could not compile the step for {target} ({first}); the config is valid for "
        "jaxpod: try another mapping, or report it to XLA with the config"
    )


def read_program(compiled: jax.stages.Compiled, args: tuple, spaces: dict | None = None) -> dict:
    """What XLA's compiled program says per device: its buffer assignment
    (`memory_analysis`; by memory space, `spaces`, where the backend reports them), its FLOPs
    (`cost_analysis`, loops counted once), and from its optimized HLO the collectives and
    the host<->device transfers (`jaxpod.target.hlo`). `device_total_bytes` is what the
    planner's device total counts: the allocations in HBM where the backend reports memory
    spaces (`jaxpod.target.buffers`), else the device-resident arguments (`args`' bytes in device
    memory) plus the temporaries."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # one dict per program
        cost = cost[0] if cost else {}
    hlo = compiled.as_text()
    spaces = spaces or {}
    device_args = most_on_one_device(args)
    device_total = device_memory_bytes(spaces) if spaces else device_args + mem.temp_size_in_bytes
    peak = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    return {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "peak_bytes": peak or None,  # XLA's own peak, where the backend reports one
        "host_argument_bytes": int(mem.host_argument_size_in_bytes),
        "host_temp_bytes": int(mem.host_temp_size_in_bytes),
        "device_argument_bytes": device_args,
        # the device total's temporaries: on TPU those in HBM, without the on-chip scratch
        "device_temp_bytes": int(device_total) - device_args,
        "device_total_bytes": int(device_total),
        "memory_spaces": spaces,
        "flops_per_device": float(cost.get("flops", 0.0)),
        "collectives": collectives(hlo),
        "transfers": transfers(hlo),
    }


def format_compile(r: dict) -> str:
    """Human-readable summary of `compile_step`'s result."""
    mib = format_bytes  # decimal units, as `jaxpod plan` prints them
    parts = r.get("batch_parts", 1)
    call = "step" if parts == 1 else "call"
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    options = " ".join(f"{k}={v}" for k, v in r.get("compile_options", {}).items())
    read_only = f" (to read, not to run: {options})" if options else ""
    target = f" of {r['target']}" if r.get("target") else ""
    lines = [
        f"mesh           {r['devices']} {r['platform']} devices{target}: {mesh}; global batch "
        f"{r['global_batch']}"
        + (f" in {parts} parts: this is the last part's call" if parts > 1 else ""),
        *([f"on the torus   {r['layout']}"] if r.get("layout") else []),
        f"lowered        in {r['lower_s']:.1f} s (engine built in {r['build_s']:.1f} s)",
        f"compiled       in {r['compile_s']:.1f} s{read_only}",
        f"per device     state {mib(r['state_bytes_per_device'])}; XLA's memory analysis: "
        f"arguments {mib(r['argument_bytes'])}, temporaries {mib(r['temp_bytes'])}"
        + (f", XLA's peak {mib(r['peak_bytes'])}" if r.get("peak_bytes") else ""),
        f"host memory    arguments {mib(r['host_argument_bytes'])}, temporaries "
        f"{mib(r['host_temp_bytes'])} (planned {mib(r['planned_host_bytes'])})",
        f"{'':15}{'XLA':>14}{'planned':>14}   (planner: device profile {r['planned_profile']!r})",
        f"{'device args':15}{mib(r['device_argument_bytes']):>14}"
        f"{mib(r['planned_device_argument_bytes']):>14}   device-resident state + batch"
        + (" part + summed gradients" if parts > 1 else ""),
        f"{'device temps':15}{mib(r['device_temp_bytes']):>14}{mib(r['planned_temp_bytes']):>14}",
        f"{'device total':15}{mib(r['device_total_bytes']):>14}"
        f"{mib(r['planned_device_total_bytes']):>14}   planned / XLA {r['planned_ratio']:.2f}",
        f"flops          {r['flops_per_device']:.3e} per device per {call} (loops counted once)",
        _format_traffic(r, mib),
    ]
    return "\n".join(lines)


def _format_traffic(r: dict, mib) -> str:
    """The collectives and host transfers of the program, per device per call."""
    kinds = [
        f"{kind} {c['executed']}x {mib(c['executed_bytes'])}"
        for kind, c in r["collectives"].items()
        if c["count"]
    ]
    moves = [
        f"{way.replace('_', ' ')} {t['executed']}x {mib(t['executed_bytes'])}"
        for way, t in r["transfers"].items()
        if t["count"]
    ]
    return (
        f"collectives    {', '.join(kinds) or 'none'} (as executed, per device)\n"
        f"host transfers {', '.join(moves) or 'none'}"
    )
