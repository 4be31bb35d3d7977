"""What the benchmark scripts share: running a job in a fresh subprocess with its own virtual
device count (fixed when jax starts) and the XLA flags every jaxpod process compiles with
(`jaxpod.platform.virtual_cpu_flags`), and printing a markdown table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jaxpod.platform import virtual_cpu_flags  # jax-free

ROOT = Path(__file__).resolve().parents[1]


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


def time_steps(step, state, batch, repeats: int, warmup: int = 2):
    """Run `state, metrics = step(state, batch)` `warmup` times, then time `repeats` steps
    (each waited for). Returns `(state, the last metrics, seconds per step)`."""
    import time

    import jax

    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return state, metrics, times


def table(title: str, header: list[str], rows: list[list]) -> str:
    """A markdown table under a `### title` heading, columns padded to their widest cell."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]

    def line(row):
        return "| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([f"\n### {title}\n", line(header), sep, *map(line, rows)])
