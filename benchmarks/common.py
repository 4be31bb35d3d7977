"""What the benchmark scripts share: their command-line options, running a job in a fresh
subprocess with its own virtual device count (fixed when jax starts) and the XLA flags every
jaxpod process compiles with (`jaxpod.platform.virtual_cpu_flags`), printing a markdown table
and writing the JSON report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jaxpod.platform import virtual_cpu_flags  # jax-free

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def options(
    doc: str,
    *,
    only: str | None = None,
    only_help: str | None = None,
    repeats: int | None = None,
    out: str | None = None,
) -> argparse.ArgumentParser:
    """A parser with the options the benchmarks share: `--only` (default `only`: the parts or
    rows to run), `--repeats` (timed steps, if `repeats`), `--out` (the JSON report, default
    `benchmarks/results/OUT`) and the hidden `--worker JOB` that `run_worker` passes."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    if only is not None:
        ap.add_argument("--only", default=only, help=only_help or "the parts to run, by letter")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help="timed steps per measurement")
    ap.add_argument("--out", default=str(RESULTS / out) if out else None, help="the JSON report")
    return ap


def serve_worker(args: argparse.Namespace, worker: Callable[[dict], dict]) -> bool:
    """In a `run_worker` subprocess (`--worker JOB`): print `worker(JOB)` as JSON, True."""
    if not args.worker:
        return False
    print(json.dumps(worker(json.loads(args.worker))))
    return True


def machine() -> dict:
    """What a report records of the run: the CPU count and the date."""
    return {"cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")}


def run_parts(parts: dict[str, Callable[[], tuple]], only: str) -> dict:
    """Run the comma-separated `only` of `parts` (name -> `() -> (result, table text)`) in
    order, printing each table, its time on stderr. Returns the machine and each result."""
    report = {"machine": machine()}
    for name in only.split(","):
        t0 = time.perf_counter()
        print(f"running ({name}) ...", file=sys.stderr, flush=True)
        report[name], text = parts[name]()
        print(text, flush=True)
        print(f"({name}) took {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return report


def write_report(report, out: str | Path) -> None:
    """`report` as JSON at `out` (its folder made), named on stderr."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {out}", file=sys.stderr)


def run_worker(script: str, job: dict, devices: int) -> dict:
    """`python script --worker JOB` with `devices` virtual CPU devices; its last stdout line
    is the JSON result."""
    env = dict(os.environ, XLA_FLAGS=virtual_cpu_flags(devices))
    proc = subprocess.run(
        [sys.executable, script, "--worker", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark job {job} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The benchmarks' mid-size GPT (on configs/tiny.yaml): 8 layers, d 256, 4 heads, seq 128.
GPT_D256 = ["model.layers=8", "model.d_model=256", "model.heads=4", "model.d_ff=1024"]
GPT_D256 += ["model.seq_len=128", "train.micro_batch=2", "optim.warmup_steps=0"]


def tiny_on_mesh(mesh: list[int] | tuple[int, int, int], overrides: list[str]) -> tuple:
    """`(cfg, mesh)` in a `run_worker` subprocess: configs/tiny.yaml with `overrides` on a
    (replica, pipeline, tensor) `mesh` of its virtual devices."""
    from jaxpod.config import load_config
    from jaxpod.parallel.mesh import make_mesh, select_devices

    r, p, t = mesh
    axes = [f"devices={r * p * t}", f"mesh.replica={r}", f"mesh.pipeline={p}", f"mesh.tensor={t}"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*axes, *overrides])
    return cfg, make_mesh(cfg.mesh, select_devices(cfg.devices))


def time_steps(step, state, batch, repeats: int, warmup: int = 2):
    """Run `state, metrics = step(state, batch)` `warmup` times, then time `repeats` steps
    (each waited for). Returns `(state, the last metrics, seconds per step)`."""
    import time

    import jax

    metrics = None
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, metrics, times


def loss_and_grads_flops(engine, state, shape: tuple[int, int]) -> float:
    """XLA's cost-analysis FLOPs of one device's `engine.loss_and_grads` on a global batch of
    int32 tokens of `shape` (sharded as the engine's batch), compiled from abstract values."""
    import jax
    import numpy as np

    tokens = jax.ShapeDtypeStruct(shape, np.int32, sharding=engine.batch_sharding[0])
    cost = jax.jit(engine.loss_and_grads).lower(state.params, (tokens,)).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A markdown table under a `### title` heading, columns padded to their widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(row):
        return "| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"\n### {title}\n", line(header), sep, *map(line, rows)])
