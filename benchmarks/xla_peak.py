"""What XLA:CPU's compiled train step holds at its temporaries' peak, value by value.

    python benchmarks/xla_peak.py CONFIG [OVERRIDES ...] [--top N] [--dump DIR]

Compiles the step with `--xla_dump_to` (a temporary directory), then reads the dump's
buffer assignment (each temporary's offset and size) and live ranges (over the flattened
schedule: loop bodies precede their loop) and reports the moment the live temporaries'
byte ranges cover the most: the values alive then, largest first, and grouped as copies of
entry parameters (state XLA duplicates), values alive across most of the step (loop
carries: saved residuals, gradient accumulators) and short-lived ones (a layer's working
set). Beside it, `compile_step`'s totals and the planner's. A diagnosis aid for the
planner's byte model (docs/memory.md), not a measurement of record.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxpod.platform import virtual_cpu_flags  # jax-free
from jaxpod.target.live_ranges import covered, temporaries  # jax-free

ROOT = Path(__file__).resolve().parents[1]


def report(dump: str, top: int) -> str:
    values, ranges, schedule = temporaries(dump)
    steps = max(schedule) + 1
    peak = max(range(steps), key=lambda t: covered(values, ranges, t))
    hlo = open(glob.glob(f"{dump}/*jit_train_step*after_optimizations.txt")[0]).read()
    param_copies = set(re.findall(r"%(copy[\w.]*) = \S+ copy\(%param[\w.]*\)", hlo))
    live = sorted(
        ((values[v][0], values[v][1], v) for v, (a, b) in ranges.items() if a <= peak <= b),
        key=lambda x: (-x[0], x[1]),
    )
    lines = [
        f"peak at {peak}/{steps} ({schedule.get(peak)}): "
        f"{covered(values, ranges, peak) / 1e6:.2f} MB of temporaries live"
    ]
    groups, seen = {}, set()
    for size, offset, name in live:
        if (offset, size) in seen:  # a loop carry and its aliases share one buffer
            continue
        seen.add((offset, size))
        first, last = ranges[name]
        group = (
            "copies of entry parameters"
            if name in param_copies
            else (
                "alive over an eighth of the step" if last - first > steps // 8 else "shorter-lived"
            )
        )
        groups[group] = groups.get(group, 0) + size
        if len(seen) <= top:
            lines.append(
                f"  {size / 1e6:8.3f} MB  {name:40s} {values[name][2][:44]:44s} {first}-{last}"
            )
    lines += [f"  {group}: {size / 1e6:.2f} MB" for group, size in groups.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--dump", help="keep XLA's dump in this directory (default: a temporary one)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from jaxpod.config import load_config

    if args.worker:  # inside the subprocess: XLA_FLAGS already set
        from jaxpod.inspect.compile import compile_step, format_compile
        from jaxpod.parallel.mesh import make_mesh, select_devices

        cfg = load_config(args.config, args.overrides)
        print(
            format_compile(
                compile_step(cfg, make_mesh(cfg.mesh, select_devices(cfg.total_devices)))
            )
        )
        return
    devices = load_config(args.config, args.overrides).total_devices
    with tempfile.TemporaryDirectory() as tmp:
        dump = args.dump or tmp
        dumps = f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"
        env = dict(os.environ, XLA_FLAGS=virtual_cpu_flags(devices, dumps))  # as jaxpod
        cmd = [sys.executable, __file__, args.config, *args.overrides, "--worker", "1"]
        subprocess.run(cmd, env=env, cwd=ROOT, check=True)
        print(report(dump, args.top))


if __name__ == "__main__":
    main()
